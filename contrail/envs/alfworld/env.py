"""ALFWorld: household tasks on the real engine, presented as AgentGym presents them.

Games are alfworld's own TextWorld games (``tw-pddl``: its PDDL domain, its
grammar, a PDDL problem) played through textworld's PDDL engine behind
alfworld's wrappers (see ``engine``). The game files are a download
that cannot be had here, so by default they are generated from the tables the
package ships (see ``games``) and written once to a cache directory;
real ``game.tw-pddl`` files load through the same class (``game_files=`` or
``game_dir=``).

What the agent sees follows AgentGym's ``agentenv-alfworld``: the first
observation is the room and the task, then ``AVAILABLE ACTIONS: a,b,...``
(the first turn only); later observations are the engine's feedback with
"You arrive at ..." stripped. Actions are the last ``Action:`` line, in
alfworld 0.3.3's grammar (``put X in/on Y``) or 0.4's (``move X to Y``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import weakref
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Mapping, Sequence

from contrail.envs.alfworld import games
from contrail.envs.alfworld.expert import World, next_move, parse_goal
from contrail.envs.base import Env, Step, Task, register
from contrail.envs.parsing import last_action

logger = logging.getLogger(__name__)

NOTHING_HAPPENED = "Nothing happened."
TRAIN_PER_TYPE = 500
TEST_PER_TYPE = 50
TEST_ID_BASE = 100_000  # test ids start here, so no test id is ever a train id

# AgentGym's ReAct instruction for ALFWorld (agentenv/envs/alfworld.py), verbatim.
INSTRUCTION = (
    "Interact with a household to solve a task. Imagine you are an intelligent agent in a household "
    "environment and your target is to perform actions to complete the task goal. At the beginning of your "
    "interactions, you will be given the detailed description of the current environment and your goal to "
    "accomplish. For each of your turn, you will be given a list of actions which you can choose one to perform "
    'in this turn. You should choose from two actions: "THOUGHT" or "ACTION". If you choose "THOUGHT", you '
    "should first think about the current condition and plan for your future actions, and then output your "
    'action in this turn. Your output must strictly follow this format:"Thought:\nyour thoughts.\n\nAction:\n'
    'your next action"; If you choose "ACTION", you should directly output the action in this turn. Your output '
    'must strictly follow this format:"Action:\nyour next action". After your each turn, the environment will '
    "give you immediate feedback based on which you plan your next few steps. if the envrionment output "
    '"Nothing happened", that means the previous action is invalid and you should try more options.\n'
    " Reminder: \n1. the action must be chosen from the given available actions. Any actions except provided "
    "available actions will be regarded as illegal. \n2. Think when necessary, try to act directly more in the "
    "process."
)


# --- where games come from ---------------------------------------------------------


@dataclass(frozen=True)
class _GameEntry:
    path: str
    task_type: str


class _GeneratedCatalogue:
    """Generated games: ``id % 6`` is the task type, floor plans split as ALFRED's seen/unseen."""

    def __init__(self, cache_dir: str | None) -> None:
        self.cache_dir = Path(cache_dir) if cache_dir else None

    def ids(self, split: str) -> list[int]:
        base, count = (0, TRAIN_PER_TYPE) if split == "train" else (TEST_ID_BASE, TEST_PER_TYPE)
        return [base + offset for offset in range(count * len(games.TASK_TYPES))]

    def entry(self, task: Task) -> _GameEntry:
        index, task_type = divmod(self._offset(task), len(games.TASK_TYPES))
        spec = games.game_spec(games.TASK_TYPES[task_type], task.split, index)
        return _GameEntry(str(games.game_file(spec, self.cache_dir)), spec.task_type)

    def task_type(self, task: Task) -> str:
        return games.TASK_TYPES[self._offset(task) % len(games.TASK_TYPES)]

    @staticmethod
    def _offset(task: Task) -> int:
        return task.id - (TEST_ID_BASE if task.split == "test" else 0)


