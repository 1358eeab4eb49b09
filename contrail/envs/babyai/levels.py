"""BabyAI's levels and task ids, as AgentGym numbers them.

Task id ``i`` is level ``i % 40 + 1`` of `LEVELS` with seed ``i // 40``
(AgentGym's ``agentenv-babyai`` server). contrail's test split uses seeds
``0 .. test_seeds - 1``; its train split starts at `TRAIN_SEED_START`, so
the two never overlap. Easy = levels 1-22 (single-room GoTo, Open, Pickup,
PutNextLocal), hard = levels 23-40 (Unlock, KeyCorridor, Synth, Boss).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator

import gymnasium
import minigrid  # noqa: F401 - registers the BabyAI levels with gymnasium

# AgentGym's 40 levels, in its order (its ``all_levels``, 1-based there).
LEVELS: tuple[str, ...] = (
    "GoToRedBallGrey", "GoToRedBall", "GoToRedBallNoDists", "GoToObjS6", "GoToLocalS8N7",
    "GoToObjMazeS7", "GoToImpUnlock", "GoToSeqS5R2", "GoToRedBlueBall", "GoToDoor",
    "GoToObjDoor", "Open", "OpenRedDoor", "OpenDoorLoc", "OpenRedBlueDoorsDebug",
    "OpenDoorsOrderN4Debug", "Pickup", "UnblockPickup", "PickupLoc", "PickupDistDebug",
    "PickupAbove", "PutNextLocalS6N4", "PutNextS7N4Carrying", "Unlock", "UnlockLocalDist",
    "KeyInBox", "UnlockPickupDist", "BlockedUnlockPickup", "UnlockToUnlock", "ActionObjDoor",
    "FindObjS7", "KeyCorridorS6R3", "OneRoomS20", "MoveTwoAcrossS8N9", "SynthS5R2",
    "SynthLoc", "SynthSeq", "MiniBossLevel", "BossLevel", "BossLevelNoUnlock",
)  # fmt: skip
EASY_LEVELS = range(1, 23)  # 1-based level numbers
HARD_LEVELS = range(23, 41)
TRAIN_SEED_START = 10_000


def level_number(task_id: int) -> int:
    """AgentGym's 1-based level of a task id."""
    return task_id % len(LEVELS) + 1


def level_seed(task_id: int) -> int:
    """AgentGym's seed of a task id."""
    return task_id // len(LEVELS)


def level_difficulty(level: int) -> str:
    """``easy`` for levels 1-22, ``hard`` for 23-40."""
    return "easy" if level in EASY_LEVELS else "hard"


def task_difficulty(task_id: int) -> str:
    """The difficulty label of a task id."""
    return level_difficulty(level_number(task_id))


def level_env_id(level: int) -> str:
    """The gymnasium id of a 1-based level: the newest registered version.

    minigrid 3 retired some v0 ids (``GoToObjS6-v0`` is now ``-v1``).
    """
    prefix = f"BabyAI-{LEVELS[level - 1]}-v"
    versions = [
        int(key[len(prefix):]) for key in gymnasium.registry if key.startswith(prefix) and key[len(prefix):].isdigit()
    ]
    if not versions:
        raise RuntimeError(f"minigrid does not register a BabyAI level named {LEVELS[level - 1]!r}")
    return f"{prefix}{max(versions)}"


def make_level(level: int):
    """A fresh, unwrapped minigrid environment of a 1-based level."""
    return gymnasium.make(level_env_id(level)).unwrapped


def start_level(task_id: int):
    """The level of ``task_id`` reset to its seed, and minigrid's first observation image."""
    level = make_level(level_number(task_id))
    with quiet():
        obs, _ = level.reset(seed=level_seed(task_id))
    return level, obs["image"]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """minigrid prints 'Sampling rejected ...' while generating some levels."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def goal_text(mission: str) -> str:
    """The goal as AgentGym words it: every "then" and "after you" read "and".

    (AgentGym rewrites minigrid's sequenced missions this way, so "open the
    red door, then open the blue door" reads "open the red door, and open
    the blue door"; the order of "X after you Y" is kept as written.)
    """
    return mission.replace("then", "and").replace("after you", "and")
