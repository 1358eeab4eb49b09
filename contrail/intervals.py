"""Uncertainty of every number in a report: a bootstrap over test tasks, paired across rows.

A cell of the results matrix (row ``s``, test experience ``j``) summarises a
few dozen episodes: ``T`` tasks played ``k`` times each. Its sampling noise
comes from which tasks were drawn, so the bootstrap resamples **tasks** with
replacement and keeps a task's ``k`` samples together (`cell_value` of a
resample re-aggregates exactly as `contrail.evaluation.summarize` does).

Every row is evaluated on the same test tasks, so differences between rows
(BWT, forgetting, the Δ measures, a cell's change from row 0) are paired:
`PairedBootstrap` draws ONE resample of task indices per experience and
applies it to every row at once, so a task that is hard for row 0 is hard for
row ``s`` in the same resample and the noise that rows share cancels.

Intervals are percentile intervals (95% by default) of the bootstrap
distribution, the standard error is its standard deviation, and the estimate is
the value on the data as observed. Everything is deterministic from ``seed``.

>>> boot = PairedBootstrap.from_records(records_per_row, ["babyai:easy", "textcraft:easy"], seed=0)
>>> boot.cell("avg_at_k", 2, 0)                      # Interval(estimate, se, low, high)
>>> boot.metric(metrics.backward_transfer, trained_at)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from contrail.results import read_jsonl

__all__ = [
    "CELL_MEASURES",
    "DEFAULT_RESAMPLES",
    "DEFAULT_SEED",
    "Interval",
    "PairedBootstrap",
    "TaskTable",
    "experience_of",
    "group_by_experience",
    "read_trajectories",
    "seed_interval",
]

DEFAULT_SEED = 0
DEFAULT_RESAMPLES = 2000
# The per-cell measures that get an interval (EvalResult fields).
CELL_MEASURES = ("avg_at_k", "pass_at_k", "reward", "turns", "generated_tokens", "invalid_rate", "cut_rate")

# Per-task sums kept for each cell; every measure is a ratio of weighted sums of these.
_SUMS = ("episodes", "success_rate", "solved", "reward", "turns", "generated_tokens", "invalid_actions",
         "cut_turns")
# measure -> (numerator, denominator): over tasks (avg@k, pass@k) or over episodes/turns.
_RATIOS = {
    "avg_at_k": ("success_rate", "present"),
    "pass_at_k": ("solved", "present"),
    "reward": ("reward", "episodes"),
    "turns": ("turns", "episodes"),
    "generated_tokens": ("generated_tokens", "episodes"),
    "invalid_rate": ("invalid_actions", "turns"),
    "cut_rate": ("cut_turns", "turns"),
}


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap standard error and interval ``[low, high]``."""

    estimate: float
    se: float
    low: float
    high: float

    @property
    def significant(self) -> bool:
        """Whether the interval excludes 0 (for a difference: a change the noise does not explain)."""
        return bool(self.low > 0 or self.high < 0)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def undefined(cls) -> Interval:
        return cls(math.nan, math.nan, math.nan, math.nan)


# --- trajectories of a run ------------------------------------------------------------------


def read_trajectories(path: str | Path) -> list[dict[str, Any]]:
    """The records of one ``trajectories/stage-XX.jsonl`` file (``Trajectory.to_record()`` lines), in order."""
    return read_jsonl(path, "trajectory")


def experience_of(record: dict[str, Any], test: Sequence[str]) -> str | None:
    """The test experience a trajectory record belongs to (None when none matches).

    A record's own ``"experience"`` key wins; otherwise the first test name
    whose ``env[:difficulty]`` matches the record's task (``babyai`` matches
    every BabyAI task, ``babyai:easy`` only the easy ones).
    """
    if record.get("experience") in test:
        return record["experience"]
    task = record.get("task") or {}
    for name in test:
        env, _, difficulty = name.partition(":")
        if task.get("env") == env and (not difficulty or task.get("difficulty") == difficulty):
            return name
    return None