class _FileCatalogue:
    """Real ``game.tw-pddl`` files, per split; ids index the sorted files (test ids offset)."""

    def __init__(self, files: Mapping[str, Sequence[str]]) -> None:
        self.entries = {split: [_file_entry(path) for path in sorted(files.get(split, ()))]
                        for split in ("train", "test")}
        self.entries = {split: [e for e in entries if e is not None] for split, entries in self.entries.items()}

    def ids(self, split: str) -> list[int]:
        base = TEST_ID_BASE if split == "test" else 0
        return [base + index for index in range(len(self.entries[split]))]

    def entry(self, task: Task) -> _GameEntry:
        return self.entries[task.split][task.id - (TEST_ID_BASE if task.split == "test" else 0)]

    def task_type(self, task: Task) -> str:
        return self.entry(task).task_type


def _file_entry(path: str) -> _GameEntry | None:
    """The game at ``path`` with its task type, or None for the kinds AlfredTWEnv skips."""
    if "movable" in path or "Sliced" in path:
        return None
    with open(path) as handle:
        game = json.load(handle)
    if game.get("solvable") is False:
        return None
    return _GameEntry(str(path), parse_goal(game["pddl_problem"]).task_type)


def _files_in(game_dir: str) -> dict[str, list[str]]:
    """ALFWorld's layout: ``train/`` games train; ``valid_seen``/``valid_unseen``/... test."""
    files: dict[str, list[str]] = {"train": [], "test": []}
    for root, _, names in os.walk(game_dir):
        if "game.tw-pddl" in names:
            split = "train" if "train" in Path(root).relative_to(game_dir).parts[:1] else "test"
            files[split].append(os.path.join(root, "game.tw-pddl"))
    return files


@lru_cache(maxsize=8)
def _catalogue(game_files: tuple | None, game_dir: str | None, cache_dir: str | None):
    if game_files is not None:
        return _FileCatalogue({split: list(paths) for split, paths in game_files})
    if game_dir is not None:
        return _FileCatalogue(_files_in(game_dir))
    return _GeneratedCatalogue(cache_dir)


# --- presentation -------------------------------------------------------------------

_ARRIVAL = re.compile(r"^You arrive at [^.]*\.\s*")
_PUT = re.compile(r"^put (.+?) (?:in/on|in|on|into|onto|to) (.+)$")
_MOVE = re.compile(r"^move (.+?) to (.+)$")


def to_engine(action: str) -> str:
    """Normalise an action and translate alfworld 0.3.3's ``put X in/on Y`` into the engine's ``move X to Y``."""
    action = " ".join(action.strip().strip("`'\"").rstrip(".").lower().split())
    return _PUT.sub(r"move \1 to \2", action)


def to_agentgym(command: str) -> str:
    """The engine's ``move X to Y`` in the 0.3.3 grammar AgentGym shows (``put X in/on Y``)."""
    return _MOVE.sub(r"put \1 in/on \2", command)


def first_observation(intro: str, admissible: Sequence[str]) -> str:
    """Room and task without the banner (as AgentGym cuts it), then the admissible actions."""
    body = "\n".join(intro.split("\n\n")[1:])
    return f"{body}\nAVAILABLE ACTIONS: {','.join(to_agentgym(c) for c in admissible)}"


def feedback(text: str) -> str:
    """Engine feedback as AgentGym shows it: the arrival sentence stripped."""
    return _ARRIVAL.sub("", text.strip(), count=1)


# --- the environment ----------------------------------------------------------------

