"""Which BabyAI tasks the expert solves within the turn limit (the test split keeps those).

Some tasks cannot be finished in the turn limit even by the expert (long
multi-room missions), minigrid's strict verifier makes the two-door missions
of ``OpenDoorsOrderN4Debug`` unwinnable, and AgentGym's menu has no action
that opens a box, so ``KeyInBox`` cannot be solved at all. The default test split
(seeds 0-9, 20 turns) is answered from a table computed once (`TABLE`), so
listing its tasks plays no episode; other settings play the expert once
(~0.1 s a task) and store the answers under ``$CONTRAIL_CACHE`` (default
``~/.cache/contrail``), keyed by `SOLVABLE_CACHE_VERSION` and minigrid's
version. ``python -m contrail.envs.babyai.solvable`` prints the table anew.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import minigrid

from contrail.envs.babyai.levels import task_difficulty
from contrail.envs.base import Task
from contrail.paths import cache_root

# Bump when the interface or the expert changes what can be solved.
# 2: AgentGym's exact menu and macro paths (no box toggle; paths through the window).
SOLVABLE_CACHE_VERSION = 2

_SOLVED: dict[tuple[int, int], bool] = {}


@dataclass(frozen=True)
class Table:
    """`expert_solves` of ids ``0 .. covers - 1`` at ``max_turns``, for one cache version and minigrid."""

    cache_version: int
    minigrid: str
    max_turns: int
    covers: int
    unsolved: frozenset[int]

    def answers(self, task_id: int, max_turns: int) -> bool:
        """Whether this table holds the answer for ``task_id`` at ``max_turns`` on the installed minigrid."""
        key = (SOLVABLE_CACHE_VERSION, minigrid.__version__, max_turns)
        return (self.cache_version, self.minigrid, self.max_turns) == key and 0 <= task_id < self.covers


# The default test split, answered without playing: ``python -m contrail.envs.babyai.solvable``
# prints it anew (after a bump of SOLVABLE_CACHE_VERSION, or for another minigrid).
TABLE = Table(
    cache_version=2,
    minigrid="3.2.0",
    max_turns=20,
    covers=400,
    unsolved=frozenset(
        (
            6, 15, 25, 27, 36, 38, 39, 46, 55, 65, 71, 77, 95, 105, 107, 111, 117, 145,
            146, 147, 151, 154, 156, 158, 175, 184, 185, 188, 191, 196, 197, 198, 199, 206, 215, 225,
            231, 233, 246, 265, 295, 305, 308, 311, 316, 318, 335, 345, 351, 375, 385, 386, 388, 391,
        )
    ),
)


def expert_solves(task_id: int, max_turns: int) -> bool:
    """Whether the expert solves task ``task_id`` within ``max_turns``, through the model's path (`step`)."""
    # Imported here: the environment imports this module to list its tasks.
    from contrail.envs.babyai.env import BabyAIEnv

    env = BabyAIEnv(max_turns=max_turns)
    env.reset(Task("babyai", task_id, "test", task_difficulty(task_id)))
    try:
        while True:
            result = env.step(env.expert())
            if result.done:
                return result.success
    finally:
        env.close()


def solvable(task_ids: list[int], max_turns: int) -> dict[int, bool]:
    """``{id: expert_solves(id, max_turns)}``, from `TABLE` or cached in memory and on disk."""
    for task_id in task_ids:
        if TABLE.answers(task_id, max_turns):
            _SOLVED.setdefault((task_id, max_turns), task_id not in TABLE.unsolved)
    missing = [i for i in task_ids if (i, max_turns) not in _SOLVED]
    if missing:
        _load_cache()
        missing = [i for i in missing if (i, max_turns) not in _SOLVED]
    for task_id in missing:
        _SOLVED[(task_id, max_turns)] = expert_solves(task_id, max_turns)
    if missing:
        _save_cache()
    return {i: _SOLVED[(i, max_turns)] for i in task_ids}


def _cache_path() -> Path:
    return cache_root() / f"babyai-solvable-v{SOLVABLE_CACHE_VERSION}-minigrid{minigrid.__version__}.json"


def _load_cache() -> None:
    try:
        stored = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return
    if not isinstance(stored, dict):
        return
    for key, value in stored.items():
        task_id, _, turns = str(key).partition("@")
        if task_id.isdigit() and turns.isdigit():
            _SOLVED.setdefault((int(task_id), int(turns)), bool(value))


def _save_cache() -> None:
    """Merge what is known into the cache file; a lost race only costs recomputation."""
    path = _cache_path()
    _load_cache()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({f"{i}@{turns}": solved for (i, turns), solved in sorted(_SOLVED.items())}))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home still works, just without the disk cache


def _print_table(max_turns: int = 20, covers: int = 400) -> None:
    """Play the expert on ids ``0 .. covers - 1`` and print `TABLE`'s new ``unsolved`` set."""
    unsolved = [task_id for task_id in range(covers) if not expert_solves(task_id, max_turns)]
    print(f"# cache_version={SOLVABLE_CACHE_VERSION}, minigrid={minigrid.__version__}, max_turns={max_turns}")
    print(f"covers={covers},")
    print(f"unsolved=frozenset({tuple(unsolved)}),")


if __name__ == "__main__":
    _print_table()