def group_by_experience(records: Iterable[dict[str, Any]], test: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """Records keyed by test experience (every test name present, maybe with an empty list)."""
    grouped: dict[str, list[dict[str, Any]]] = {name: [] for name in test}
    for record in records:
        name = experience_of(record, test)
        if name is not None:
            grouped[name].append(record)
    return grouped


def task_key(record: dict[str, Any]) -> tuple[str, int, str]:
    """(env, id, split): what makes two records the same task."""
    task = record.get("task") or {}
    return (str(task.get("env")), int(task.get("id", -1)), str(task.get("split")))


# --- per-task sums --------------------------------------------------------------------------


@dataclass
class TaskTable:
    """Per-task sums of one experience at every row: ``sums[name]`` has shape ``(rows, tasks)``.

    ``tasks`` is the union of the task keys seen at any row (sorted), so the
    same column is the same task in every row; ``present`` marks where a row
    has episodes of a task (normally everywhere).
    """

    tasks: list[tuple[str, int, str]]
    sums: dict[str, np.ndarray]

    @classmethod
    def from_records(cls, per_row: Sequence[Sequence[dict[str, Any]]]) -> TaskTable:
        """``per_row[s]`` = the trajectory records of this experience at row ``s``."""
        tasks = sorted({task_key(r) for records in per_row for r in records})
        column = {key: i for i, key in enumerate(tasks)}
        sums = {name: np.zeros((len(per_row), len(tasks))) for name in _SUMS}
        successes = np.zeros((len(per_row), len(tasks)))
        for row, records in enumerate(per_row):
            for r in records:
                i = column[task_key(r)]
                sums["episodes"][row, i] += 1
                successes[row, i] += bool(r.get("success"))
                sums["reward"][row, i] += float(r.get("reward") or 0.0)
                sums["turns"][row, i] += int(r.get("turns") or 0)
                sums["generated_tokens"][row, i] += int(r.get("generated_tokens") or 0)
                sums["invalid_actions"][row, i] += int(r.get("invalid_actions") or 0)
                # Records written before turns were marked cut leave the row's cut rate undefined, not 0.
                sums["cut_turns"][row, i] += int(r["cut_turns"]) if "cut_turns" in r else math.nan
        present = sums["episodes"] > 0
        sums["success_rate"] = np.divide(successes, sums["episodes"], out=np.zeros_like(successes), where=present)
        sums["solved"] = (successes > 0).astype(float)
        sums["present"] = present.astype(float)
        return cls(tasks, sums)

    def values(self, measure: str, weights: np.ndarray) -> np.ndarray:
        """``measure`` at every row under task ``weights`` of shape ``(B, tasks)``: shape ``(B, rows)``.

        Weights are how often each task occurs in a resample (all ones: the data).
        """
        numerator, denominator = _RATIOS[measure]
        top = weights @ self.sums[numerator].T
        bottom = weights @ self.sums[denominator].T
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(bottom > 0, top / np.where(bottom > 0, bottom, 1.0), math.nan)


# --- the paired bootstrap -------------------------------------------------------------------


class PairedBootstrap:
    """Resamples of the results matrices, one task resample per experience shared by every row.

    ``tables[j]`` holds experience ``j``'s per-task sums at every row. The
    resamples (``resamples`` of them, default 2000) are drawn at construction
    from ``seed``, experience by experience in test order.
    """

    def __init__(self, tables: Sequence[TaskTable], *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
                 level: float = 0.95) -> None:
        if resamples < 2:
            raise ValueError(f"resamples must be >= 2, got {resamples}")
        if not 0 < level < 1:
            raise ValueError(f"level must be in (0, 1), got {level}")
        self.tables = list(tables)
        self.resamples, self.seed, self.level = resamples, seed, level
        rng = np.random.default_rng(seed)
        self.weights = [_resample_weights(rng, len(table.tasks), resamples) for table in self.tables]
        self._cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    @classmethod
    def from_records(cls, records_per_row: Sequence[Iterable[dict[str, Any]]], test: Sequence[str],
                     **options: Any) -> PairedBootstrap:
        """From every row's trajectory records (``records_per_row[s]``) and the test experience names."""
        grouped = [group_by_experience(records, test) for records in records_per_row]
        tables = [TaskTable.from_records([rows[name] for rows in grouped]) for name in test]
        return cls(tables, **options)

    @property
    def rows(self) -> int:
        return next((t.sums["episodes"].shape[0] for t in self.tables), 0)

    def matrices(self, measure: str = "avg_at_k") -> tuple[np.ndarray, np.ndarray]:
        """(observed ``(rows, N)``, resampled ``(B, rows, N)``) matrices of ``measure``."""
        if measure not in _RATIOS:
            raise ValueError(f"unknown measure {measure!r}; valid: {', '.join(CELL_MEASURES)}")
        if measure not in self._cache:
            observed = np.stack([t.values(measure, np.ones((1, len(t.tasks))))[0] for t in self.tables], axis=-1)
            boot = np.stack([t.values(measure, w) for t, w in zip(self.tables, self.weights)], axis=-1)
            self._cache[measure] = (observed, boot)
        return self._cache[measure]

    def cell(self, measure: str, row: int, column: int) -> Interval:
        """The interval of one cell."""
        observed, boot = self.matrices(measure)
        return self._interval(observed[row, column], boot[:, row, column])

    def change(self, measure: str, row: int, column: int, base: int = 0) -> Interval:
        """The paired interval of ``R[row, column] - R[base, column]``."""
        observed, boot = self.matrices(measure)
        return self._interval(observed[row, column] - observed[base, column],
                              boot[:, row, column] - boot[:, base, column])

    def metric(self, fn: Callable[[np.ndarray, Sequence], float], trained_at: Sequence, *,
               measure: str = "avg_at_k", columns: Sequence[int] | None = None,
               rows: int | None = None) -> Interval:
        """The interval of ``fn(R, trained_at)`` (any metric of `contrail.metrics`) on paired resamples.

        ``columns`` restricts R to some experiences (a partial run), ``rows``
        to its first rows.
        """
        return self.statistic(lambda R: fn(R, trained_at), measure=measure, columns=columns, rows=rows)

    def statistic(self, fn: Callable[[np.ndarray], float], *, measure: str = "avg_at_k",
                  columns: Sequence[int] | None = None, rows: int | None = None) -> Interval:
        """The interval of any scalar function of the ``(rows, N)`` matrix."""
        return self.statistics(lambda R: {"value": fn(R)}, measure=measure, columns=columns, rows=rows)["value"]

    def statistics(self, fn: Callable[[np.ndarray], dict[str, Any]], *, measure: str = "avg_at_k",
                   columns: Sequence[int] | None = None, rows: int | None = None) -> dict[str, Any]:
        """Intervals of every entry of ``fn(R)``, a dict of scalars or 1-D arrays, in one pass.

        A scalar entry gives an `Interval`, an array entry a list of them
        (e.g. `contrail.metrics.summarize` or `deltas_by_row`).
        """
        observed, boot = self.matrices(measure)
        keep = list(range(observed.shape[1])) if columns is None else list(columns)
        rows = observed.shape[0] if rows is None else rows
        point = fn(observed[:rows, keep])
        draws = [fn(matrix[:rows, keep]) for matrix in boot]
        out: dict[str, Any] = {}
        for key, value in point.items():
            samples = np.array([np.asarray(d[key], dtype=float) for d in draws])
            if np.ndim(value) == 0:
                out[key] = self._interval(value, samples)
            else:
                out[key] = [self._interval(v, samples[:, i]) for i, v in enumerate(np.asarray(value, dtype=float))]
        return out

    def _interval(self, estimate: float, values: np.ndarray) -> Interval:
        estimate = float(estimate)
        values = values[np.isfinite(values)]
        if math.isnan(estimate) or values.size < 2:
            return Interval(estimate, math.nan, math.nan, math.nan)
        tail = (1 - self.level) / 2 * 100
        low, high = np.percentile(values, [tail, 100 - tail])
        return Interval(estimate, float(np.std(values, ddof=1)), float(low), float(high))


def _resample_weights(rng: np.random.Generator, tasks: int, resamples: int) -> np.ndarray:
    """``(resamples, tasks)`` counts: how often each task is drawn in each resample of ``tasks`` draws."""
    if tasks == 0:
        return np.zeros((resamples, 0))
    draws = rng.integers(0, tasks, size=(resamples, tasks))
    weights = np.zeros((resamples, tasks))
    np.add.at(weights, (np.arange(resamples)[:, None], draws), 1.0)
    return weights


# --- across runs (seeds) --------------------------------------------------------------------


def seed_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """Mean over runs with its standard error and a Student-t interval (``n - 1`` degrees of freedom).

    ``se = std(ddof=1) / sqrt(n)``; the interval is ``mean ± t_{n-1} · se``.
    Non-finite values are left out; one value gives no spread (``nan``).
    """
    from scipy import stats

    clean = np.array([float(v) for v in values if v is not None and math.isfinite(float(v))])
    if clean.size == 0:
        return Interval.undefined()
    mean = float(clean.mean())
    if clean.size == 1:
        return Interval(mean, math.nan, math.nan, math.nan)
    se = float(clean.std(ddof=1) / math.sqrt(clean.size))
    half = float(stats.t.ppf(0.5 + level / 2, clean.size - 1)) * se
    return Interval(mean, se, mean - half, mean + half)
