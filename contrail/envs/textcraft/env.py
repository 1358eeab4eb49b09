"""TextCraft: craft a Minecraft item from the crafting commands you are shown.

Reproduces the interface of AgentGym's ``agentenv-textcraft``: the first
observation lists crafting commands (the goal's recipe tree plus up to 10
distractors) and the goal; the agent writes ``get N <item>``, ``craft N
<item> using ...`` or ``inventory``; the reward is 1 when the goal is crafted.
No list of valid actions is ever given, and the recipes alone do not say
which items are base items: that takes Minecraft knowledge (or trial).

Task ids follow AgentGym: the 544 craftable items sorted by crafting depth
(ids 0-124 depth 1, 125-415 depth 2, 416-532 depth 3, 533-543 depth 4).
Splits: within each depth, a fixed seeded permutation puts 20% of the ids in
``test`` and the rest in ``train`` (108 test, 436 train); easy = depth 1-2,
hard = depth 3-4.
"""

from __future__ import annotations

import random
import re
import zlib
from functools import lru_cache
from pathlib import Path

from contrail.envs.base import SPLITS, Env, EnvOptionError, Step, Task, register
from contrail.envs.parsing import last_action
from contrail.envs.textcraft.recipes import (
    Ingredient,
    PlannedStep,
    Recipe,
    RecipeBook,
    item_id,
    item_name,
    load_recipe_book,
    plan_actions,
)

TEST_FRACTION = 0.2
SPLIT_SEED = "contrail/textcraft/split"
DIFFICULTY_DEPTHS = {"easy": (1, 2), "hard": (3, 4)}
MAX_ECHO_CHARS = 200  # error observations quote the action; a 10k-char action is not repeated whole
MAX_COUNT_DIGITS = 6  # int() of a 5,000-digit count raises in Python 3.11; no recipe needs more

# AgentGym's instruction for TextCraft, kept word for word.
INSTRUCTION = (
    'You are given few useful crafting recipes to craft items in Minecraft. Crafting commands are of the format '
    '"craft [target object] using [input ingredients]".\n'
    "Every round I will give you an observation, you have to respond an action based on the state and instruction. "
    'You can "get" an object (ingredients) from the inventory or the environment, look-up the game inventory by '
    '"inventory", or "craft" (target) using any of the crafting commands.\n'
    'Your output must strictly follow this format:"Thought:\nyour thoughts.\n\nAction:\nyour next action"\n\n'
    "Reminder: \n"
    '1. Always specify the quantity when using "get" and "craft" commands. - Example of get: get 1 lapis lazuli '
    "- Example1 of craft: craft 1 blue dye using 1 lapis lazuli "
    "- Example2 of craft: craft 1 golden carrot using 8 gold nugget, 1 carrot\n"
    '2. When using "get" command, do not specify whether the item comes from the inventory or the environment.\n'
    "3. You can use ONLY crafting commands provided, do not use your own crafting commands. However, if the "
    'crafting command uses a generic ingredient like "planks", you can use special types of the same ingredient '
    'e.g. "dark oak planks" in the command instead.\n\n'
)

_CRAFT = re.compile(r"craft (.*) using (.*)")
_GET = re.compile(r"get ([0-9]+) (.*)")
_INVENTORY = re.compile(r"inventory")
_COUNTED = re.compile(r"([0-9]+) (.*)")
_NOT_ACTION_CHARS = re.compile(r"[^A-Za-z0-9, ]+")

# Expert thoughts: a few truthful phrasings per situation, picked deterministically.
_GET_THOUGHTS = (
    "I need {count} {item} for {purpose}, and {item} cannot be crafted, so I will get it.",
    "{item} is a base ingredient of {purpose}. Let me get {count}.",
    "To make {purpose} I first need {count} {item}, which I can get directly.",
)
_CRAFT_THOUGHTS = (
    "I have the ingredients for {item}, which {purpose} needs. Let me craft it.",
    "Next I craft {count} {item} so I can make {purpose} later.",
    "{purpose} needs {item}, and I have what its recipe uses, so I craft it now.",
)
_GOAL_THOUGHTS = (
    "I have everything for {item}. Let me craft it.",
    "All the ingredients are ready, so I can craft the goal, {item}.",
    "Now I can craft {item}, the item I was asked for.",
)


