"""Continual-learning metrics on results matrices worked out by hand."""

import math

import numpy as np
import pytest

from contrail.metrics import (
    backward_transfer,
    delta_held_in,
    delta_held_out,
    delta_overall,
    deltas_by_row,
    final_performance,
    forgetting,
    forward_transfer,
    heldout_gain,
    per_experience,
    summarize,
)

NAN_OK = dict(nan_ok=True)

# Sequential: experience j trained in stage j+1.
SEQUENTIAL = np.array(
    [
        [0.1, 0.2, 0.3],  # untouched model
        [0.8, 0.3, 0.3],  # after stage 1 (exp 0)
        [0.6, 0.9, 0.5],  # after stage 2 (exp 1)
        [0.5, 0.7, 0.95],  # after stage 3 (exp 2)
    ]
)


def test_sequential_three_stages():
    trained_at = [1, 2, 3]
    assert final_performance(SEQUENTIAL, trained_at) == pytest.approx((0.5 + 0.7 + 0.95) / 3)
    # exp 0: 0.5 - 0.8 = -0.3; exp 1: 0.7 - 0.9 = -0.2; exp 2 is trained last: excluded
    assert backward_transfer(SEQUENTIAL, trained_at) == pytest.approx(-0.25)
    # exp 0: max(0.8, 0.6) - 0.5 = 0.3; exp 1: max(0.9) - 0.7 = 0.2
    assert forgetting(SEQUENTIAL, trained_at) == pytest.approx(0.25)
    # exp 1: R[1,1] - R[0,1] = 0.1; exp 2: R[2,2] - R[0,2] = 0.2; exp 0 has no earlier stage
    assert forward_transfer(SEQUENTIAL, trained_at) == pytest.approx(0.15)
    assert math.isnan(heldout_gain(SEQUENTIAL, trained_at))


def test_replay_revisits_an_experience():
    # exp 0 first trained in stage 1 and replayed in stage 3; exp 1 trained in stage 2.
    R = np.array(
        [
            [0.0, 0.1],
            [0.4, 0.2],
            [0.9, 0.7],
            [0.6, 0.8],
        ]
    )
    trained_at = [1, 2]  # the FIRST stage each experience is trained in
    assert final_performance(R, trained_at) == pytest.approx(0.7)
    # exp 0: 0.6 - 0.4 = +0.2; exp 1: 0.8 - 0.7 = +0.1
    assert backward_transfer(R, trained_at) == pytest.approx(0.15)
    # exp 0 peaked at 0.9 after stage 2 and lost it: 0.9 - 0.6 = 0.3; exp 1: 0.7 - 0.8 = -0.1
    # (BWT says exp 0 gained; forgetting sees the lost peak)
    assert forgetting(R, trained_at) == pytest.approx(0.1)
    assert forward_transfer(R, trained_at) == pytest.approx(0.1)  # exp 1: 0.2 - 0.1


def test_mixture_has_one_stage_so_transfer_is_undefined():
    R = np.array([[0.1, 0.2, 0.3], [0.5, 0.4, 0.9]])
    trained_at = [1, 1, 1]
    assert final_performance(R, trained_at) == pytest.approx(0.6)
    for metric in (backward_transfer, forgetting, forward_transfer, heldout_gain):
        assert math.isnan(metric(R, trained_at)), metric.__name__


def test_heldout_columns():
    R = np.array(
        [
            [0.1, 0.2, 0.3, 0.4],
            [0.7, 0.3, 0.35, 0.4],
            [0.6, 0.8, 0.5, 0.2],
        ]
    )
    trained_at = [1, 2, None, None]
    # held out: (0.5 - 0.3) and (0.2 - 0.4) → mean 0
    assert heldout_gain(R, trained_at) == pytest.approx(0.0)
    # held-out columns never enter the trained-experience metrics
    assert final_performance(R, trained_at) == pytest.approx(0.7)
    assert backward_transfer(R, trained_at) == pytest.approx(-0.1)
    assert forgetting(R, trained_at) == pytest.approx(0.1)
    assert forward_transfer(R, trained_at) == pytest.approx(0.1)
    assert heldout_gain(R, [1, 2, None, 2]) == pytest.approx(0.2)