_THOUGHTS = {
    "go_fetch": (
        "I need a {item_kind}. There is one at {place}, so I will go there.",
        "First I should get a {item_kind}; {place} has one.",
        "To start, let me head to {place} to find a {item_kind}.",
    ),
    "open": ("{place} is closed. I will open it.", "I need to open {place} first.", "Let me open {place}."),
    "take": ("I see {item} here. I will take it.", "{item} is what I need, so I pick it up.", "Let me take {item}."),
    "go_appliance": (
        "Now I need to {verb} {item}. I will go to {place}.",
        "With {item} in hand, I should go to {place} to {verb} it.",
        "Next, {place} can {verb} the {item_kind}.",
    ),
    "clean": ("I will clean {item} with {place}.", "Let me clean {item} here.", "Time to clean {item}."),
    "heat": ("I will heat {item} with {place}.", "Let me heat {item} here.", "Time to heat {item}."),
    "cool": ("I will cool {item} with {place}.", "Let me cool {item} here.", "Time to cool {item}."),
    "go_target": (
        "Now I should put {item} in/on {place}. Let me go there.",
        "Next I will bring {item} to {place}.",
        "I have {item}; {place} is where it belongs.",
    ),
    "place": (
        "I will put {item} in/on {place}.",
        "Let me put {item} in/on {place}.",
        "Now I place {item} in/on {place}.",
    ),
    "go_drop": (
        "I am holding {item}, which the task does not need. I will take it to {place}.",
        "First I must free my hands; {place} can hold {item}.",
        "Let me bring {item} to {place} and leave it there.",
    ),
    "drop": (
        "I will put {item} down in/on {place}.",
        "Let me leave {item} in/on {place}.",
        "I put {item} in/on {place}.",
    ),
    "go_lamp": (
        "I have the object. Now I need light: {item} is at {place}.",
        "Next I should go to {place}, where {item} is.",
        "To look at it under the light, I will go to {place}.",
    ),
    "use": ("I will turn on {place} to look at {item}.", "Let me use {place}.", "Now I switch on {place}."),
}
_VERBS = {"go_appliance": {"sinkbasin": "clean", "microwave": "heat", "fridge": "cool"}}


def _thought(move, rng: random.Random) -> str:
    kind = lambda name: re.sub(r"\s+\d+$", "", name)  # noqa: E731 - "apple 1" -> "apple"
    verb = next((v for key, v in _VERBS["go_appliance"].items() if move.place.startswith(key)), "use")
    template = rng.choice(_THOUGHTS[move.purpose])
    text = template.format(item=move.item, item_kind=kind(move.item), place=move.place, verb=verb)
    return text[0].upper() + text[1:]


def _require_engine() -> None:
    try:
        import alfworld.info  # noqa: F401
        import fast_downward  # noqa: F401
        import textworld  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"the alfworld environment needs the extra: pip install 'contrail[alfworld]' ({error})"
        ) from error


