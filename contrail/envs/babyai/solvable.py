"""Which BabyAI tasks the expert solves within the turn limit (the test split keeps those).

Some tasks cannot be finished in the turn limit even by the expert (long
multi-room missions), minigrid's strict verifier makes the two-door missions
of ``OpenDoorsOrderN4Debug`` unwinnable, and AgentGym's menu has no action
that opens a box, so ``KeyInBox`` cannot be solved at all. The default test split
(seeds 0-9, 20 turns) and the quickstart's settings (3 turns: the easy
tasks of the first 20 test seeds and of the first 40 train seeds) are answered from
tables computed once (`TABLES`), so listing their tasks plays no episode;
other settings play the expert once (~0.04 s a task) and store the answers
under ``$CONTRAIL_CACHE`` (default ``~/.cache/contrail``), keyed by
`SOLVABLE_CACHE_VERSION` and minigrid's version.
``python -m contrail.envs.babyai.solvable MAX_TURNS FIRST COVERS [DIFFICULTY]``
prints a table anew.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import minigrid

from contrail.envs.babyai.levels import LEVELS, TRAIN_SEED_START, task_difficulty
from contrail.envs.base import Task
from contrail.paths import cache_root

# Bump when the interface or the expert changes what can be solved.
# 2: AgentGym's exact menu and macro paths (no box toggle; paths through the window).
SOLVABLE_CACHE_VERSION = 2

_SOLVED: dict[tuple[int, int], bool] = {}


@dataclass(frozen=True)
class Table:
    """`expert_solves` at ``max_turns`` of the ids ``first .. first + covers - 1`` (of ``difficulty``, if set),
    for one cache version and minigrid."""

    cache_version: int
    minigrid: str
    max_turns: int
    covers: int
    unsolved: frozenset[int]
    first: int = 0
    difficulty: str | None = None

    def answers(self, task_id: int, max_turns: int) -> bool:
        """Whether this table holds the answer for ``task_id`` at ``max_turns`` on the installed minigrid."""
        key = (SOLVABLE_CACHE_VERSION, minigrid.__version__, max_turns)
        return (self.cache_version, self.minigrid, self.max_turns) == key and _covered(
            task_id, self.first, self.covers, self.difficulty)


def _covered(task_id: int, first: int, covers: int, difficulty: str | None) -> bool:
    """Whether a table over ids ``first .. first + covers - 1`` (of ``difficulty``, if set) holds ``task_id``."""
    return first <= task_id < first + covers and difficulty in (None, task_difficulty(task_id))


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


# The quickstart's BabyAI settings (``max_turns: 3``): the easy tasks of the first 20 test seeds
# (``test_seeds: 20``), and the easy tasks of the first 40 train seeds (``train_seeds: 40, filter_train: true``).
TABLE_3_TURNS_TEST = Table(
    cache_version=2,
    minigrid="3.2.0",
    max_turns=3,
    covers=800,
    difficulty="easy",
    unsolved=frozenset(
        (
            5, 6, 11, 14, 15, 16, 17, 20, 46, 47, 54, 55, 60, 61, 80, 82, 85, 86, 91, 93, 94, 95, 96, 97, 101,
            122, 125, 126, 131, 134, 137, 141, 166, 167, 174, 175, 176, 181, 205, 206, 211, 214, 215, 216, 221,
            246, 247, 254, 255, 256, 257, 261, 285, 287, 293, 294, 295, 298, 300, 301, 325, 326, 334, 335, 337,
            341, 365, 366, 367, 374, 375, 381, 411, 414, 415, 417, 420, 421, 446, 454, 455, 456, 461, 485, 486,
            487, 491, 494, 495, 496, 498, 501, 522, 526, 531, 534, 535, 541, 560, 561, 562, 566, 573, 574, 575,
            576, 579, 580, 581, 605, 611, 614, 615, 616, 621, 645, 646, 647, 651, 654, 655, 661, 680, 681, 682,
            686, 694, 695, 696, 697, 726, 730, 731, 734, 735, 736, 741, 765, 767, 771, 773, 774, 775, 776, 777,
            781,
        )
    ),
)
TABLE_3_TURNS_TRAIN = Table(
    cache_version=2,
    minigrid="3.2.0",
    max_turns=3,
    first=TRAIN_SEED_START * len(LEVELS),
    covers=40 * len(LEVELS),
    difficulty="easy",
    unsolved=frozenset(
        (
            400005, 400006, 400007, 400014, 400017, 400046, 400051, 400054, 400055, 400057, 400058, 400061,
            400085, 400094, 400095, 400096, 400097, 400101, 400126, 400127, 400134, 400135, 400141, 400166,
            400170, 400171, 400174, 400176, 400177, 400181, 400205, 400210, 400211, 400213, 400214, 400215,
            400216, 400218, 400221, 400246, 400251, 400254, 400255, 400256, 400257, 400261, 400286, 400287,
            400294, 400296, 400297, 400301, 400325, 400327, 400331, 400333, 400334, 400335, 400336, 400341,
            400365, 400366, 400374, 400375, 400376, 400377, 400381, 400405, 400406, 400407, 400411, 400414,
            400415, 400416, 400417, 400421, 400445, 400446, 400450, 400454, 400455, 400456, 400457, 400461,
            400485, 400486, 400491, 400494, 400500, 400501, 400525, 400526, 400531, 400533, 400534, 400535,
            400537, 400541, 400562, 400567, 400571, 400574, 400575, 400602, 400605, 400606, 400611, 400613,
            400614, 400615, 400649, 400650, 400651, 400654, 400655, 400656, 400657, 400661, 400685, 400686,
            400691, 400694, 400697, 400701, 400726, 400734, 400736, 400741, 400771, 400774, 400775, 400776,
            400777, 400781, 400805, 400807, 400811, 400814, 400815, 400816, 400817, 400840, 400841, 400842,
            400845, 400846, 400847, 400853, 400854, 400855, 400856, 400860, 400861, 400885, 400886, 400891,
            400894, 400895, 400896, 400897, 400901, 400926, 400931, 400934, 400935, 400936, 400937, 400941,
            400965, 400966, 400974, 400975, 400976, 400977, 400981, 401005, 401006, 401011, 401012, 401013,
            401014, 401015, 401016, 401017, 401021, 401045, 401047, 401051, 401054, 401055, 401056, 401057,
            401061, 401085, 401086, 401091, 401094, 401096, 401097, 401101, 401125, 401126, 401127, 401134,
            401135, 401139, 401141, 401165, 401166, 401167, 401171, 401174, 401175, 401181, 401204, 401205,
            401206, 401211, 401214, 401215, 401217, 401220, 401221, 401247, 401249, 401254, 401255, 401260,
            401261, 401285, 401286, 401287, 401291, 401294, 401297, 401301, 401325, 401326, 401331, 401334,
            401335, 401336, 401337, 401341, 401366, 401374, 401375, 401376, 401377, 401381, 401406, 401411,
            401414, 401415, 401417, 401421, 401445, 401446, 401451, 401454, 401455, 401461, 401482, 401485,
            401486, 401494, 401495, 401496, 401497, 401498, 401501, 401522, 401525, 401534, 401535, 401536,
            401537, 401541, 401562, 401566, 401567, 401571, 401574, 401575, 401576, 401577, 401581,
        )
    ),
)

# Every shipped table; `solvable` answers from the first that covers an id.
TABLES: tuple[Table, ...] = (TABLE, TABLE_3_TURNS_TEST, TABLE_3_TURNS_TRAIN)


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
    """``{id: expert_solves(id, max_turns)}``, from `TABLES` or cached in memory and on disk."""
    for task_id in task_ids:
        table = next((t for t in TABLES if t.answers(task_id, max_turns)), None)
        if table is not None:
            _SOLVED.setdefault((task_id, max_turns), task_id not in table.unsolved)
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


def _print_table(max_turns: int = 20, first: int = 0, covers: int = 400, difficulty: str | None = None) -> None:
    """Play the expert on the ids a `Table` of these settings covers and print its ``unsolved`` set."""
    ids = [i for i in range(first, first + covers) if _covered(i, first, covers, difficulty)]
    unsolved = [task_id for task_id in ids if not expert_solves(task_id, max_turns)]
    print(f"# cache_version={SOLVABLE_CACHE_VERSION}, minigrid={minigrid.__version__}, max_turns={max_turns}")
    print(f"covers={covers}, first={first}, difficulty={difficulty!r},")
    print(f"unsolved=frozenset({tuple(unsolved)}),")


if __name__ == "__main__":
    import sys

    turns, start, count = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (20, 0, 400)
    _print_table(turns, start, count, sys.argv[4] if len(sys.argv) > 4 else None)
