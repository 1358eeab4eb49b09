"""Reports of a run (markdown, CSV, PNG) and comparisons of several runs.

`write_report` reads a run directory (``plan.json``, ``results.jsonl`` and the
evaluation trajectories ``trajectories/stage-XX.jsonl``; never ``config.yaml``)
and writes ``report.md``, ``matrix.csv``, ``metrics.csv``, ``heatmap.png`` and
``success_by_stage.png``. It works on a run still in progress: the metrics
then cover the experiences trained so far and the held-out ones.

Every number carries its uncertainty when the trajectories are there: a cell's
standard error and 95% interval come from a bootstrap over its tasks, a
metric's from the paired bootstrap of `contrail.intervals` (the same task
resample for every row). Failure modes are counted per cell with
`contrail.diagnostics`, correct-set turnover with `contrail.drift`, and a row's
``"drift"`` entry (KL to the start model, parameters changed) is shown when
the runner stored one.

`compare` groups runs by their label (strategy, options and order, never the
seed) and tabulates mean ± std over seeds with a Student-t interval.

>>> write_report(Path("runs/quickstart"))
>>> print(compare(sorted(Path("runs/ordering_ablation").glob("*/seed*"))))
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from contrail import diagnostics, drift, metrics
from contrail.intervals import (
    DEFAULT_RESAMPLES,
    DEFAULT_SEED,
    Interval,
    PairedBootstrap,
    group_by_experience,
    read_trajectories,
    seed_interval,
)
from contrail.results import RunDir, recorded_measures, result_matrix

__all__ = [
    "MEASURES",
    "METRICS",
    "Analysis",
    "RunData",
    "analyse",
    "compare",
    "failure_counts",
    "load_run",
    "write_report",
]

# EvalResult fields shown per stage, with their display names (each gets an interval).
MEASURES = {
    "avg_at_k": "avg@k", "pass_at_k": "pass@k", "reward": "reward", "turns": "turns",
    "generated_tokens": "generated tokens", "invalid_rate": "invalid-action rate",
    "cut_rate": "share of turns cut at max_new_tokens",
}

# The continual-learning metrics (on avg@k), with one-line definitions.
METRICS = {
    "final_performance": ("ACC", "mean over trained experiences of the score after the last stage, R[S, j]"),
    "backward_transfer": (
        "BWT", "mean of R[S, j] − R[s_j, j]: how later stages changed what was learned (negative = forgetting)"
    ),
    "forgetting": (
        "forgetting", "mean of max(R[s_j..S−1, j]) − R[S, j]: the drop from each experience's best score"
    ),
    "forward_transfer": (
        "FWT", "mean of R[s_j − 1, j] − R[0, j]: how earlier stages helped before an experience was trained"
    ),
    "heldout_gain": ("held-out gain", "mean of R[S, h] − R[0, h] over experiences never trained"),
    "delta_held_in": ("ΔHeld-In", "mean of R[S, j] − R[0, j] over the trained experiences"),
    "delta_held_out": ("ΔHeld-Out", "mean of R[S, h] − R[0, h] over the held-out experiences (= held-out gain)"),
    "delta_overall": ("ΔOverall", "mean of R[S, j] − R[0, j] over every test experience"),
}
_SEED_DIR = re.compile(r"^seed[-_]?(\d+)$")
_EXAMPLES = 3  # example episodes linked per failure tag


@dataclass
class RunData:
    """What a report needs from a run directory."""

    path: Path
    plan: dict[str, Any] | None
    rows: list[dict[str, Any]]
    test: list[str]
    trained_at: list[int | None]   # as planned (1-based stage), None = held out
    planned_stages: int

    @property
    def completed(self) -> int:
        """Stages recorded (0 when only the untouched model's row exists)."""
        return max(len(self.rows) - 1, 0)

    @property
    def label(self) -> str:
        """The run's group for comparisons: ``plan.json``'s ``label``.

        A run written before labels existed is grouped by its directory (the
        parent's name when the directory is a ``seed<N>`` folder of a fan-out).
        """
        if self.plan and self.plan.get("label"):
            return str(self.plan["label"])
        return self.path.parent.name if _SEED_DIR.match(self.path.name) else self.path.name

    @property
    def seed(self) -> int | str:
        """The run's root seed (``plan.json``, else a ``seed<N>`` directory name, else ``?``)."""
        if self.plan and self.plan.get("seed") is not None:
            return self.plan["seed"]
        match = _SEED_DIR.match(self.path.name)
        return int(match.group(1)) if match else "?"

    def matrix(self, measure: str = "avg_at_k") -> np.ndarray:
        return result_matrix(self.rows, self.test, measure)

    @property
    def measures(self) -> dict[str, str]:
        """The `MEASURES` some row recorded (a run older than a measure has no table of it)."""
        recorded = recorded_measures(self.rows)
        return {measure: title for measure, title in MEASURES.items() if measure in recorded}

    def metric_columns(self) -> list[int] | None:
        """Columns the recorded stages can define metrics for; None before stage 1.

        Experiences planned for a stage not yet recorded are dropped: they are
        neither trained nor held out yet.
        """
        if self.completed < 1:
            return None
        return [j for j, s in enumerate(self.trained_at) if s is None or s <= self.completed]

    def metric_view(self, measure: str = "avg_at_k") -> tuple[np.ndarray, list[int | None]] | None:
        """``(R, trained_at)`` restricted to `metric_columns`; None before stage 1."""
        keep = self.metric_columns()
        if keep is None:
            return None
        return self.matrix(measure)[:, keep], [self.trained_at[j] for j in keep]

    def summary(self, measure: str = "avg_at_k") -> dict[str, float]:
        view = self.metric_view(measure)
        if view is None:
            return {name: math.nan for name in METRICS}
        return metrics.summarize(*view)

    def trajectories_file(self, stage: int) -> Path:
        """Where row ``stage``'s evaluation episodes are (the layout of `RunDir.trajectories_path`)."""
        return self.path / "trajectories" / f"stage-{stage:02d}.jsonl"


def load_run(run_dir: Path | str) -> RunData:
    """Read a run directory; without ``plan.json`` the test names and stages come from the rows."""
    path = Path(run_dir)
    if not (path / "results.jsonl").is_file() and not (path / "plan.json").is_file():
        raise FileNotFoundError(f"{path} is not a contrail run (no results.jsonl or plan.json)")
    rows = RunDir(path).rows()
    plan = json.loads((path / "plan.json").read_text(encoding="utf-8")) if (path / "plan.json").is_file() else None
    if plan is not None:
        test, trained_at, planned = list(plan["test"]), list(plan["trained_at"]), len(plan["stages"])
    else:
        test = list(rows[0]["results"]) if rows else []
        first: dict[str, int] = {}
        for row in rows[1:]:
            for name in row.get("trained", []):
                first.setdefault(name, row["stage"])
        trained_at = [first.get(name) for name in test]
        planned = max(len(rows) - 1, 0)
    return RunData(path, plan, rows, test, trained_at, planned)


# --- everything a report computes ----------------------------------------------------------


@dataclass
class Failures:
    """Failure-tag counts per cell and example episodes per tag."""

    counts: list[list[dict[str, int]]]           # [row][column] -> tag -> episodes
    episodes: list[list[int]]                    # [row][column] -> episodes read
    # tag -> [(row, line in the row's trajectories file, record)]
    examples: dict[str, list[tuple[int, int, dict[str, Any]]]] = field(default_factory=dict)


@dataclass
class Analysis:
    """A run's numbers with their uncertainty; fields are None where the data is missing."""

    data: RunData
    bootstrap: PairedBootstrap | None
    note: str                                    # why there are no intervals, when there are none
    metric_intervals: dict[str, Interval] | None
    row_deltas: dict[str, list[Interval]] | None
    failures: Failures | None
    turnover: list[dict[str, drift.Turnover]] | None  # [row] -> experience -> turnover from row - 1

    def cell(self, measure: str, row: int, column: int) -> Interval | None:
        return self.bootstrap.cell(measure, row, column) if self.bootstrap else None

    def significant(self, measure: str, row: int, column: int) -> bool:
        """Whether cell (row, column) differs from row 0 beyond the noise (paired interval excludes 0)."""
        return bool(self.bootstrap and row > 0 and self.bootstrap.change(measure, row, column).significant)


def analyse(data: RunData | Path | str, *, seed: int = DEFAULT_SEED, resamples: int = DEFAULT_RESAMPLES) -> Analysis:
    """Intervals, Δ measures per row, failure counts and turnover of a run (a `RunData` or its directory)."""
    data = data if isinstance(data, RunData) else load_run(data)
    records = _row_records(data)
    boot, note = None, ""
    if records is None:
        note = "no intervals: the evaluation trajectories of some rows are missing"
    else:
        boot = PairedBootstrap.from_records(records, data.test, seed=seed, resamples=resamples)
        if not _matches_rows(boot, data):
            boot, note = None, "no intervals: the trajectories do not reproduce results.jsonl"
    metric_intervals = row_deltas = None
    keep = data.metric_columns()
    if boot is not None and keep is not None:
        trained = [data.trained_at[j] for j in keep]
        metric_intervals = boot.statistics(lambda R: metrics.summarize(R, trained), columns=keep)
        row_deltas = boot.statistics(lambda R: metrics.deltas_by_row(R, trained), columns=keep)
    failures = failure_counts(data, records) if records is not None else None
    return Analysis(data, boot, note, metric_intervals, row_deltas, failures, _turnover(data, records))


def _row_records(data: RunData) -> list[list[dict[str, Any]]] | None:
    """Every recorded row's trajectory records, or None when a row's file is missing."""
    files = [data.trajectories_file(stage) for stage in range(len(data.rows))]
    if not files or not all(f.is_file() for f in files):
        return None
    return [read_trajectories(f) for f in files]


def _matches_rows(boot: PairedBootstrap, data: RunData) -> bool:
    observed, _ = boot.matrices("avg_at_k")
    recorded = data.matrix("avg_at_k")
    return observed.shape == recorded.shape and bool(np.allclose(observed, recorded, atol=1e-9, equal_nan=True))


def failure_counts(data: RunData, records: list[list[dict[str, Any]]] | None = None) -> Failures:
    """Failure tags (`contrail.diagnostics`) counted per cell, with up to 3 example episodes per tag
    (one per cell, the latest rows first).

    A turn limit in ``plan.json``'s ``turn_limits`` (per test experience)
    overrides the environments' defaults for ``out_of_turns``.
    """
    records = _row_records(data) if records is None else records
    limits = (data.plan or {}).get("turn_limits") or {}
    counts = [[dict.fromkeys(diagnostics.TAGS, 0) for _ in data.test] for _ in records or []]
    episodes = [[0 for _ in data.test] for _ in records or []]
    first: dict[str, dict[tuple[int, int], tuple[int, int, dict[str, Any]]]] = {tag: {} for tag in diagnostics.TAGS}
    for row, row_records in enumerate(records or []):
        line_of = {id(r): line for line, r in enumerate(row_records, start=1)}
        grouped = group_by_experience(row_records, data.test)
        for column, name in enumerate(data.test):
            for record in grouped[name]:
                episodes[row][column] += 1
                for tag in diagnostics.tags(record, turn_limit=limits.get(name)):
                    counts[row][column][tag] += 1
                    first[tag].setdefault((row, column), (row, line_of[id(record)], record))
    # One example per cell, the latest rows first: the final model's failures matter most.
    examples = {tag: [cells[key] for key in sorted(cells, key=lambda rc: (-rc[0], rc[1]))[:_EXAMPLES]]
                for tag, cells in first.items()}
    return Failures(counts, episodes, examples)


def _turnover(data: RunData, records) -> list[dict[str, drift.Turnover]] | None:
    if records is None:
        return None
    per_row = [group_by_experience(row_records, data.test) for row_records in records]
    successes = [{name: drift.task_successes(rows[name]) for name in data.test} for rows in per_row]
    return [{}] + [{name: drift.turnover(successes[s - 1][name], successes[s][name]) for name in data.test}
                   for s in range(1, len(successes))]


# --- a run's report ---------------------------------------------------------------------


def write_report(run_dir: Path | str, *, seed: int = DEFAULT_SEED, resamples: int = DEFAULT_RESAMPLES) -> list[Path]:
    """Write ``report.md``, ``matrix.csv``, ``metrics.csv``, ``heatmap.png``, ``success_by_stage.png``.

    Returns their paths. ``seed`` and ``resamples`` set the bootstrap (the
    same seed gives the same intervals).
    """
    data = load_run(run_dir)
    if not data.rows:
        raise ValueError(f"{data.path} has no results yet (results.jsonl is empty or missing)")
    analysis = analyse(data, seed=seed, resamples=resamples)
    written = [_write_csv(analysis), _write_metrics_csv(analysis), _write_heatmap(analysis), _write_success_plot(data)]
    report = data.path / "report.md"
    report.write_text(_markdown(analysis), encoding="utf-8")
    return [report, *written]


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    value = float(value)
    return "–" if math.isnan(value) else f"{value:.{digits}f}"


def _fmt_interval(interval: Interval | None, value: float | None = None, digits: int = 3) -> str:
    """``0.600 ± 0.080`` (estimate ± standard error), or the bare value without an interval."""
    if interval is None or math.isnan(interval.se):
        return _fmt(value if value is not None else (interval.estimate if interval else None), digits)
    return f"{_fmt(interval.estimate if value is None else value, digits)} ± {_fmt(interval.se, digits)}"


def _column_name(name: str, trained_at: int | None) -> str:
    return f"{name} (held out)" if trained_at is None else f"{name} (trained s{trained_at})"


def _stage_name(data: RunData, stage: int) -> str:
    if stage < len(data.rows):
        return str(data.rows[stage].get("name", stage))
    return "untouched" if stage == 0 else str(stage)


def _markdown(analysis: Analysis) -> str:
    data = analysis.data
    plan = data.plan or {}
    lines = [f"# {data.path.name}", ""]
    lines.append(f"- run: {data.label}; seed: {data.seed}")
    if plan.get("start_model"):
        lines.append(f"- start model: `{plan['start_model']}`")
    warm = plan.get("warmstart")
    if warm:
        lines.append(
            f"- warm-start: behaviour cloning on expert episodes of {', '.join(warm.get('envs', []))} "
            f"({warm.get('episodes', '?')} episodes in all, {warm.get('epochs', '?')} "
            f"epoch{'' if warm.get('epochs') == 1 else 's'}, "
            f"lr {warm.get('lr', '?')}) "
            "before stage 1; row 0 is the warm-started model"
        )
    status = "finished" if RunDir(data.path).finished() else "in progress or interrupted"
    lines.append(f"- stages recorded: {data.completed} of {data.planned_stages} ({status})")
    if analysis.bootstrap is not None:
        b = analysis.bootstrap
        lines.append(f"- uncertainty: estimate ± standard error from {b.resamples} bootstrap resamples of the test "
                     f"tasks (a task's k samples kept together; the same resample for every row), seed {b.seed}; "
                     f"`*`: the cell's change from row 0 has a 95% paired interval that excludes 0")
    else:
        lines.append(f"- uncertainty: {analysis.note}")
    lines.append("")
    lines += _stages_table(data)
    for measure, title in data.measures.items():
        lines += [f"## {title} after each stage", ""]
        lines += _matrix_table(analysis, measure)
    lines += _metrics_section(analysis)
    lines += _failures_section(analysis)
    lines += _turnover_section(analysis)
    lines += _drift_section(data)
    files = ("`matrix.csv` (every measure, with se and 95% interval columns), `metrics.csv`, `heatmap.png` "
             "(avg@k), `success_by_stage.png`, `trajectories/stage-XX.jsonl` (every episode).")
    lines += ["## Files", "", files, ""]
    return "\n".join(lines)


def _stages_table(data: RunData) -> list[str]:
    if not data.plan:
        return []
    lines = ["## Stages", "", "| stage | name | newly trained | samples from (share) | GRPO steps | wall time |",
             "|---|---|---|---|---|---|"]
    if data.rows and data.rows[0].get("eval_seconds") is not None:  # older runs recorded no setup time
        lines.append(f"| 0 | {data.rows[0].get('name', 'start')} | – | – | – | {_wall_time(data.rows[0])} |")
    for stage in data.plan["stages"]:
        index = stage["index"]
        shares = ", ".join(f"{n} {w:.2f}" for n, w in stage["weights"].items())
        wall = _wall_time(data.rows[index]) if index < len(data.rows) else "–"
        trained = ", ".join(stage.get("new", stage.get("experiences", [])))
        lines.append(f"| {index} | {stage['name']} | {trained} | {shares} | {stage['steps']} | {wall} |")
    note = ("Wall time: the stage's training and evaluation, the evaluation's share in parentheses; row 0's: "
            "the setup (model, warm-start, loading) and its evaluation, in the process that recorded the row. "
            "System: that process's time in the kernel over the row (page faults on memory it touches first, I/O); "
            "peak: its resident memory at most, up to the row's end.")
    return lines + ["", note, ""]


def _wall_time(row: dict) -> str:
    """``"16.6 min (evaluation 4.9, system 0.2; peak 7.5 GB)"`` with the parts the row recorded, or ``"–"``."""
    if row.get("wall_seconds") is None:
        return "–"
    wall = f"{row['wall_seconds'] / 60:.1f} min"
    times = [f"{label} {row[key] / 60:.1f}" for label, key in (("evaluation", "eval_seconds"),
                                                              ("system", "system_seconds")) if key in row]
    parts = ", ".join(times) + (f"; peak {row['peak_memory_gb']:.1f} GB" if "peak_memory_gb" in row else "")
    return f"{wall} ({parts.lstrip('; ')})" if parts else wall


def _matrix_table(analysis: Analysis, measure: str) -> list[str]:
    data = analysis.data
    R = data.matrix(measure)
    header = "| after stage | " + " | ".join(_column_name(n, s) for n, s in zip(data.test, data.trained_at)) + " |"
    lines = [header, "|---" * (len(data.test) + 1) + "|"]
    digits = 1 if measure in ("turns", "generated_tokens") else 3
    for i in range(R.shape[0]):
        cells = []
        for j, s in enumerate(data.trained_at):
            text = _fmt_interval(analysis.cell(measure, i, j), R[i, j], digits)
            text += "*" if analysis.significant(measure, i, j) else ""
            cells.append(f"**{text}**" if s == i else text)
        lines.append(f"| {i} {_stage_name(data, i)} | " + " | ".join(cells) + " |")
    note = "Bold: the stage in which the experience is first trained." if measure == "avg_at_k" else ""
    return lines + ([""] + [note] if note else []) + [""]


def _metrics_section(analysis: Analysis) -> list[str]:
    data = analysis.data
    lines = ["## Continual-learning metrics (avg@k)", ""]
    view = data.metric_view()
    if view is None:
        return lines + ["No stage recorded yet.", ""]
    if data.completed < data.planned_stages:
        partial = f"Partial run: over stages 0..{data.completed}, the experiences trained so far and the held-out ones."
        lines += [partial, ""]
    summary = metrics.summarize(*view)
    intervals = analysis.metric_intervals or {}
    lines += ["| metric | value | se | 95% interval | definition |", "|---|---|---|---|---|"]
    for key, (title, definition) in METRICS.items():
        interval = intervals.get(key)
        se = _fmt(interval.se) if interval else "–"
        ci = f"[{_fmt(interval.low)}, {_fmt(interval.high)}]" if interval and not math.isnan(interval.low) else "–"
        lines.append(f"| {title} | {_fmt(summary[key])} | {se} | {ci} | {definition} |")
    legend = ("R[s, j]: avg@k of experience j after stage s (row 0: before training); s_j: the stage where j is "
              "first trained; S: the last stage; '–': undefined (an empty set) or no interval.")
    lines += ["", legend, ""]
    lines += _deltas_by_row(analysis, *view)
    R, trained_at = view
    names = [data.test[j] for j in data.metric_columns()]
    lines += ["| experience | trained at | initial | final | BWT | forgetting | FWT | held-out gain |",
              "|---|---|---|---|---|---|---|---|"]
    for name, row in zip(names, metrics.per_experience(R, trained_at)):
        lines.append(
            f"| {name} | {row['trained_at'] or 'held out'} | {_fmt(row['initial'])} | {_fmt(row['final'])} | "
            f"{_fmt(row['backward_transfer'])} | {_fmt(row['forgetting'])} | {_fmt(row['forward_transfer'])} | "
            f"{_fmt(row['heldout_gain'])} |"
        )
    return lines + [""]


def _deltas_by_row(analysis: Analysis, R: np.ndarray, trained_at: list[int | None]) -> list[str]:
    data = analysis.data
    values = metrics.deltas_by_row(R, trained_at)
    intervals = analysis.row_deltas or {}
    lines = ["### ΔHeld-In, ΔHeld-Out, ΔOverall after each stage", "",
             "| after stage | ΔHeld-In | ΔHeld-Out | ΔOverall |", "|---|---|---|---|"]
    for i in range(1, R.shape[0]):
        cells = []
        for key in metrics.DELTAS:
            interval = intervals[key][i] if key in intervals else None
            mark = "*" if interval is not None and interval.significant else ""
            cells.append(_fmt_interval(interval, values[key][i]) + mark)
        lines.append(f"| {i} {_stage_name(data, i)} | " + " | ".join(cells) + " |")
    legend = ("Held-in after stage s: the experiences trained by then (s_j ≤ s); "
              "`*`: the 95% paired interval excludes 0.")
    return lines + ["", legend, ""]


def _failures_section(analysis: Analysis) -> list[str]:
    data = analysis.data
    lines = ["## Failure modes", ""]
    errors = [(i, name, int(row["results"][name].get("errors") or 0)) for i, row in enumerate(data.rows)
              for name in data.test if name in row.get("results", {})]
    raised = [(i, name, n) for i, name, n in errors if n]
    if raised:
        lines.append("Evaluation episodes whose environment raised: " +
                     ", ".join(f"{n} in row {i} {name}" for i, name, n in raised) + ".")
    else:
        lines.append("No evaluation episode's environment raised.")
    lines.append("")
    failures = analysis.failures
    if failures is None:
        return lines + ["No failure tags: the evaluation trajectories are missing.", ""]
    shown = [tag for tag in diagnostics.TAGS if any(c[tag] for row in failures.counts for c in row)]
    if not shown:
        return lines + ["No episode carries a failure tag.", ""]
    lines += ["Episodes per cell carrying each tag (tags are not exclusive; rules in `contrail.diagnostics`).", "",
              "| after stage | experience | episodes | " + " | ".join(shown) + " |",
              "|---|---|---" + "|---" * len(shown) + "|"]
    for i, row in enumerate(failures.counts):
        for j, name in enumerate(data.test):
            cells = " | ".join(str(row[j][tag]) for tag in shown)
            lines.append(f"| {i} {_stage_name(data, i)} | {name} | {failures.episodes[i][j]} | {cells} |")
    lines += ["", "| tag | meaning | examples |", "|---|---|---|"]
    for tag in shown:
        links = ", ".join(_episode_link(data, row, line, record) for row, line, record in failures.examples[tag])
        lines.append(f"| {tag} | {diagnostics.TAGS[tag]} | {links} |")
    return lines + [""]


def _episode_link(data: RunData, row: int, line: int, record: dict[str, Any]) -> str:
    task = record.get("task") or {}
    target = data.trajectories_file(row).relative_to(data.path).as_posix()
    return (f"[row {row}, line {line}]({target}) ({task.get('env')} task {task.get('id')}, "
            f"sample {record.get('sample', 0)})")


def _turnover_section(analysis: Analysis) -> list[str]:
    data, table = analysis.data, analysis.turnover
    if table is None or len(table) < 2:
        return []
    lines = ["## Correct-set turnover", "",
             ("Test tasks solved (at least half of their samples succeed) after the previous stage and failed after "
              "this one (lost), and the reverse (gained)."), "",
             "| after stage | " + " | ".join(f"{n} lost / gained" for n in data.test) + " |",
             "|---" * (len(data.test) + 1) + "|"]
    for i in range(1, len(table)):
        cells = " | ".join(f"{table[i][n].lost} / {table[i][n].gained} of {table[i][n].tasks}" for n in data.test)
        lines.append(f"| {i} {_stage_name(data, i)} | {cells} |")
    return lines + [""]


def _drift_section(data: RunData) -> list[str]:
    rows = [(i, row["drift"]) for i, row in enumerate(data.rows) if isinstance(row.get("drift"), dict)]
    if not rows:
        return []
    lines = ["## Forgetting beyond success", "",
             ("KL(start model ‖ policy) per token on tokens the start model sampled on each experience's own prompts "
              "(k3 estimator ± its standard error), and the share of parameters changed since the previous stage."), "",
             "| after stage | " + " | ".join(f"KL {n}" for n in data.test) + " | parameters changed |",
             "|---" * (len(data.test) + 2) + "|"]
    for i, entry in rows:
        kl = entry.get("kl") or {}
        cells = []
        for name in data.test:
            est = kl.get(name)
            cells.append("–" if not est else f"{_fmt(est.get('k3'), 4)} ± {_fmt(est.get('se_k3'), 4)}")
        params = entry.get("params") or {}
        changed = f"{100 * params['fraction']:.2f}%" if params.get("fraction") is not None else "–"
        lines.append(f"| {i} {_stage_name(data, i)} | " + " | ".join(cells) + f" | {changed} |")
    return lines + [""]


def _write_csv(analysis: Analysis) -> Path:
    """Wide CSV: the values of every test experience, then per experience its se, ci_low and ci_high."""
    data = analysis.data
    path = data.path / "matrix.csv"
    extra = [f"{name} {part}" for name in data.test for part in ("se", "ci_low", "ci_high")]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["measure", "stage", "stage_name", *data.test, *extra])
        for measure in data.measures:
            R = data.matrix(measure)
            for i in range(R.shape[0]):
                values = [_csv(v) for v in R[i]]
                spread = []
                for j in range(len(data.test)):
                    cell = analysis.cell(measure, i, j)
                    spread += [_csv(cell.se), _csv(cell.low), _csv(cell.high)] if cell else ["", "", ""]
                writer.writerow([measure, i, _stage_name(data, i), *values, *spread])
    return path


