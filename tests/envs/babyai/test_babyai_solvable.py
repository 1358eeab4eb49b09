"""Which BabyAI test tasks the expert solves: the shipped table, the disk cache, no engine to list tasks."""

from __future__ import annotations

import pytest

from contrail.envs import make
from contrail.envs.babyai import levels, solvable
from contrail.envs.babyai.levels import LEVELS, level_number


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONTRAIL_CACHE", str(tmp_path))
    monkeypatch.setattr(solvable, "_SOLVED", {})  # forget what other tests computed


def no_engine(*args, **kwargs):
    raise AssertionError("listing tasks started minigrid")


def test_listing_the_default_tasks_starts_no_engine(monkeypatch):
    monkeypatch.setattr(levels, "make_level", no_engine)
    monkeypatch.setattr(solvable, "expert_solves", no_engine)
    env = make("babyai")
    test = env.tasks("test")
    assert len(test) == 400 - len(solvable.TABLE.unsolved) == 346
    assert len(env.tasks("train")) == 40 * 250
    assert {task.difficulty for task in env.tasks("test", "hard")} == {"hard"}
    # KeyInBox has no solvable task at all: AgentGym's menu cannot open a box.
    assert not [task for task in test if LEVELS[level_number(task.id) - 1] == "KeyInBox"]


# Solved and unsolved ids of seed 0 from both difficulties (all 40 take the table's test too long).
SAMPLE = (0, 4, 7, 11, 21, 22, 23, 31, 39, 6, 15, 25, 27)


def _sample(table, size=12):
    """Up to ``size`` ids spread over what the table covers (its last ids too), half of them unsolved."""
    covered = [i for i in range(table.first, table.first + table.covers) if table.answers(i, table.max_turns)]
    unsolved = _spread([i for i in covered if i in table.unsolved], size // 2)
    solved = _spread([i for i in covered if i not in table.unsolved], size - len(unsolved))
    return unsolved + solved


def _spread(ids, count):
    """``count`` of ``ids``, evenly spaced from the first to the last."""
    if len(ids) <= count:
        return ids
    return [ids[round(k * (len(ids) - 1) / (count - 1))] for k in range(count)]


def test_the_table_is_what_the_expert_does():
    table = solvable.TABLE
    assert (table.cache_version, table.max_turns) == (solvable.SOLVABLE_CACHE_VERSION, 20)
    played = {task_id: solvable.expert_solves(task_id, 20) for task_id in SAMPLE}
    assert played == {task_id: task_id not in table.unsolved for task_id in SAMPLE}
    assert not all(played.values()) and any(played.values())


@pytest.mark.parametrize("index", range(1, len(solvable.TABLES)))
def test_every_other_shipped_table_is_what_the_expert_does(index):
    table = solvable.TABLES[index]
    assert table.cache_version == solvable.SOLVABLE_CACHE_VERSION
    sample = _sample(table)
    played = {task_id: solvable.expert_solves(task_id, table.max_turns) for task_id in sample}
    assert played == {task_id: task_id not in table.unsolved for task_id in sample}
    assert not all(played.values()) and any(played.values())


def test_listing_the_quickstarts_babyai_tasks_starts_no_engine(monkeypatch):
    """The quickstart's settings (3 turns, 20 test seeds, training filtered, 40 train seeds) come from the tables."""
    monkeypatch.setattr(levels, "make_level", no_engine)
    monkeypatch.setattr(solvable, "expert_solves", no_engine)
    env = make("babyai", max_turns=3, test_seeds=20, filter_train=True, train_seeds=40)
    train, test = env.tasks("train", "easy"), env.tasks("test", "easy")
    assert len(test) == 294 and 0 < len(train) < 880  # of 22 easy levels x 20 test / 40 train seeds


def test_other_settings_play_the_expert_once_and_cache_the_answers(tmp_path, monkeypatch):
    first = make("babyai", max_turns=4, test_seeds=1).tasks("test", "easy")
    assert 0 < len(first) < 22  # four turns solve some single-room tasks only
    files = list(tmp_path.glob(f"babyai-solvable-v{solvable.SOLVABLE_CACHE_VERSION}-minigrid*.json"))
    assert len(files) == 1
    monkeypatch.setattr(solvable, "_SOLVED", {})
    monkeypatch.setattr(solvable, "expert_solves", no_engine)
    assert make("babyai", max_turns=4, test_seeds=1).tasks("test", "easy") == first  # read back from disk
