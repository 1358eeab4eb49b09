"""Continual-learning metrics: plain functions of the results matrix.

``R`` has shape ``(S+1, N)``: row 0 is the untouched model, row ``s`` is the
model after stage ``s`` (1-based), column ``j`` is test experience ``j``.
``trained_at[j]`` is the 1-based stage ``s_j`` in which experience ``j`` is
*first* trained, or ``None`` for a held-out experience. ``L`` is the set of
trained experiences, ``H`` the held-out ones, ``S`` the last stage.

=====================  ==============================================  ===========================
metric                 formula                                         over
=====================  ==============================================  ===========================
final_performance      R[S, j]                                         j ∈ L
backward_transfer      R[S, j] - R[s_j, j]                             j ∈ L, s_j < S
forgetting             max(R[s_j .. S-1, j]) - R[S, j]                 j ∈ L, s_j < S
forward_transfer       R[s_j - 1, j] - R[0, j]                         j ∈ L, s_j ≥ 2
heldout_gain           R[S, h] - R[0, h]                               h ∈ H
delta_held_in          R[S, j] - R[0, j]                               j ∈ L
delta_held_out         R[S, h] - R[0, h]  (= heldout_gain)             h ∈ H
delta_overall          R[S, j] - R[0, j]                               every test experience j
=====================  ==============================================  ===========================

The three Δ measures are the paper's ΔHeld-In, ΔHeld-Out and ΔOverall: the
change from the start model averaged over the trained experiences, the
held-out ones and all of them. `deltas_by_row` gives them after every stage
``s``: held-in there averages over the experiences trained by then
(``s_j ≤ s``), so an experience not trained yet counts as neither held in nor
held out until its stage (its change is forward transfer).

Each is the mean over its set, and ``nan`` when the set is empty (a
single-stage mixture has ``S = 1``, so nothing is trained before the last
stage and BWT, forgetting and FWT are undefined, not zero).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np

__all__ = [
    "DELTAS",
    "backward_transfer",
    "delta_held_in",
    "delta_held_out",
    "delta_overall",
    "deltas_by_row",
    "final_performance",
    "forgetting",
    "forward_transfer",
    "heldout_gain",
    "per_experience",
    "summarize",
]

TrainedAt = Sequence["int | None"]


def final_performance(R: np.ndarray, trained_at: TrainedAt) -> float:
    """Average accuracy after the last stage over the trained experiences.

    ``ACC = 1/|L| Σ_{j∈L} R[S, j]`` (Lopez-Paz & Ranzato 2017, "Gradient
    Episodic Memory for Continual Learning", NeurIPS, the
    "ACC" metric).
    """
    R, stages = _validate(R, trained_at)
    last = R.shape[0] - 1
    return _mean([R[last, j] for j, s in enumerate(stages) if s is not None])


def backward_transfer(R: np.ndarray, trained_at: TrainedAt) -> float:
    """How training later stages changed the experiences learned earlier.

    ``BWT = mean_{j∈L, s_j<S} (R[S, j] - R[s_j, j])`` (Lopez-Paz & Ranzato
    2017, "BWT", with ``s_j`` in place of GEM's ``i = j`` since an
    experience here may be first trained at any stage). Negative is forgetting.
    """
    R, stages = _validate(R, trained_at)
    last = R.shape[0] - 1
    return _mean([R[last, j] - R[s, j] for j, s in enumerate(stages) if s is not None and s < last])


def forgetting(R: np.ndarray, trained_at: TrainedAt) -> float:
    """How far each experience fell from its best score after it was trained.

    ``F = mean_{j∈L, s_j<S} (max_{l ∈ s_j..S-1} R[l, j] - R[S, j])``
    (Chaudhry et al. 2018, "Riemannian Walk for Incremental Learning", ECCV,
    the "forgetting measure", with the maximum over the stages since ``j`` was first trained).
    Positive is forgetting; unlike BWT it also counts a peak reached after
    ``s_j`` (e.g. a replayed experience) and then lost.
    """
    R, stages = _validate(R, trained_at)
    last = R.shape[0] - 1
    return _mean([R[s:last, j].max() - R[last, j] for j, s in enumerate(stages) if s is not None and s < last])


def forward_transfer(R: np.ndarray, trained_at: TrainedAt) -> float:
    """How earlier stages helped an experience before it was trained.

    ``FWT = mean_{j∈L, s_j≥2} (R[s_j - 1, j] - R[0, j])`` (Lopez-Paz & Ranzato
    2017, "FWT", with the untouched model's row 0 as the reference ``b̄_j``
    in place of GEM's randomly initialised model).
    """
    R, stages = _validate(R, trained_at)
    return _mean([R[s - 1, j] - R[0, j] for j, s in enumerate(stages) if s is not None and s >= 2])


def heldout_gain(R: np.ndarray, trained_at: TrainedAt) -> float:
    """Change on experiences never trained: ``mean_{h∈H} (R[S, h] - R[0, h])``.

    Generalisation to unseen experiences (the held-out environments of
    AgentGym-style evaluations); positive means training transferred.
    """
    R, stages = _validate(R, trained_at)
    last = R.shape[0] - 1
    return _mean([R[last, h] - R[0, h] for h, s in enumerate(stages) if s is None])


def delta_held_in(R: np.ndarray, trained_at: TrainedAt) -> float:
    """ΔHeld-In: ``mean_{j∈L} (R[S, j] - R[0, j])``, the change on the trained experiences."""
    R, stages = _validate(R, trained_at)
    last = R.shape[0] - 1
    return _mean([R[last, j] - R[0, j] for j, s in enumerate(stages) if s is not None])


def delta_held_out(R: np.ndarray, trained_at: TrainedAt) -> float:
    """ΔHeld-Out: ``mean_{h∈H} (R[S, h] - R[0, h])``; the same number as `heldout_gain`."""
    return heldout_gain(R, trained_at)


def delta_overall(R: np.ndarray, trained_at: TrainedAt) -> float:
    """ΔOverall: ``mean_j (R[S, j] - R[0, j])`` over every test experience, trained or not."""
    R, _ = _validate(R, trained_at)
    return _mean(list(R[-1] - R[0]))


DELTAS = ("delta_held_in", "delta_held_out", "delta_overall")


def deltas_by_row(R: np.ndarray, trained_at: TrainedAt) -> dict[str, np.ndarray]:
    """ΔHeld-In, ΔHeld-Out and ΔOverall after every stage: arrays of length ``S + 1``.

    Row ``s``: held-in averages ``R[s, j] - R[0, j]`` over ``s_j ≤ s`` (trained
    by then), held-out over ``H``, overall over every column. Row 0 is ``nan``
    for held-in (nothing is trained yet) and 0 for the others. The last entry
    equals `delta_held_in` / `delta_held_out` / `delta_overall`.
    """
    R, stages = _validate(R, trained_at)
    out = {name: np.full(R.shape[0], math.nan) for name in DELTAS}
    for row in range(R.shape[0]):
        change = R[row] - R[0]
        out["delta_held_in"][row] = _mean([change[j] for j, s in enumerate(stages) if s is not None and s <= row])
        out["delta_held_out"][row] = _mean([change[j] for j, s in enumerate(stages) if s is None])
        out["delta_overall"][row] = _mean(list(change))
    return out


def summarize(R: np.ndarray, trained_at: TrainedAt) -> dict[str, float]:
    """Every metric by name (``nan`` where a metric's set is empty): the five
    continual-learning metrics, then ΔHeld-In, ΔHeld-Out, ΔOverall."""
    return {
        "final_performance": final_performance(R, trained_at),
        "backward_transfer": backward_transfer(R, trained_at),
        "forgetting": forgetting(R, trained_at),
        "forward_transfer": forward_transfer(R, trained_at),
        "heldout_gain": heldout_gain(R, trained_at),
        "delta_held_in": delta_held_in(R, trained_at),
        "delta_held_out": delta_held_out(R, trained_at),
        "delta_overall": delta_overall(R, trained_at),
    }


def per_experience(R: np.ndarray, trained_at: TrainedAt) -> list[dict[str, float | int | None]]:
    """Each experience's own terms of the metrics above, ``nan`` where undefined.

    One dict per column: ``trained_at``, ``initial`` (R[0, j]), ``final``
    (R[S, j]), ``backward_transfer``, ``forgetting``, ``forward_transfer``,
    ``heldout_gain``. Averaging a term over the experiences where it is
    defined gives the matching aggregate metric.
    """
    R, stages = _validate(R, trained_at)
    last = R.shape[0] - 1
    nan = float("nan")
    rows = []
    for j, s in enumerate(stages):
        rows.append(
            {
                "trained_at": s,
                "initial": float(R[0, j]),
                "final": float(R[last, j]),
                "backward_transfer": float(R[last, j] - R[s, j]) if s is not None and s < last else nan,
                "forgetting": float(R[s:last, j].max() - R[last, j]) if s is not None and s < last else nan,
                "forward_transfer": float(R[s - 1, j] - R[0, j]) if s is not None and s >= 2 else nan,
                "heldout_gain": float(R[last, j] - R[0, j]) if s is None else nan,
            }
        )
    return rows


def _mean(values: list) -> float:
    # An empty set means "undefined", not 0: report nan without numpy's warning.
    return float(np.mean(values)) if values else math.nan


def _validate(R, trained_at) -> tuple[np.ndarray, list[int | None]]:
    R = np.asarray(R, dtype=float)
    if R.ndim != 2:
        raise ValueError(f"R must be 2-D (stages + 1, experiences), got shape {R.shape}")
    if R.shape[0] < 2:
        raise ValueError(f"R needs row 0 (untouched model) and at least one stage row, got {R.shape[0]} row(s)")
    stages = list(trained_at)
    n_stages, n_exp = R.shape[0] - 1, R.shape[1]
    if len(stages) != n_exp:
        raise ValueError(f"trained_at has {len(stages)} entries but R has {n_exp} experience columns")
    for j, s in enumerate(stages):
        if s is None:
            continue
        if isinstance(s, bool) or not isinstance(s, numbers.Integral):
            raise ValueError(f"trained_at[{j}] must be an integer stage or None, got {s!r}")
        if not 1 <= s <= n_stages:
            raise ValueError(f"trained_at[{j}] = {s} is outside the stages 1..{n_stages} of R")
    return R, [None if s is None else int(s) for s in stages]