@register("alfworld")
class ALFWorldEnv(Env):
    """ALFWorld's six household task types on the real engine.

    Options: ``game_files`` (``{"train": [...], "test": [...]}`` of real
    ``game.tw-pddl`` paths; a plain list is a test set) or ``game_dir`` (ALFWorld's ``json_2.1.1`` folder:
    ``train/`` trains, the ``valid_*`` folders test); without either, games
    are generated and cached under ``cache_dir`` (default
    ``$CONTRAIL_ALFWORLD_CACHE``, else ``alfworld/`` in contrail's cache, ``$CONTRAIL_CACHE``).
    """

    name = "alfworld"
    difficulties = ("easy", "hard")
    default_max_turns = 30
    cheap_to_hold = False  # each live episode holds a pooled engine and its 33 MB library (`engine`)

    def __init__(
        self,
        max_turns: int | None = None,
        game_files: Mapping[str, Sequence[str]] | Sequence[str] | None = None,
        game_dir: str | Path | None = None,
        cache_dir: str | Path | None = None,
    ) -> None:
        super().__init__(max_turns)
        if game_files is not None and not isinstance(game_files, Mapping):
            game_files = {"train": [], "test": list(game_files)}  # real games to evaluate on
        frozen = None if game_files is None else tuple((s, tuple(map(str, p))) for s, p in sorted(game_files.items()))
        self._catalogue = _catalogue(frozen, str(game_dir) if game_dir else None, str(cache_dir) if cache_dir else None)
        self._engine = None
        self._release = None
        self._state = None
        self._goal = None
        self._error: str | None = None

    # --- the conversation -------------------------------------------------
    def instruction(self) -> str:
        return INSTRUCTION

    # --- tasks ----------------------------------------------------------------
    def tasks(self, split: str, difficulty: str | None = None) -> list[Task]:
        self.check_split(split, difficulty)
        tasks = [Task(self.name, task_id, split, "") for task_id in self._catalogue.ids(split)]
        tasks = [Task(self.name, t.id, split, self._difficulty(t)) for t in tasks]
        return [t for t in tasks if difficulty is None or t.difficulty == difficulty]

    def task_type(self, task: Task) -> str:
        """One of alfworld's six task types (``pick_and_place_simple``, ...), for per-type reports."""
        return self._catalogue.task_type(task)

    def _difficulty(self, task: Task) -> str:
        return "easy" if self.task_type(task) in games.EASY_TYPES else "hard"

    # --- episodes -------------------------------------------------------------
    def on_reset(self, task: Task) -> str:
        self.close()
        self._error = None
        entry = self._catalogue.entry(task)
        _require_engine()  # the engine is imported here, never to build the env or list its tasks
        self._borrow_engine()
        try:
            self._engine.load(entry.path)
            self._state = self._engine.reset()
            self._goal = parse_goal(self._engine.game["pddl_problem"])
        except (Exception, SystemExit) as error:  # fast-downward exits on a bad problem
            return self._fail_at_reset(task, error)
        return first_observation(self._state.feedback, self._state["admissible_commands"])

    def on_step(self, text: str) -> Step:
        if self._error is not None:
            return self._failed(self._error)
        command = self._admissible(last_action(text))
        if command is None:
            return Step(observation=NOTHING_HAPPENED, valid=False)
        try:
            self._state, _, _ = self._engine.step(command)
        except (Exception, SystemExit) as error:  # an engine failure fails this episode, not the run
            logger.warning("alfworld engine failed on %r: %s", command, error)
            self._discard_engine()
            return self._failed(f"{type(error).__name__}: {error}")
        won = bool(self._state["won"])
        if won:
            self.close()
        return Step(observation=feedback(self._state.feedback), reward=1.0 if won else 0.0, done=won, success=won)

    def _admissible(self, action: str | None) -> str | None:
        """The engine command ``action`` names, in whichever put/move grammar the game's own grammar uses."""
        if not action:
            return None
        command = to_engine(action)
        admissible = self._state["admissible_commands"]
        # Games written for alfworld 0.3.3 carry its grammar (put X in/on Y); 0.4's say move X to Y.
        return next((form for form in (command, to_agentgym(command)) if form in admissible), None)

    def expert(self) -> str:
        self._require_game("expert()")
        move = next_move(World.from_facts(self._state["facts"]), self._goal)
        rng = random.Random(f"{self.task.split}:{self.task.id}:{self.turns}")
        return f"Thought: {_thought(move, rng)}\nAction: {to_agentgym(move.command)}"

    def random_action(self, rng: random.Random) -> str:
        self._require_game("random_action()")
        command = rng.choice(self._state["admissible_commands"])
        return f"Thought: I will try something.\nAction: {to_agentgym(command)}"

    def _require_game(self, what: str) -> None:
        self.require_episode(what)
        if self._error is not None:
            raise RuntimeError(f"alfworld: {what} needs a running game; this one failed to start ({self._error})")

    def close(self) -> None:
        """Give the engine back to the pool (an episode that ended holds none)."""
        if self._release is not None:
            self._release()  # a weakref.finalize: runs once, then is dead
        self._engine = self._release = None

    # --- engine lending -------------------------------------------------------
    def _borrow_engine(self) -> None:
        from contrail.envs.alfworld.engine import ENGINES

        self._engine = ENGINES.acquire()
        # Returned when the episode ends, on close(), or when this object is collected.
        self._release = weakref.finalize(self, ENGINES.release, self._engine)

    def _discard_engine(self) -> None:
        """Drop an engine that failed: its library state is unknown, so it is not lent again."""
        if self._release is not None:
            self._release.detach()
        self._engine = self._release = None

    def _fail_at_reset(self, task: Task, error: BaseException) -> str:
        logger.warning("alfworld engine failed to start task %s: %s", task, error)
        self._discard_engine()
        self._error = f"{type(error).__name__}: {error}"
        return f"The game could not be started ({self._error})."

    def _failed(self, error: str) -> Step:
        return Step(observation=NOTHING_HAPPENED, done=True, info={"error": error})
