"""The paired task bootstrap and the interval over seeds, against exact bootstrap distributions.

With two tasks, a resample of tasks is AA, AB, BA or BB (probabilities 1/4, 1/2,
1/4 counting AB and BA together), so each bootstrap distribution below is worked
out by hand; 4000 resamples estimate its standard deviation within about 0.01.
"""

import math

import numpy as np
import pytest

from contrail import metrics
from contrail.intervals import (
    Interval,
    PairedBootstrap,
    TaskTable,
    group_by_experience,
    seed_interval,
)


def rec(task_id, success, env="a", difficulty="easy", reward=None, turns=1, invalid=0, **extra):
    return {"task": {"env": env, "id": task_id, "split": "test", "difficulty": difficulty},
            "success": success, "reward": float(success) if reward is None else reward, "turns": turns,
            "generated_tokens": 10 * turns, "invalid_actions": invalid, **extra}


def cell_records(rates, env="a"):
    """k = 2 samples per task: rate 0 -> two failures, 0.5 -> one success, 1 -> two."""
    out = []
    for task_id, rate in enumerate(rates):
        successes = round(rate * 2)
        out += [rec(task_id, i < successes, env=env) for i in range(2)]
    return out


def boot(rows, test=("a",), **options):
    return PairedBootstrap.from_records(rows, list(test), resamples=4000, seed=options.pop("seed", 0), **options)


def test_cell_interval_resamples_tasks_with_their_samples():
    # row 0: task A never solved, task B always: avg@k 0.5, resamples give 0, 0.5, 1.
    b = boot([cell_records([0.0, 1.0])])
    cell = b.cell("avg_at_k", 0, 0)
    assert cell.estimate == 0.5
    assert cell.se == pytest.approx(math.sqrt(0.125), abs=0.01)
    assert (cell.low, cell.high) == (0.0, 1.0)
    assert b.cell("pass_at_k", 0, 0).se == pytest.approx(math.sqrt(0.125), abs=0.01)


def test_change_from_row_zero_is_paired():
    # Each task gains exactly 0.5: every paired resample sees +0.5, so the interval is a point.
    rows = [cell_records([0.0, 0.5]), cell_records([0.5, 1.0])]
    change = boot(rows).change("avg_at_k", 1, 0)
    assert change == Interval(0.5, 0.0, 0.5, 0.5)
    assert change.significant
    # An unpaired view of the same data would be wide: each row alone has se ~0.18.
    assert boot(rows).cell("avg_at_k", 1, 0).se == pytest.approx(math.sqrt(0.25 ** 2 / 2), abs=0.01)
    # Task A gains 0.5, task B nothing: changes 0.5, 0.25, 0 -> se sqrt(1/32), interval [0, 0.5], not significant.
    mixed = boot([cell_records([0.0, 1.0]), cell_records([0.5, 1.0])]).change("avg_at_k", 1, 0)
    assert mixed.estimate == 0.25 and (mixed.low, mixed.high) == (0.0, 0.5)
    assert mixed.se == pytest.approx(math.sqrt(1 / 32), abs=0.01)
    assert not mixed.significant


def test_rates_are_ratios_of_sums_like_the_evaluator():
    # Task A: 2 episodes x 2 invalid turns; task B: 2 episodes x 1 valid turn -> 4/6
    # (a mean of the task rates would be 0.5).
    records = [rec(0, False, turns=2, invalid=2), rec(0, False, turns=2, invalid=2),
               rec(1, True, turns=1, invalid=0), rec(1, True, turns=1, invalid=0)]
    b = boot([records])
    invalid = b.cell("invalid_rate", 0, 0)
    assert invalid.estimate == pytest.approx(4 / 6)
    assert (invalid.low, invalid.high) == (0.0, 1.0)  # BB: 0/2, AA: 8/8
    assert b.cell("turns", 0, 0).estimate == 1.5 and b.cell("generated_tokens", 0, 0).estimate == 15.0
    assert b.cell("reward", 0, 0).estimate == 0.5


