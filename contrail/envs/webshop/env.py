r"""WebShop: shop a generated catalogue by search and click; graded reward on purchase.

The interface is AgentGym's WebShop (``agentenv-webshop``, WebShop's text
mode): the model reads ``[SEP]``-joined pages (``webshop.pages``) whose only
list of clickables is the page text itself, and answers in AgentGym's ReAct
format::

    Thought:
    I think ...

    Action:
    search[keywords]        (only on the search page)
    click[value]            (a value shown on the current page, any case)

The action is read as AgentGym and WebShop read it: the text after the last
``Action:`` (or the whole output when there is none), whose first non-empty
line must start with ``<verb>[<argument>]`` (WebShop's greedy
``(.+)\[(.+)\]``, so text after the closing bracket is ignored, and
``click[a] or click[b]`` is no action). The verb is ``search`` or ``click``
in any case. Anything else, a search off the search page, or a click on
something the page does not show leaves the page unchanged: the same page
comes back with reward 0 and ``valid=False``, as WebShop "performs nothing".
No text ever raises.

Clicking ``Buy Now`` ends the episode with the graded reward of
``webshop.reward`` (success means reward 1). The catalogue and its BM25 index
are shared per process and cached on disk (``webshop.store``); goals, task
ids and difficulties are described in ``webshop.goals``.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, replace
from pathlib import Path

from contrail.envs.base import Env, Step, Task, register
from contrail.envs.webshop.catalog import PRODUCT_TYPES, Product, type_attributes
from contrail.envs.webshop.goals import Goal, difficulty_of, make_goal, split_of, task_ids
from contrail.envs.webshop.pages import NEXT, PREV, Clickable, View, clickables, render
from contrail.envs.webshop.real import RealData, real_data, real_difficulty, real_reward
from contrail.envs.webshop.reward import RewardBreakdown, purchase_reward, satisfies
from contrail.envs.webshop.store import Shop, get_shop

INSTRUCTION = (
    "You are web shopping.\n"
    "I will give you instructions about what to do.\n"
    "You have to follow the instructions.\n"
    "Every round I will give you an observation and a list of available actions, "
    "you have to respond an action based on the state and instruction.\n"
    "You can use search action if search is available.\n"
    "You can click one of the buttons in clickables.\n"
    "An action should be of the following structure:\n"
    "search[keywords]\n"
    "click[value]\n"
    "If the action is not valid, perform nothing.\n"
    "Keywords in search are up to you, but the value in click must be a value in the list of available actions.\n"
    "Remember that your keywords in search should be carefully designed.\n"
    "Your response should use the following format:\n"
    "\n"
    "Thought:\n"
    "I think ... \n"
    "\n"
    "Action: \n"
    "click[something]"
)

_ACTION_MARKER = re.compile(r"action\s*:", re.IGNORECASE)


def parse_action(text: object) -> tuple[str, str] | None:
    """``(verb, argument)`` of the action in ``text``, or None when there is none.

    The verb is lower-cased; the argument is stripped and never empty. Linear
    in the length of ``text`` (see `split_bracketed`).
    """
    if not isinstance(text, str):
        return None
    marker = None
    for found in _ACTION_MARKER.finditer(text):
        marker = found  # only the last marker counts
    tail = text[marker.end():] if marker is not None else text
    first = next((line.strip() for line in tail.splitlines() if line.strip()), "")
    parts = split_bracketed(first)
    if parts is None:
        return None
    verb, argument = parts[0].strip().lower(), parts[1].strip()
    if verb not in ("search", "click") or not argument:
        return None
    return verb, argument


def split_bracketed(line: str) -> tuple[str, str] | None:
    r"""What WebShop's ``re.match(r"(.+)\[(.+)\]", line)`` captures, found in linear time.

    The greedy groups put the split at the last ``]`` of the line and at the
    last ``[`` that leaves at least one character on each side of it; the
    regular expression itself backtracks quadratically on lines full of
    brackets. ``line`` is one line (no ``\n``).
    """
    close = line.rfind("]")
    if close < 2:  # "x[" and one character must come before it
        return None
    open_ = line.rfind("[", 1, close - 1)  # group 1 and group 2 are both non-empty
    if open_ < 0:
        return None
    return line[:open_], line[open_ + 1 : close]


def react(thought: str, action: str) -> str:
    """Model text in AgentGym's ReAct layout."""
    return f"Thought:\n{thought}\n\nAction:\n{action}"


@register("webshop")
class WebShopEnv(Env):
    """A generated shop with WebShop's pages, actions and graded reward.

    ``seed`` picks the catalogue (and so every goal); ``cache_dir`` and
    ``disk_cache`` control where the built shop is kept between processes.
    """

    name = "webshop"
    difficulties = ("easy", "hard")
    default_max_turns = 10
    acknowledgement = "Ok."  # AgentGym's WebShop reply to the instruction

    def __init__(
        self,
        max_turns: int | None = None,
        seed: int = 0,
        cache_dir: str | Path | None = None,
        disk_cache: bool = True,
        data_dir: str | Path | None = None,
        human_goals: bool = True,
    ) -> None:
        super().__init__(max_turns)
        self.seed = seed
        # WebShop's own files (`webshop.real`) instead of the generated shop: its goals are read when tasks are
        # listed (the ids depend on them), its search index is built at the first episode.
        self.data_dir, self.human_goals = data_dir, human_goals
        self._cache_dir = cache_dir
        self._disk_cache = disk_cache
        self._shop: Shop | None = None
        self.goal: Goal | None = None
        self.view = View()
        self.searches: list[str] = []
        self.last_reward: RewardBreakdown | None = None

    # --- shared data ---------------------------------------------------------
    @property
    def shop(self) -> Shop:
        """The process-wide shop of this seed (built or loaded on first use)."""
        if self._shop is None:
            real = self._real()
            self._shop = real.shop if real else get_shop(self.seed, self._cache_dir, self._disk_cache)
        return self._shop

    def _real(self) -> RealData | None:
        return real_data(self.data_dir, self.human_goals) if self.data_dir is not None else None

    # --- the conversation ----------------------------------------------------
    def instruction(self) -> str:
        return INSTRUCTION

    # --- tasks and episodes ----------------------------------------------------
    def tasks(self, split: str, difficulty: str | None = None) -> list[Task]:
        self.check_split(split, difficulty)
        real = self._real()  # real data: listing its tasks reads the files (the ids depend on them)
        if real is not None:
            found = [Task(self.name, i, split, real_difficulty(real.goals[i])) for i in real.ids(split)]
            return [task for task in found if difficulty in (None, task.difficulty)]
        return [
            Task(env=self.name, id=task_id, split=split, difficulty=difficulty_of(task_id))
            for task_id in task_ids(split)
            if difficulty is None or difficulty_of(task_id) == difficulty
        ]

    def goal_of(self, task: Task) -> Goal:
        """The goal behind ``task`` (checks that the task is one of this environment's)."""
        real = self._real()
        if real is not None:
            if task.env != self.name or task.id not in real.ids(task.split):
                raise ValueError(f"{task} is not a task of the WebShop data in {self.data_dir}")
            return real.goals[task.id]
        if task.env != self.name or split_of(task.id) != task.split or difficulty_of(task.id) != task.difficulty:
            raise ValueError(f"{task} is not a webshop task (see WebShopEnv.tasks)")
        return make_goal(self.shop.products, task.id, self.seed)

    def on_reset(self, task: Task) -> str:
        self.goal = self.goal_of(task)  # the first use of the shop builds or loads it
        self.view = View()
        self.searches = []
        self.last_reward = None
        return self.observation()

    def observation(self) -> str:
        """The current page's text."""
        score = self.last_reward.total if self.last_reward else None
        return render(self.view, self.goal.instruction, self.shop.by_asin, score)

    def on_step(self, text: str) -> Step:
        parsed = parse_action(text)
        if parsed is None:
            return self._unchanged(None, "no search[...] or click[...] action found")
        verb, argument = parsed
        action = f"{verb}[{argument}]"
        if verb == "search":
            if self.view.kind != "search":
                return self._unchanged(action, "search is only available on the search page")
            return self._search(argument, action)
        clickable = clickables(self.view, self.shop.by_asin).get(argument.lower())
        if clickable is None:
            return self._unchanged(action, f"{argument!r} is not clickable on this page")
        return self._click(clickable, action)

    def _unchanged(self, action: str | None, reason: str) -> Step:
        info = {"action": action, "page": self.view.kind, "error": reason}
        return Step(observation=self.observation(), valid=False, info=info)

    def _search(self, keywords: str, action: str) -> Step:
        keywords = keywords.lower()  # WebShop lower-cases the argument
        self.searches.append(keywords)
        self.view = View(kind="results", keywords=keywords, results=self.shop.search.search(keywords))
        return Step(observation=self.observation(), info={"action": action, "page": "results"})

    def _click(self, clickable: Clickable, action: str) -> Step:
        view = self.view
        if clickable.effect == "buy":
            return self._buy(action)
        if clickable.effect == "back_to_search":
            self.view = View()
        elif clickable.effect in ("next_page", "prev_page"):
            self.view = replace(view, page=view.page + (1 if clickable.effect == "next_page" else -1))
        elif clickable.effect == "open":
            self.view = replace(view, kind="item", asin=clickable.target, options={})
        elif clickable.effect == "option":
            self.view = replace(view, options={**view.options, clickable.target: clickable.value})
        elif clickable.effect == "sub_page":
            self.view = replace(view, kind=clickable.target)
        elif clickable.effect == "back":
            self.view = replace(view, kind="results" if view.kind == "item" else "item")
        return Step(observation=self.observation(), info={"action": action, "page": self.view.kind})

    def _buy(self, action: str) -> Step:
        product = self.shop.by_asin[self.view.asin]
        reward = real_reward if self.data_dir is not None else purchase_reward
        breakdown = reward(product, self.view.options, self.goal)
        self.last_reward = breakdown
        self.view = replace(self.view, kind="done")
        info = {"action": action, "page": "done", "asin": product.asin, "reward": asdict(breakdown)}
        success = breakdown.total == 1.0
        return Step(observation=self.observation(), reward=breakdown.total, done=True, success=success, info=info)

    # --- the expert --------------------------------------------------------------
    def expert(self) -> str:
        """Search with the goal's words, open a product that meets every constraint
        (paging if needed), choose the asked options, buy."""
        self.require_episode("expert()")
        rng = random.Random(self.goal.task_id * 1_009 + self.turns)
        kind = self.view.kind
        if kind == "search":
            return self._expert_search(rng)
        if kind == "results":
            return self._expert_results(rng)
        if kind == "item":
            return self._expert_item(rng)
        return react(rng.choice((
            f"I think I have read enough of the {kind}; I will go back to the product page.",
            f"I think the {kind} page does not change my choice, so I will return to the item.",
        )), f"click[{PREV}]")

    def _expert_search(self, rng: random.Random) -> str:
        goal = self.goal
        keywords = goal.search_words
        if keywords in self.searches:
            # the goal's words found nothing that fits: search the target's own title
            keywords = self.shop.by_asin[goal.asin].title.lower()
            return react(f"I think my first search found nothing that fits, so I will try {keywords}.",
                         f"search[{keywords}]")
        return react(rng.choice((
            f"I think I should search for {goal.product_words} with the features I need.",
            f"I think searching for {keywords} will find the {goal.product_words} I want.",
            f"I think I need a {goal.product_words}, so I will search with its key features.",
        )), f"search[{keywords}]")

    def _expert_results(self, rng: random.Random) -> str:
        goal = self.goal
        for asin in self.view.page_asins():
            if satisfies(self.shop.by_asin[asin], goal):
                return react(rng.choice((
                    f"I think {asin} has what I need and costs less than "
                    f"{goal.price_upper:.2f} dollars, so I will open it.",
                    f"I think {asin} fits my requirements; I will check its page.",
                    f"I think {asin} matches {', '.join(goal.attributes)} within my budget.",
                )), f"click[{asin}]")
        if self.view.has_next():
            return react(rng.choice((
                "I think none of the products on this page fits, so I will look at the next page.",
                "I think no result here meets every requirement; the next page may have one.",
            )), f"click[{NEXT}]")
        return react(
            "I think none of these results fits, so I will go back and search differently.",
            "click[Back to Search]",
        )

    def _expert_item(self, rng: random.Random) -> str:
        goal = self.goal
        product = self.shop.by_asin[self.view.asin]
        if not satisfies(product, goal):
            return react(rng.choice((
                "I think this product does not meet every requirement, so I will go back to the results.",
                f"I think this is not the {goal.product_words} I need; I will return to the results.",
            )), f"click[{PREV}]")
        for group, value in goal.options:
            if self.view.options.get(group) != value:
                return react(rng.choice((
                    f"I think I need to choose {value} for the {group}.",
                    f"I think the {group} should be {value}, so I will select it.",
                    f"I think I must pick {group}: {value} before buying.",
                )), f"click[{value}]")
        return react(rng.choice((
            "I think this product meets every requirement, so I will buy it.",
            f"I think this {goal.query} has everything I asked for at {product.price:.2f} dollars; I will buy it now.",
            "I think all the options are set and the price is right, so I will click Buy Now.",
        )), "click[Buy Now]")

    # --- a random baseline -------------------------------------------------------
    def random_action(self, rng: random.Random) -> str:
        """A random search on the search page, else a random clickable of the page."""
        self.require_episode("random_action()")
        if self.view.kind == "search":
            product_type = rng.choice(PRODUCT_TYPES)
            words = [product_type.name, *rng.sample(type_attributes(product_type), rng.randint(0, 2))]
            return react("I think I will try a search.", f"search[{' '.join(words)}]")
        options = list(clickables(self.view, self.shop.by_asin).values())
        return react("I think I will click something.", f"click[{rng.choice(options).label}]")

    def product(self, asin: str) -> Product:
        """The catalogue's product ``asin``."""
        return self.shop.by_asin[asin]