class _ActionFailed(Exception):
    """An action the game refuses; ``kind`` names the reason for the step's info."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@lru_cache(maxsize=4)
def _goals(data_dir: str | None) -> tuple[tuple[str, int], ...]:
    """(goal item id, depth) per task id, in AgentGym's order."""
    return tuple(load_recipe_book(data_dir).goals())


@lru_cache(maxsize=4)
def _split_ids(data_dir: str | None) -> dict[str, frozenset[int]]:
    """Task ids per split: 20% of each depth in ``test``, by a fixed seeded permutation."""
    by_depth: dict[int, list[int]] = {}
    for task_id, (_, depth) in enumerate(_goals(data_dir)):
        by_depth.setdefault(depth, []).append(task_id)
    test: set[int] = set()
    for depth, ids in sorted(by_depth.items()):
        shuffled = list(ids)
        random.Random(f"{SPLIT_SEED}/{depth}").shuffle(shuffled)
        test.update(shuffled[: max(1, round(TEST_FRACTION * len(ids)))])
    train = set(range(len(_goals(data_dir)))) - test
    return {"train": frozenset(train), "test": frozenset(test)}


@lru_cache(maxsize=None)
def _expert_turns(data_dir: str | None, task_id: int) -> int:
    """The expert's plan length for task ``task_id``, from an empty inventory (what a reset gives)."""
    book = load_recipe_book(data_dir)
    return len(plan_actions(book, _goals(data_dir)[task_id][0], {}))


def difficulty_of_depth(depth: int) -> str:
    """``easy`` for crafting depth 1-2, ``hard`` for 3-4."""
    for level, (low, high) in DIFFICULTY_DEPTHS.items():
        if low <= depth <= high:
            return level
    raise ValueError(f"no TextCraft difficulty for crafting depth {depth}")


def normalize_action(action: str) -> str:
    """Clean an action as AgentGym's client does: keep letters, digits, commas and
    spaces, collapse whitespace; ``look`` means ``inventory``."""
    action = " ".join(_NOT_ACTION_CHARS.sub("", action).split())
    return "inventory" if action.lower() == "look" else action


def _echo(text: str) -> str:
    return text if len(text) <= MAX_ECHO_CHARS else text[:MAX_ECHO_CHARS] + "..."


def _agentgym_item_repr(name: str, count: int, book: RecipeBook) -> str:
    """How AgentGym prints an unmatched recipe output (a Python dataclass repr)."""
    ident = item_id(name)
    tag, item = (f"'{ident}'", "None") if book.is_tag(ident) else ("None", f"'{ident}'")
    return f"ItemTagWithCount(item_tag=ItemTag(tag={tag}, item_id={item}), count={count})"