def test_cut_rate_is_cut_turns_over_turns_and_undefined_where_a_row_did_not_record_them():
    # Task A: 2 episodes x 2 turns, 1 cut in each; task B: 2 episodes x 1 turn, none cut -> 2/6.
    marked = [rec(0, False, turns=2, cut_turns=1), rec(0, False, turns=2, cut_turns=1),
              rec(1, True, cut_turns=0), rec(1, True, cut_turns=0)]
    older = [rec(0, False, turns=2), rec(0, False, turns=2), rec(1, True), rec(1, True)]  # before cuts were kept
    b = boot([older, marked])
    assert b.cell("cut_rate", 1, 0).estimate == pytest.approx(2 / 6)
    assert math.isnan(b.cell("cut_rate", 0, 0).estimate)
    assert math.isnan(b.change("cut_rate", 1, 0).estimate)
    assert b.cell("invalid_rate", 0, 0).estimate == 0.0  # the other measures of the older row stand


def test_metric_interval_uses_one_resample_for_all_rows():
    # exp a: rows 0,1,2 task rates A (0, 1, 0.5), B (0, 1, 1): BWT per task -0.5 and 0.
    # exp b (trained at stage 2) only adds columns BWT does not read.
    rows = [cell_records([0.0, 0.0]) + cell_records([0.0, 0.5], env="b"),
            cell_records([1.0, 1.0]) + cell_records([0.0, 0.5], env="b"),
            cell_records([0.5, 1.0]) + cell_records([1.0, 1.0], env="b")]
    b = boot(rows, test=("a", "b"))
    bwt = b.metric(metrics.backward_transfer, [1, 2])
    assert bwt.estimate == -0.25 and (bwt.low, bwt.high) == (-0.5, 0.0)
    assert bwt.se == pytest.approx(math.sqrt(1 / 32), abs=0.01)
    both = b.statistics(lambda R: metrics.deltas_by_row(R, [1, 2]))
    # R: a 0, 1, 0.75; b 0.25, 0.25, 1
    assert [i.estimate for i in both["delta_overall"]] == pytest.approx([0.0, 0.5, 0.75])
    assert both["delta_held_in"][0].estimate != both["delta_held_in"][0].estimate  # nan at row 0
    # restricted to column a only (a partial run): held-in = a's change
    only_a = b.metric(metrics.delta_held_in, [1], columns=[0])
    assert only_a.estimate == 0.75


def test_deterministic_from_the_seed():
    rows = [cell_records([0.0, 0.5, 1.0, 1.0]), cell_records([0.5, 0.5, 1.0, 0.0])]
    one = boot(rows, seed=3).change("avg_at_k", 1, 0)
    assert boot(rows, seed=3).change("avg_at_k", 1, 0) == one
    assert boot(rows, seed=4).change("avg_at_k", 1, 0) != one


def test_grouping_and_missing_tasks():
    records = [rec(0, True, env="a", difficulty="easy"), rec(1, True, env="a", difficulty="hard"),
               rec(2, False, env="a", difficulty="hard", experience="a:hard"), rec(3, True, env="zzz")]
    grouped = group_by_experience(records, ["a:easy", "a:hard"])
    assert [r["task"]["id"] for r in grouped["a:easy"]] == [0]
    assert [r["task"]["id"] for r in grouped["a:hard"]] == [1, 2]
    # a task missing from a row counts in no denominator of that row
    table = TaskTable.from_records([[rec(0, True), rec(1, False)], [rec(0, True)]])
    assert table.values("avg_at_k", np.ones((1, 2)))[0].tolist() == [0.5, 1.0]
    empty = PairedBootstrap.from_records([[]], ["a"], resamples=10).cell("avg_at_k", 0, 0)
    assert math.isnan(empty.estimate) and not empty.significant


def test_seed_interval_is_a_t_interval():
    interval = seed_interval([1.0, 2.0, 3.0, float("nan")])
    se = 1 / math.sqrt(3)
    assert interval.estimate == 2.0 and interval.se == pytest.approx(se)
    assert interval.high - 2.0 == pytest.approx(4.302653 * se, rel=1e-5)  # t_{0.975, 2}
    assert math.isnan(seed_interval([0.5]).se) and seed_interval([0.5]).estimate == 0.5
    assert math.isnan(seed_interval([]).estimate)


def test_bad_options():
    with pytest.raises(ValueError, match="resamples"):
        PairedBootstrap([], resamples=1)
    with pytest.raises(ValueError, match="unknown measure"):
        PairedBootstrap([], resamples=2).matrices("bogus")