def _write_metrics_csv(analysis: Analysis) -> Path:
    path = analysis.data.path / "metrics.csv"
    summary = analysis.data.summary()
    intervals = analysis.metric_intervals or {}
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["metric", "value", "se", "ci_low", "ci_high"])
        for key in METRICS:
            interval = intervals.get(key)
            spread = [_csv(interval.se), _csv(interval.low), _csv(interval.high)] if interval else ["", "", ""]
            writer.writerow([key, _csv(summary[key]), *spread])
    return path


def _csv(value: float) -> str:
    return "" if value is None or math.isnan(value) else f"{value:.6g}"


def _figure(width: float, height: float):
    from matplotlib.figure import Figure  # no pyplot: no global state, renders with Agg

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.add_subplot()


def _write_heatmap(analysis: Analysis) -> Path:
    from matplotlib.patches import Rectangle

    data = analysis.data
    R = data.matrix("avg_at_k")
    rows, cols = R.shape
    fig, ax = _figure(max(5.0, 1.3 * cols + 2.5), max(2.8, 0.65 * rows + 2.0))
    image = ax.imshow(np.ma.masked_invalid(R), vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    for i in range(rows):
        for j in range(cols):
            value = R[i, j]
            text = _fmt(value, 2) + ("*" if analysis.significant("avg_at_k", i, j) else "")
            cell = analysis.cell("avg_at_k", i, j)
            if cell is not None and not math.isnan(cell.se):
                text += f"\n± {cell.se:.2f}"
            ax.text(j, i, text, ha="center", va="center",
                    color="black" if not math.isnan(value) and value > 0.6 else "white", fontsize=9)
    for j, s in enumerate(data.trained_at):
        if s is not None and s < rows:
            ax.add_patch(Rectangle((j - 0.5, s - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
    ax.set_xticks(range(cols), [_column_name(n, s).replace(" (", "\n(") for n, s in zip(data.test, data.trained_at)],
                  fontsize=8)
    ax.set_yticks(range(rows), [f"{i} {_stage_name(data, i)}" for i in range(rows)], fontsize=8)
    ax.set_xlabel("test experience")
    ax.set_ylabel("after stage")
    marks = "\n± bootstrap se; *: the change from row 0 is significant (95%)" if analysis.bootstrap else ""
    ax.set_title(f"avg@k — {data.path.name} (red: first trained){marks}", fontsize=10)
    fig.colorbar(image, ax=ax, label="avg@k")
    path = data.path / "heatmap.png"
    fig.savefig(path, dpi=120)
    return path


def _write_success_plot(data: RunData) -> Path:
    R = data.matrix("avg_at_k")
    stages = np.arange(R.shape[0])
    fig, ax = _figure(7.0, 4.0)
    for j, (name, s) in enumerate(zip(data.test, data.trained_at)):
        style = "--" if s is None else "-"
        (line,) = ax.plot(stages, R[:, j], style, marker="o", label=_column_name(name, s))
        if s is not None and s < R.shape[0]:
            ax.plot([s], [R[s, j]], marker="*", markersize=14, color=line.get_color())
    ax.set_xticks(stages, [f"{i}\n{_stage_name(data, i)}" for i in stages], fontsize=7)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("after stage")
    ax.set_ylabel("avg@k")
    ax.set_title("success by stage (★ first trained, dashed: held out)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    path = data.path / "success_by_stage.png"
    fig.savefig(path, dpi=120)
    return path


# --- comparing runs ---------------------------------------------------------------------


def compare(run_dirs: list[Path | str], *, level: float = 0.95) -> str:
    """A markdown table over runs grouped by label: mean ± std over seeds, with a t-interval.

    Columns: the number of runs (and seeds), each metric on avg@k, and the
    final avg@k of every test experience. Each cell is ``mean ± sample std
    [low, high]`` where ``[low, high]`` is the Student-t interval of the mean
    over the group's runs (``n − 1`` degrees of freedom; `seed_interval`). A
    group with unfinished runs says how many; metrics undefined in a run are
    left out of its group's mean ('–' when undefined in all).
    """
    if not run_dirs:
        raise ValueError("compare needs at least one run directory")
    runs = [load_run(p) for p in run_dirs]
    groups: dict[str, list[RunData]] = {}
    for run in runs:
        groups.setdefault(run.label, []).append(run)
    experiences = list(dict.fromkeys(name for run in runs for name in run.test))
    header = ["runs", "seeds"] + [title for title, _ in METRICS.values()] + [f"final {e}" for e in experiences]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for label, members in groups.items():
        seeds = ", ".join(str(run.seed) for run in members)
        partial = sum(run.completed < run.planned_stages or run.completed == 0 for run in members)
        count = f"{label} (n={len(members)}{f', {partial} unfinished' if partial else ''})"
        summaries = [run.summary() for run in members]
        cells = [count, seeds] + [_over_seeds([s[key] for s in summaries], level) for key in METRICS]
        for name in experiences:
            finals = [run.matrix()[-1, run.test.index(name)] for run in members if name in run.test and run.rows]
            cells.append(_over_seeds(finals, level))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Metrics on avg@k; mean ± sample std over the runs of a group, then [the {level:.0%} Student-t "
              "interval of the mean over runs, n − 1 degrees of freedom] when n ≥ 2. " +
              "; ".join(f"{title}: {definition}" for title, definition in METRICS.values()) + "."]
    return "\n".join(lines) + "\n"


def _over_seeds(values: list[float], level: float) -> str:
    values = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    interval = seed_interval(values, level)
    return f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f} [{interval.low:.3f}, {interval.high:.3f}]"
