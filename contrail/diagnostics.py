"""Failure modes of evaluation episodes, tagged by rules that read the conversation.

Each rule reads one trajectory record (``Trajectory.to_record()``: the task,
the outcome fields and ``messages`` with system/user/assistant/error roles)
and says whether the episode shows the failure. Tags are not exclusive. The
rules, in the order `TAGS` lists them:

``invalid_streak``
    At least `STREAK` (3) consecutive model turns were invalid actions. A
    turn's validity comes, first, from the ``"valid"`` flag on its assistant
    message (the rollout records the environment's own ``Step.valid`` there);
    for records without one (older runs), from the environment's rule below;
    a turn still unknown is settled by the record's ``invalid_actions`` count
    when that leaves no doubt (all remaining turns valid, or all invalid). Unknown turns break a streak.

    - BabyAI: not exactly one ``Action:`` line, or an action not in the
      ``Available actions: [...]`` list of the observation it answered.
    - ALFWorld: the environment answered ``Nothing happened.``
    - TextCraft: the answer starts with ``Could not`` or ``Wrong item format``.
    - WebShop: no ``search[...]``/``click[...]`` action; a search off the search
      page; a click on a value the page does not show (option group names
      count as shown: the page text does not separate them from values).
    - SearchQA: no complete, non-empty ``<search>``/``<answer>`` element.
``loop``
    The same action in at least `LOOP` (3) consecutive turns with every
    observation between them identical: repeating what changed nothing.
``answer_without_search``
    SearchQA: an ``<answer>`` before any ``<search>``.
``unsupported_answer``
    SearchQA: an answer (after a search) whose normalised text (SQuAD
    normalisation) appears in no ``<information>`` block shown so far.
``buy_without_options``
    WebShop: ``click[Buy Now]`` on an item page when the goal names options
    (``size: large``) and, since that item was opened, the agent did not click
    every option value the goal names: the paper's "confirmation bias".
``fabrication``
    An action names an entity absent from every observation so far (the
    instruction, with its examples, does not count): the paper's "state
    inconsistency". Entities per environment:

    - BabyAI: the object of ``go to``/``pickup``/``go through``/``toggle and go
      through`` without its number (``red ball``);
    - ALFWorld: every ``name N`` in the action (``apple 1``, ``fridge 1``);
    - TextCraft: the item of ``get`` and the output and ingredients of
      ``craft`` (a trailing plural ``s`` is ignored; ``minecraft:oak_planks``
      reads ``oak planks``);
    - WebShop: the value of ``click[...]`` (compared with every ``[SEP]``
      segment shown);
    - SearchQA: none (its fabricated answers are ``unsupported_answer``).
``out_of_turns``
    Not solved, no error, not truncated, and the turn limit was used up
    (``turns >= turn_limit``; the limit is the caller's -- the report passes
    ``plan.json``'s ``turn_limits``, the evaluation's actual limit per test
    experience -- else AgentGym-RL's default of the environment,
    `DEFAULT_TURN_LIMITS`). A WebShop episode
    whose last action bought something ended by its own choice, not by the limit.
``truncated``
    The episode's tokens would have overflowed ``max_episode_tokens``.
``env_error``
    The environment raised (the record's ``error``, or an ``error`` message).

>>> tags(record)                    # ["invalid_streak", "out_of_turns"]
>>> count_tags(records)             # {"invalid_streak": 3, "loop": 0, ...}
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_TURN_LIMITS",
    "LOOP",
    "STREAK",
    "TAGS",
    "Turn",
    "count_tags",
    "model_turns",
    "tags",
    "turn_validity",
]

STREAK = 3
LOOP = 3
# AgentGym-RL's turn limits (SearchQA: 5 on train tasks, 30 on test tasks).
DEFAULT_TURN_LIMITS = {"babyai": 20, "textcraft": 30, "alfworld": 30, "webshop": 10, "searchqa": 30}
_SEARCHQA_TRAIN_TURNS = 5

# Tag -> one-line description (the report prints these).
TAGS = {
    "invalid_streak": f">= {STREAK} invalid actions in a row",
    "loop": f"the same action >= {LOOP} times in a row, the observation unchanged",
    "answer_without_search": "SearchQA: answered before any search",
    "unsupported_answer": "SearchQA: an answer no retrieved passage contains",
    "buy_without_options": "WebShop: Buy Now without selecting the options the goal names",
    "fabrication": "acted on an object, item or value no observation showed",
    "out_of_turns": "ran out of turns",
    "truncated": "ran out of episode tokens",
    "env_error": "the environment raised",
}


@dataclass(frozen=True)
class Turn:
    """One model turn: what it wrote, the observation it answered, the one it got (None at the end)."""

    text: str
    before: str
    after: str | None
    valid_flag: bool | None  # the rollout's own flag, when recorded
    shown: int  # how many observations the model had seen at this turn (``before`` is the last)


def model_turns(record: Mapping[str, Any]) -> tuple[list[Turn], list[str]]:
    """(the model's turns, the observations from the first one on).

    The model's turns are the last ``turns`` assistant messages (the earlier
    ones are the prompt's acknowledgement); observations are the user
    messages from the one the first model turn answered.
    """
    messages = [m for m in record.get("messages") or [] if isinstance(m, Mapping)]
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    count = record.get("turns")
    known = isinstance(count, int) and 0 <= count <= len(assistant)
    chosen = assistant[len(assistant) - count:] if known else assistant[1:]
    if not chosen:
        return [], []
    first_user = max((i for i in range(chosen[0]) if messages[i].get("role") == "user"), default=None)
    if first_user is None:
        return [], []
    observations = [str(m.get("content", "")) for m in messages[first_user:] if m.get("role") == "user"]
    turns = []
    for index in chosen:
        users = [i for i in range(first_user, index) if messages[i].get("role") == "user"]
        following = messages[index + 1] if index + 1 < len(messages) else None
        after = str(following.get("content", "")) if following is not None and following.get("role") == "user" else None
        flag = messages[index].get("valid")
        turns.append(Turn(str(messages[index].get("content", "")), str(messages[users[-1]].get("content", "")), after,
                          flag if isinstance(flag, bool) else None, len(users)))
    return turns, observations


# --- reading actions ------------------------------------------------------------------------

_ACTION_LINE = re.compile(r"^\s*Action\s*:\s*(.*?)\s*$", re.IGNORECASE | re.MULTILINE)
_WEBSHOP_MARKER = re.compile(r"action\s*:", re.IGNORECASE)
_WEBSHOP_ACTION = re.compile(r"(.+)\[(.+)\]")
_SEARCHQA_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_SEP = " [SEP] "


def _action_lines(text: str) -> list[str]:
    return [m for m in _ACTION_LINE.findall(text or "") if m]


def _clean(action: str) -> str:
    action = re.sub(r"\s+", " ", action).strip().strip("\"'`[]").strip().rstrip(".").strip().lower()
    return "pickup " + action[len("pick up "):] if action.startswith("pick up ") else action


def _webshop_action(text: str) -> tuple[str, str] | None:
    markers = list(_WEBSHOP_MARKER.finditer(text or ""))
    tail = text[markers[-1].end():] if markers else (text or "")
    first = next((line.strip() for line in tail.splitlines() if line.strip()), "")
    match = _WEBSHOP_ACTION.match(first)
    if match is None:
        return None
    verb, argument = match.group(1).strip().lower(), match.group(2).strip()
    return (verb, argument) if verb in ("search", "click") and argument else None


def _searchqa_action(text: str) -> tuple[str, str] | None:
    match = _SEARCHQA_ACTION.search(text or "")
    if match is None or not match.group(2).strip():
        return None
    return match.group(1), match.group(2).strip()


def action_of(env: str, text: str) -> str:
    """The action a turn's text names, normalised for comparison (the stripped text when none)."""
    if env == "webshop":
        parsed = _webshop_action(text)
        return f"{parsed[0]}[{parsed[1].lower()}]" if parsed else (text or "").strip()
    if env == "searchqa":
        parsed = _searchqa_action(text)
        return f"{parsed[0]}:{normalize(parsed[1])}" if parsed else (text or "").strip()
    lines = _action_lines(text)
    return _clean(lines[-1]) if lines else (text or "").strip()


def normalize(text: str) -> str:
    """SQuAD normalisation (as SearchQA scores answers): lower case, no punctuation or articles."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


# --- validity of a turn ---------------------------------------------------------------------


def _babyai_valid(turn: Turn) -> bool | None:
    lines = _action_lines(turn.text)
    if len(lines) != 1:
        return False
    listed = turn.before.rfind("Available actions:")
    if listed < 0:
        return None
    try:
        actions = json.loads(turn.before[listed + len("Available actions:"):].strip().splitlines()[0])
    except (json.JSONDecodeError, IndexError):
        return None
    return _clean(lines[0]) in {str(a).lower() for a in actions}


def _alfworld_valid(turn: Turn) -> bool | None:
    return None if turn.after is None else turn.after.strip() != "Nothing happened."


def _textcraft_valid(turn: Turn) -> bool | None:
    if turn.after is None:
        return None
    return not turn.after.startswith(("Could not", "Wrong item format"))


def _webshop_clickables(page: str) -> set[str] | None:
    """The lower-cased values a click may name on ``page`` (None for a page not recognised)."""
    parts = page.split(_SEP)
    lower = [p.strip().lower() for p in parts]
    if lower and lower[0] == "webshop":
        return set()  # the search page: only the search box
    if "buy now" in lower:  # an item page: navigation, sub-pages, option groups and values
        start = lower.index("< prev") + 1 if "< prev" in lower else 0
        price = next((i for i, p in enumerate(lower) if p.startswith("price: $")), len(lower))
        return {"back to search", "< prev", "description", "features", "reviews", "buy now", *lower[start:price - 1]}
    if any(p.startswith("page ") and "(total results" in p for p in lower):
        asins = {lower[i] for i in range(len(lower) - 2) if lower[i + 2].startswith("$")}
        return {"back to search", *({"< prev", "next >"} & set(lower)), *asins}
    if "back to search" in lower:  # description, features, reviews
        return {"back to search", "< prev"}
    return None


def _webshop_valid(turn: Turn) -> bool | None:
    parsed = _webshop_action(turn.text)
    if parsed is None:
        return False
    clickable = _webshop_clickables(turn.before)
    if clickable is None:
        return None
    verb, argument = parsed
    if verb == "search":
        return turn.before.startswith("WebShop" + _SEP)
    return argument.lower() in clickable


def _searchqa_valid(turn: Turn) -> bool | None:
    return _searchqa_action(turn.text) is not None


_VALIDITY: dict[str, Callable[[Turn], bool | None]] = {
    "babyai": _babyai_valid, "alfworld": _alfworld_valid, "textcraft": _textcraft_valid,
    "webshop": _webshop_valid, "searchqa": _searchqa_valid,
}


def turn_validity(record: Mapping[str, Any]) -> list[bool | None]:
    """Per model turn: True (valid action), False (invalid) or None (cannot tell); see the module docstring."""
    turns, _ = model_turns(record)
    rule = _VALIDITY.get(_env(record), lambda turn: None)
    flags = [turn.valid_flag if turn.valid_flag is not None else rule(turn) for turn in turns]
    total = record.get("invalid_actions")
    unknown = [i for i, f in enumerate(flags) if f is None]
    if unknown and isinstance(total, int):
        left = total - sum(f is False for f in flags)
        if left in (0, len(unknown)):  # the count settles every unknown turn
            for i in unknown:
                flags[i] = left == 0
    return flags


# --- the rules ------------------------------------------------------------------------------


def _env(record: Mapping[str, Any]) -> str:
    return str((record.get("task") or {}).get("env", ""))


def _longest_run(flags: list[bool]) -> int:
    best = run = 0
    for flag in flags:
        run = run + 1 if flag else 0
        best = max(best, run)
    return best


def _invalid_streak(record, turns, observations) -> bool:
    return _longest_run([f is False for f in turn_validity(record)]) >= STREAK


def _loop(record, turns, observations) -> bool:
    env = _env(record)
    actions = [action_of(env, t.text) for t in turns]
    run = 1
    for i in range(1, len(turns)):
        # The observations between the run's turns are turns[t+1].before ... turns[i].before: all must be equal.
        unchanged = run == 1 or turns[i].before == turns[i - 1].before
        run = run + 1 if actions[i] == actions[i - 1] and unchanged else 1
        if run >= LOOP:
            return True
    return False


def _searchqa_answers(turns: list[Turn]) -> Iterable[tuple[str, bool, str]]:
    """(answer, searched before, information shown before) for every answer turn."""
    searched, information = False, []
    for turn in turns:
        if turn.before.startswith("<information>"):
            information.append(turn.before)
        parsed = _searchqa_action(turn.text)
        if parsed is None:
            continue
        if parsed[0] == "search":
            searched = True
        else:
            yield parsed[1], searched, " ".join(information)


def _answer_without_search(record, turns, observations) -> bool:
    return _env(record) == "searchqa" and any(not searched for _, searched, _ in _searchqa_answers(turns))


def _unsupported_answer(record, turns, observations) -> bool:
    if _env(record) != "searchqa":
        return False
    for answer, searched, information in _searchqa_answers(turns):
        wanted = normalize(answer)
        if searched and (not wanted or f" {wanted} " not in f" {normalize(information)} "):
            return True
    return False


def _goal_options(first_observation: str) -> list[str]:
    """The option values a WebShop instruction names (``..., and size: large, ...``), lower-cased."""
    parts = first_observation.split(_SEP)
    if "Instruction:" not in parts or parts.index("Instruction:") + 1 >= len(parts):
        return []
    instruction = parts[parts.index("Instruction:") + 1]
    # "i need a <words> with <c1>, and <c2>, ...": options are the "group: value" constraints
    return [part.split(": ", 1)[1].strip().lower() for part in instruction.split(", and ") if ": " in part]


def _buy_without_options(record, turns, observations) -> bool:
    if _env(record) != "webshop" or not observations:
        return False
    wanted = _goal_options(observations[0])
    if not wanted:
        return False
    chosen: set[str] = set()
    for turn in turns:
        parsed = _webshop_action(turn.text)
        if parsed is None or parsed[0] != "click":
            continue
        value = parsed[1].lower()
        page = _webshop_clickables(turn.before) or set()
        if value not in page:
            continue  # an invalid click changes nothing
        if "(total results" in turn.before.lower() and value not in ("back to search", "< prev", "next >"):
            chosen = set()  # a product opened from the results: its options start unchosen
        elif value == "buy now":
            if not set(wanted) <= chosen:
                return True
        else:
            chosen.add(value)
    return False


def _singular(text: str) -> str:
    return text.removesuffix("s")


def _textcraft_items(action: str) -> list[str]:
    action = action.lower()
    if match := re.match(r"get\s+\d+\s+(.+)$", action):
        return [match.group(1)]
    if match := re.match(r"craft\s+(?:\d+\s+)?(.+?)\s+using\s+(.+)$", action):
        ingredients = [re.sub(r"^\d+\s+", "", part.strip()) for part in match.group(2).split(",")]
        return [match.group(1), *ingredients]
    return []


def _textcraft_text(text: str) -> str:
    return " ".join(text.lower().replace("minecraft:", " ").replace("_", " ").split())


_BABYAI_VERBS = ("toggle and go through ", "go through ", "go to ", "pickup ")


def _fabricated(env: str, turn: Turn, seen: str, seen_segments: set[str]) -> bool:
    if env == "babyai":
        lines = _action_lines(turn.text)
        action = _clean(lines[-1]) if lines else ""
        verb = next((v for v in _BABYAI_VERBS if action.startswith(v)), None)
        if verb is None:
            return False
        thing = re.sub(r"\s+\d+$", "", action[len(verb):]).strip()
        return bool(thing) and thing not in seen.lower()
    if env == "alfworld":
        lines = _action_lines(turn.text)
        action = _clean(lines[-1]) if lines else ""
        return any(name not in seen.lower() for name in re.findall(r"\b[a-z]+ \d+\b", action))
    if env == "textcraft":
        lines = _action_lines(turn.text)
        shown = _textcraft_text(seen)
        items = _textcraft_items(_textcraft_text(lines[-1])) if lines else []
        return any(_singular(item) not in shown for item in items if item)
    if env == "webshop":
        parsed = _webshop_action(turn.text)
        return parsed is not None and parsed[0] == "click" and parsed[1].strip().lower() not in seen_segments
    return False


def _fabrication(record, turns, observations) -> bool:
    env = _env(record)
    segments: set[str] = set()
    for turn in turns:
        shown = observations[:turn.shown]  # every observation up to the one this turn answers
        segments.update(p.strip().lower() for text in shown for p in text.split(_SEP))
        if _fabricated(env, turn, "\n".join(shown), segments):
            return True
    return False


def _turn_limit(record: Mapping[str, Any], turn_limit: int | None) -> int | None:
    if turn_limit is not None:
        return turn_limit
    env = _env(record)
    if env == "searchqa" and (record.get("task") or {}).get("split") == "train":
        return _SEARCHQA_TRAIN_TURNS
    return DEFAULT_TURN_LIMITS.get(env)


_RULES = {
    "invalid_streak": _invalid_streak,
    "loop": _loop,
    "answer_without_search": _answer_without_search,
    "unsupported_answer": _unsupported_answer,
    "buy_without_options": _buy_without_options,
    "fabrication": _fabrication,
}


def tags(record: Mapping[str, Any], *, turn_limit: int | None = None) -> list[str]:
    """The failure tags of one trajectory record, in `TAGS` order.

    ``turn_limit`` is the episode's turn limit when known (an experiment's
    ``max_turns`` or environment option); else the environment's default.
    """
    turns, observations = model_turns(record)
    found = {name for name, rule in _RULES.items() if rule(record, turns, observations)}
    error = record.get("error") is not None or any(
        isinstance(m, Mapping) and m.get("role") == "error" for m in record.get("messages") or [])
    if error:
        found.add("env_error")
    if record.get("truncated"):
        found.add("truncated")
    limit = _turn_limit(record, turn_limit)
    bought = _env(record) == "webshop" and bool(turns) and action_of("webshop", turns[-1].text) == "click[buy now]"
    if (limit is not None and int(record.get("turns") or 0) >= limit and not record.get("success")
            and not error and not record.get("truncated") and not bought):
        found.add("out_of_turns")
    return [name for name in TAGS if name in found]


def count_tags(records: Iterable[Mapping[str, Any]], *, turn_limit: int | None = None) -> dict[str, int]:
    """How many records carry each tag (every tag present, 0 when none)."""
    counts = dict.fromkeys(TAGS, 0)
    for record in records:
        for name in tags(record, turn_limit=turn_limit):
            counts[name] += 1
    return counts
