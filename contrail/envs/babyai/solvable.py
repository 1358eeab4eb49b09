"""Which BabyAI tasks the expert solves within the turn limit (the test split keeps those).

Some tasks cannot be finished in the turn limit even by the expert (long
multi-room missions), minigrid's strict verifier makes the two-door missions
of ``OpenDoorsOrderN4Debug`` unwinnable, and AgentGym's menu has no action
that opens a box, so ``KeyInBox`` cannot be solved at all. A first run plays
the expert (~0.1 s a task); the answers are stored under ``$CONTRAIL_CACHE``
(default ``~/.cache/contrail``), keyed by `SOLVABLE_CACHE_VERSION` and
minigrid's version.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import minigrid

from contrail.envs.babyai.levels import task_difficulty
from contrail.envs.base import Task
from contrail.paths import cache_root

# Bump when the interface or the expert changes what can be solved.
# 2: AgentGym's exact menu and macro paths (no box toggle; paths through the window).
SOLVABLE_CACHE_VERSION = 2

_SOLVED: dict[tuple[int, int], bool] = {}


def expert_solves(task_id: int, max_turns: int) -> bool:
    """Whether the expert solves task ``task_id`` within ``max_turns``, through the model's path (`step`)."""
    from contrail.envs.babyai.env import (
        BabyAIEnv,  # the env lists its tasks with this module
    )

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
    """``{id: expert_solves(id, max_turns)}``, cached in memory and on disk."""
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