def test_everything_held_out_leaves_only_heldout_gain():
    R = np.array([[0.2, 0.4], [0.5, 0.3]])
    result = summarize(R, [None, None])
    assert result["heldout_gain"] == pytest.approx(0.1)
    undefined = ("final_performance", "backward_transfer", "forgetting", "forward_transfer")
    assert all(math.isnan(result[k]) for k in undefined)


def test_summarize_and_per_experience():
    result = summarize(SEQUENTIAL, [1, 2, 3])
    assert list(result) == ["final_performance", "backward_transfer", "forgetting", "forward_transfer", "heldout_gain",
                            "delta_held_in", "delta_held_out", "delta_overall"]
    assert all(isinstance(v, float) for v in result.values())
    assert result["backward_transfer"] == pytest.approx(-0.25)

    rows = per_experience(SEQUENTIAL, [1, 2, None])
    assert rows[0] == pytest.approx(
        {"trained_at": 1, "initial": 0.1, "final": 0.5, "backward_transfer": -0.3, "forgetting": 0.3,
         "forward_transfer": math.nan, "heldout_gain": math.nan},
        **NAN_OK,
    )
    assert rows[1]["forward_transfer"] == pytest.approx(0.1)
    assert rows[2] == pytest.approx(
        {"trained_at": None, "initial": 0.3, "final": 0.95, "backward_transfer": math.nan, "forgetting": math.nan,
         "forward_transfer": math.nan, "heldout_gain": 0.65},
        **NAN_OK,
    )


def test_accepts_lists_and_numpy_integers():
    trained_at = np.array([1, 2, 3])
    assert backward_transfer(SEQUENTIAL.tolist(), trained_at) == pytest.approx(-0.25)


def test_paper_deltas_on_a_hand_made_matrix():
    R = np.array(
        [
            [0.1, 0.2, 0.3, 0.4],   # start model
            [0.7, 0.3, 0.35, 0.4],  # after stage 1 (a)
            [0.6, 0.8, 0.5, 0.2],   # after stage 2 (b)
        ]
    )
    trained_at = [1, 2, None, None]
    # held in: a 0.6-0.1, b 0.8-0.2 -> 0.55; held out: c 0.2, d -0.2 -> 0; overall: (0.5+0.6+0.2-0.2)/4
    assert delta_held_in(R, trained_at) == pytest.approx(0.55)
    assert delta_held_out(R, trained_at) == pytest.approx(0.0)
    assert delta_overall(R, trained_at) == pytest.approx(0.275)
    rows = deltas_by_row(R, trained_at)
    # row 1: only a is trained yet (0.6); held out (0.05 + 0) / 2; overall (0.6 + 0.1 + 0.05 + 0) / 4
    assert rows["delta_held_in"] == pytest.approx([math.nan, 0.6, 0.55], nan_ok=True)
    assert rows["delta_held_out"] == pytest.approx([0.0, 0.025, 0.0])
    assert rows["delta_overall"] == pytest.approx([0.0, 0.1875, 0.275])
    assert math.isnan(delta_held_out(R, [1, 2, 1, 2]))
    assert math.isnan(delta_held_in(R, [None] * 4))


@pytest.mark.parametrize(
    "R, trained_at, message",
    [
        (np.zeros(3), [1, 1, 1], "2-D"),
        (np.zeros((1, 3)), [1, 1, 1], "at least one stage row"),
        (np.zeros((3, 3)), [1, 2], "2 entries but R has 3"),
        (np.zeros((3, 2)), [0, 1], "outside the stages 1..2"),
        (np.zeros((3, 2)), [1, 3], "outside the stages 1..2"),
        (np.zeros((3, 2)), [1, 1.5], "must be an integer"),
        (np.zeros((3, 2)), [1, 1.0], "must be an integer"),
        (np.zeros((3, 2)), [1, True], "must be an integer"),
        (np.zeros((3, 2)), [1, "2"], "must be an integer"),
    ],
)
@pytest.mark.parametrize(
    "metric", [final_performance, backward_transfer, forgetting, forward_transfer, heldout_gain, summarize,
               delta_held_in, delta_held_out, delta_overall, deltas_by_row]
)
def test_bad_shapes_and_stages_raise(metric, R, trained_at, message):
    with pytest.raises(ValueError, match=message):
        metric(R, trained_at)