@register("textcraft")
class TextCraftEnv(Env):
    """Minecraft crafting from listed recipes (AgentGym's TextCraft).

    Options: ``max_turns`` (default 30), ``data_dir`` (the ``textcraft``
    package's ``data`` directory unless given), ``max_distractors`` (10),
    ``filter_train`` (default False). The test split holds the tasks the
    expert crafts within ``max_turns`` (`expert_turns`): at the default 30
    that is every test task (the longest takes 24); under a short limit a
    test task nobody could finish would measure nothing. ``filter_train``
    applies the same rule to the train split.
    """

    name = "textcraft"
    difficulties = ("easy", "hard")
    default_max_turns = 30

    def __init__(
        self, max_turns: int | None = None, data_dir: str | Path | None = None, max_distractors: int = 10,
        filter_train: bool = False,
    ) -> None:
        super().__init__(max_turns)
        if max_distractors < 0:
            raise ValueError(f"max_distractors must be >= 0, got {max_distractors}")
        if not isinstance(filter_train, bool):
            raise EnvOptionError(f"option filter_train of textcraft: expected true or false, got {filter_train!r}")
        self.filter_train = filter_train
        self.data_dir = str(data_dir) if data_dir is not None else None
        self.max_distractors = max_distractors
        self.goal: str | None = None
        self.commands: list[Recipe] = []
        self.inventory: dict[str, int] = {}

    @property
    def book(self) -> RecipeBook:
        """The recipe tables (read once per process and data directory, on first use)."""
        return load_recipe_book(self.data_dir)

    # --- the conversation ----------------------------------------------------
    def instruction(self) -> str:
        return INSTRUCTION

    # --- tasks ---------------------------------------------------------------
    def tasks(self, split: str, difficulty: str | None = None) -> list[Task]:
        self.check_split(split, difficulty)
        goals = _goals(self.data_dir)
        found = []
        filtered = split == "test" or self.filter_train
        for task_id in sorted(_split_ids(self.data_dir)[split]):
            level = difficulty_of_depth(goals[task_id][1])
            if difficulty not in (None, level):
                continue
            if filtered and _expert_turns(self.data_dir, task_id) > self.max_turns:
                continue
            found.append(Task(self.name, task_id, split, level))
        return found

    def expert_turns(self, task: Task) -> int:
        """The turns the expert takes to craft ``task``'s goal: one per ``get`` and per ``craft``."""
        return _expert_turns(self.data_dir, task.id)

    def task_by_id(self, task_id: int) -> Task:
        """The task with id ``task_id``, whichever split holds it."""
        goals = _goals(self.data_dir)
        if not 0 <= task_id < len(goals):
            raise ValueError(f"TextCraft task ids are 0..{len(goals) - 1}, got {task_id}")
        split = next(name for name in SPLITS if task_id in _split_ids(self.data_dir)[name])
        return Task(self.name, task_id, split, difficulty_of_depth(goals[task_id][1]))

    def goal_depth(self, task: Task) -> int:
        """The crafting depth of ``task``'s goal."""
        return _goals(self.data_dir)[task.id][1]

    # --- episodes ------------------------------------------------------------
    def on_reset(self, task: Task) -> str:
        goals = _goals(self.data_dir)
        if not 0 <= task.id < len(goals):
            raise ValueError(f"not a TextCraft task: {task}")
        self.goal = goals[task.id][0]
        self.inventory = {}
        self.commands = self._crafting_commands(self.goal, random.Random(f"contrail/textcraft/{task.id}"))
        lines = "\n".join(recipe.command for recipe in self.commands)
        return f"Crafting commands:\n{lines}\n\nGoal: craft {item_name(self.goal)}."

    def _crafting_commands(self, goal: str, rng: random.Random) -> list[Recipe]:
        """The goal's recipe tree plus up to ``max_distractors`` recipes sharing its ingredients, shuffled."""
        tree = sorted(self.book.recipe_tree(goal), key=lambda recipe: recipe.command)
        candidates = self.book.distractor_candidates(tree)
        shown = tree + rng.sample(candidates, min(len(candidates), self.max_distractors))
        rng.shuffle(shown)
        return shown

    def on_step(self, text: str) -> Step:
        raw = last_action(text)
        action = normalize_action(raw or "")
        info = {"action": action, "turn": self.turns, "error": None}
        try:
            observation, solved = self._execute(action)
        except _ActionFailed as failure:
            info["error"] = "no_action" if raw is None else failure.kind
            return Step(observation=str(failure), valid=False, info=info)
        return Step(observation=observation, reward=float(solved), done=solved, success=solved, info=info)

    def _execute(self, action: str) -> tuple[str, bool]:
        """Apply a normalized action; returns (observation, goal crafted) or raises _ActionFailed."""
        if match := _CRAFT.match(action):
            return self._craft(match.group(1), match.group(2))
        if match := _GET.match(action):
            return self._get(match.group(1), match.group(2)), False
        if _INVENTORY.match(action):
            return self._inventory_text(), False
        raise _ActionFailed(f"Could not execute {_echo(action)}", "unparsable")

    def _get(self, count_text: str, name: str) -> str:
        if len(count_text) > MAX_COUNT_DIGITS:
            raise _ActionFailed(f"Could not execute get {_echo(count_text)} {_echo(name)}", "unparsable")
        if not self.book.is_base_item(item_id(name)):
            raise _ActionFailed(f"Could not find {_echo(name)}", "not_found")
        count = int(count_text)
        self.inventory[item_id(name)] = self.inventory.get(item_id(name), 0) + count
        return f"Got {count} {name}"

    def _craft(self, output_text: str, inputs_text: str) -> tuple[str, bool]:
        output_name, output_count = self._counted(output_text, default_count=True)
        inputs = [self._counted(piece.strip(), default_count=False) for piece in inputs_text.split(",")]
        output = item_id(output_name)
        if not self._holds_all(inputs):
            shown = "None" if self.book.is_tag(output) else output
            raise _ActionFailed(f"Could not find enough items to craft {_echo(shown)}", "not_enough_items")
        recipe = self._matching_recipe(output, [(item_id(name), count) for name, count in inputs])
        if recipe is None:
            failed = _agentgym_item_repr(output_name, output_count, self.book)
            raise _ActionFailed(f"Could not find a valid recipe for {_echo(failed)}", "invalid_recipe")
        for name, count in inputs:
            self._take(item_id(name), count)
        self.inventory[output] = self.inventory.get(output, 0) + recipe.count
        return f"Crafted {recipe.count} {output}", output == self.goal

    def _holds_all(self, inputs: list[tuple[str, int]]) -> bool:
        """Whether the inventory has every (name, count); a generic tag ("planks") is never held, as in AgentGym."""
        return all(
            not self.book.is_tag(item_id(name)) and self.inventory.get(item_id(name), 0) >= count
            for name, count in inputs
        )

    def _counted(self, text: str, default_count: bool) -> tuple[str, int]:
        """``"4 oak planks"`` -> (``"oak planks"``, 4); a bare name counts 1 only for the output."""
        match = _COUNTED.match(text)
        if match and len(match.group(1)) <= MAX_COUNT_DIGITS:
            return match.group(2), int(match.group(1))
        if match or not default_count:
            raise _ActionFailed(f"Wrong item format: {_echo(text)}", "wrong_format")
        return text, 1

    def _matching_recipe(self, output: str, given: list[tuple[str, int]]) -> Recipe | None:
        """The recipe for ``output`` whose ingredients are exactly ``given`` (ids with counts)."""
        for recipe in self.book.recipes.get(output, ()):
            if self._ingredients_match(recipe.ingredients, given):
                return recipe
        return None

    def _ingredients_match(self, wanted: tuple[Ingredient, ...], given: list[tuple[str, int]]) -> bool:
        left = list(given)
        for part in wanted:
            # As AgentGym: the first given item that fits the ingredient must also have its count.
            index = next((i for i, (item, _) in enumerate(left) if self.book.matches(part, item)), None)
            if index is None or left[index][1] != part.count:
                return False
            left.pop(index)
        return not left

    def _take(self, item: str, count: int) -> None:
        self.inventory[item] -= count
        if self.inventory[item] == 0:
            del self.inventory[item]

    def _inventory_text(self) -> str:
        if not self.inventory:
            return "Inventory: You are not carrying anything."
        held = "".join(f"[{item_name(item)}] ({count}) " for item, count in self.inventory.items())
        return f"Inventory: {held}"

    # --- expert and baseline -------------------------------------------------
    def expert(self) -> str:
        self.require_episode("expert()")
        plan = plan_actions(self.book, self.goal, self.inventory)
        if not plan:
            return "Thought: I already have the goal item.\nAction: inventory"
        return f"Thought: {self._thought(plan[0])}\nAction: {plan[0].action}"

    def _thought(self, step: PlannedStep) -> str:
        if step.kind == "get":
            templates = _GET_THOUGHTS
        else:
            templates = _CRAFT_THOUGHTS if step.purpose is not None else _GOAL_THOUGHTS
        choice = zlib.crc32(f"{self.task.id}/{self.turns}".encode()) % len(templates)
        thought = templates[choice].format(
            item=item_name(step.item), count=step.count, purpose=item_name(step.purpose or self.goal)
        )
        return thought[0].upper() + thought[1:]

    def random_action(self, rng: random.Random) -> str:
        """A random plausible action: get a base item named in the commands, a listed
        crafting command, or ``inventory``."""
        self.require_episode("random_action()")
        gets = sorted(
            {
                f"get {part.count} {item_name(part.name)}"
                for recipe in self.commands
                for part in recipe.ingredients
                if self.book.is_base_item(part.name)
            }
        )
        actions = gets + [recipe.command for recipe in self.commands] + ["inventory"]
        return f"Thought: Let me try this.\nAction: {rng.choice(actions)}"
