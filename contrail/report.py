"""Reports of a run (markdown, CSV, PNG) and comparisons of several runs.

`write_report` reads a run directory (``config.yaml``, ``results.jsonl``,
``plan.json``) and writes ``report.md``, ``matrix.csv``, ``heatmap.png`` and
``success_by_stage.png``. It works on a run still in progress: the metrics
then cover the experiences trained so far and the held-out ones.

`compare` groups runs by their label (strategy and order, not the seed) and
tabulates mean ± std over seeds.

>>> write_report(Path("runs/quickstart"))
>>> print(compare(sorted(Path("runs/ordering_ablation").glob("*/seed*"))))
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from contrail import metrics
from contrail.results import RunDir, result_matrix

__all__ = ["MEASURES", "METRICS", "RunData", "compare", "load_run", "write_report"]

# EvalResult fields shown per stage, with their display names.
MEASURES = {"avg_at_k": "avg@k", "pass_at_k": "pass@k", "reward": "reward", "invalid_rate": "invalid-action rate"}

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
}


@dataclass
class RunData:
    """What a report needs from a run directory."""

    path: Path
    config: dict[str, Any]
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
        """The run's group for comparisons (the config's ``label``, else strategy and order)."""
        if self.config.get("label"):
            return str(self.config["label"])
        strategy = (self.config.get("strategy") or {}).get("name", "?")
        train = (self.config.get("stream") or {}).get("train") or []
        return f"{strategy}: {' → '.join(train)}"

    def matrix(self, measure: str = "avg_at_k") -> np.ndarray:
        return result_matrix(self.rows, self.test, measure)

    def metric_view(self, measure: str = "avg_at_k") -> tuple[np.ndarray, list[int | None]] | None:
        """``(R, trained_at)`` restricted to what the recorded stages can define; None before stage 1.

        Columns of experiences planned for a stage not yet recorded are
        dropped: they are neither trained nor held out yet.
        """
        if self.completed < 1:
            return None
        keep = [j for j, s in enumerate(self.trained_at) if s is None or s <= self.completed]
        R = self.matrix(measure)[:, keep]
        return R, [self.trained_at[j] for j in keep]

    def summary(self, measure: str = "avg_at_k") -> dict[str, float]:
        view = self.metric_view(measure)
        if view is None:
            return {name: math.nan for name in METRICS}
        return metrics.summarize(*view)


def load_run(run_dir: Path | str) -> RunData:
    """Read a run directory; without ``plan.json`` the test names and stages come from the rows."""
    run = RunDir(run_dir)
    path = run.path
    if not (path / "config.yaml").is_file() and not (path / "results.jsonl").is_file():
        raise FileNotFoundError(f"{path} is not a contrail run (no config.yaml or results.jsonl)")
    config = run.config() if (path / "config.yaml").is_file() else {}
    rows = run.rows()
    plan = None
    if (path / "plan.json").is_file():
        plan = json.loads((path / "plan.json").read_text(encoding="utf-8"))
    if plan is not None:
        test = list(plan["test"])
        trained_at = list(plan["trained_at"])
        planned = len(plan["stages"])
    else:
        test = list(rows[0]["results"]) if rows else []
        first: dict[str, int] = {}
        for row in rows[1:]:
            for name in row.get("trained", []):
                first.setdefault(name, row["stage"])
        trained_at = [first.get(name) for name in test]
        planned = max(len(rows) - 1, 0)
    return RunData(path, config, plan, rows, test, trained_at, planned)


# --- a run's report ---------------------------------------------------------------------


def write_report(run_dir: Path | str) -> list[Path]:
    """Write ``report.md``, ``matrix.csv``, ``heatmap.png``, ``success_by_stage.png``; return their paths."""
    data = load_run(run_dir)
    if not data.rows:
        raise ValueError(f"{data.path} has no results yet (results.jsonl is empty or missing)")
    written = [_write_csv(data), _write_heatmap(data), _write_success_plot(data)]
    report = data.path / "report.md"
    report.write_text(_markdown(data), encoding="utf-8")
    return [report, *written]


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    value = float(value)
    return "–" if math.isnan(value) else f"{value:.{digits}f}"


def _column_name(name: str, trained_at: int | None) -> str:
    return f"{name} (held out)" if trained_at is None else f"{name} (trained s{trained_at})"


def _stage_name(data: RunData, stage: int) -> str:
    if stage < len(data.rows):
        return str(data.rows[stage].get("name", stage))
    return "untouched" if stage == 0 else str(stage)


def _markdown(data: RunData) -> str:
    cfg = data.config
    lines = [f"# {cfg.get('name', data.path.name)}", ""]
    model = (cfg.get("model") or {}).get("name") or (data.plan or {}).get("start_model") or "?"
    strategy = cfg.get("strategy") or {}
    options = ", ".join(f"{k}={v}" for k, v in (strategy.get("options") or {}).items())
    described = f"{strategy.get('name', '?')}{f' ({options})' if options else ''}"
    lines.append(f"- model: `{model}`; strategy: {described}; seed: {cfg.get('seed', '?')}")
    if data.plan and data.plan.get("start_model"):
        lines.append(f"- start model: `{data.plan['start_model']}`")
    warm = (data.plan or {}).get("warmstart") or (cfg.get("model") or {}).get("warmstart")
    if warm:
        lines.append(
            f"- warm-start: behaviour cloning on expert episodes of {', '.join(warm.get('envs', []))} "
            f"({warm.get('episodes', '?')} episodes in all, {warm.get('epochs', '?')} epochs, lr {warm.get('lr', '?')}) "
            "before stage 1; row 0 is the warm-started model"
        )
    status = "finished" if RunDir(data.path).finished() else "in progress or interrupted"
    lines.append(f"- stages recorded: {data.completed} of {data.planned_stages} ({status})")
    lines.append("")
    lines += _stages_table(data)
    for measure, title in MEASURES.items():
        lines += [f"## {title} after each stage", ""]
        lines += _matrix_table(data, measure)
    lines += _metrics_section(data)
    lines += ["## Files", "", "`matrix.csv` (every measure), `heatmap.png` (avg@k), `success_by_stage.png`.", ""]
    return "\n".join(lines)


def _stages_table(data: RunData) -> list[str]:
    if not data.plan:
        return []
    lines = ["## Stages", "", "| stage | name | newly trained | samples from (share) | GRPO steps | wall time |",
             "|---|---|---|---|---|---|"]
    for stage in data.plan["stages"]:
        index = stage["index"]
        shares = ", ".join(f"{n} {w:.2f}" for n, w in stage["weights"].items())
        wall = "–"
        if index < len(data.rows) and data.rows[index].get("wall_seconds") is not None:
            wall = f"{data.rows[index]['wall_seconds'] / 60:.1f} min"
        trained = ", ".join(stage["experiences"])
        lines.append(f"| {index} | {stage['name']} | {trained} | {shares} | {stage['steps']} | {wall} |")
    return lines + [""]


def _matrix_table(data: RunData, measure: str) -> list[str]:
    R = data.matrix(measure)
    header = "| after stage | " + " | ".join(_column_name(n, s) for n, s in zip(data.test, data.trained_at)) + " |"
    lines = [header, "|---" * (len(data.test) + 1) + "|"]
    for i in range(R.shape[0]):
        cells = []
        for j, s in enumerate(data.trained_at):
            text = _fmt(R[i, j])
            cells.append(f"**{text}**" if s == i else text)
        lines.append(f"| {i} {_stage_name(data, i)} | " + " | ".join(cells) + " |")
    note = "Bold: the stage in which the experience is first trained." if measure == "avg_at_k" else ""
    return lines + ([""] + [note] if note else []) + [""]


def _metrics_section(data: RunData) -> list[str]:
    lines = ["## Continual-learning metrics (avg@k)", ""]
    view = data.metric_view()
    if view is None:
        return lines + ["No stage recorded yet.", ""]
    if data.completed < data.planned_stages:
        lines += [f"Partial run: over stages 0..{data.completed}, the experiences trained so far "
                  "and the held-out ones.", ""]
    summary = metrics.summarize(*view)
    lines += ["| metric | value | definition |", "|---|---|---|"]
    for key, (title, definition) in METRICS.items():
        lines.append(f"| {title} | {_fmt(summary[key])} | {definition} |")
    lines += ["", "R[s, j]: avg@k of experience j after stage s (row 0: before training); s_j: the stage where j is "
              "first trained; S: the last stage; '–': undefined (an empty set).", ""]
    R, trained_at = view
    names = [n for n, s in zip(data.test, data.trained_at) if s is None or s <= data.completed]
    lines += ["| experience | trained at | initial | final | BWT | forgetting | FWT | held-out gain |",
              "|---|---|---|---|---|---|---|---|"]
    for name, row in zip(names, metrics.per_experience(R, trained_at)):
        lines.append(
            f"| {name} | {row['trained_at'] or 'held out'} | {_fmt(row['initial'])} | {_fmt(row['final'])} | "
            f"{_fmt(row['backward_transfer'])} | {_fmt(row['forgetting'])} | {_fmt(row['forward_transfer'])} | "
            f"{_fmt(row['heldout_gain'])} |"
        )
    return lines + [""]


def _write_csv(data: RunData) -> Path:
    path = data.path / "matrix.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["measure", "stage", "stage_name", *data.test])
        for measure in MEASURES:
            R = data.matrix(measure)
            for i in range(R.shape[0]):
                values = ("" if math.isnan(v) else f"{v:.6g}" for v in R[i])
                writer.writerow([measure, i, _stage_name(data, i), *values])
    return path


def _figure(width: float, height: float):
    from matplotlib.figure import Figure  # no pyplot: no global state, renders with Agg

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.add_subplot()


def _write_heatmap(data: RunData) -> Path:
    from matplotlib.patches import Rectangle

    R = data.matrix("avg_at_k")
    rows, cols = R.shape
    fig, ax = _figure(max(4.0, 1.3 * cols + 2.5), max(2.5, 0.55 * rows + 1.8))
    image = ax.imshow(np.ma.masked_invalid(R), vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    for i in range(rows):
        for j in range(cols):
            value = R[i, j]
            ax.text(j, i, _fmt(value, 2), ha="center", va="center",
                    color="black" if not math.isnan(value) and value > 0.6 else "white", fontsize=9)
    for j, s in enumerate(data.trained_at):
        if s is not None and s < rows:
            ax.add_patch(Rectangle((j - 0.5, s - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
    ax.set_xticks(range(cols), [_column_name(n, s).replace(" (", "\n(") for n, s in zip(data.test, data.trained_at)],
                  fontsize=8)
    ax.set_yticks(range(rows), [f"{i} {_stage_name(data, i)}" for i in range(rows)], fontsize=8)
    ax.set_xlabel("test experience")
    ax.set_ylabel("after stage")
    ax.set_title(f"avg@k — {data.config.get('name', data.path.name)} (red: first trained)", fontsize=10)
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


def compare(run_dirs: list[Path | str]) -> str:
    """A markdown table over runs grouped by label: mean ± std over seeds.

    Columns: the number of runs (and seeds), each continual-learning metric on
    avg@k, and the final avg@k of every test experience. A group with
    unfinished runs says how many; metrics undefined in a run are left out of
    its group's mean ('–' when undefined in all).
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
        seeds = ", ".join(str(run.config.get("seed", "?")) for run in members)
        partial = sum(run.completed < run.planned_stages or run.completed == 0 for run in members)
        count = f"{label} (n={len(members)}{f', {partial} unfinished' if partial else ''})"
        summaries = [run.summary() for run in members]
        cells = [count, seeds] + [_mean_std([s[key] for s in summaries]) for key in METRICS]
        for name in experiences:
            finals = []
            for run in members:
                if name in run.test and run.rows:
                    finals.append(run.matrix()[-1, run.test.index(name)])
            cells.append(_mean_std(finals))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Metrics on avg@k; mean ± sample std over the runs of a group. " +
              "; ".join(f"{title}: {definition}" for title, definition in METRICS.values()) + "."]
    return "\n".join(lines) + "\n"


def _mean_std(values: list[float]) -> str:
    values = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}"
