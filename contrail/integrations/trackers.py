"""Experiment trackers (TensorBoard, W&B, trackio, MLflow) chosen from YAML, through Accelerate.

An experiment's ``tracking`` section names the trackers::

    tracking:
      log_with: [tensorboard, wandb]
      project: my-continual-runs

`Tracking` builds Accelerate's own tracker classes
(``accelerate.tracking.TensorBoardTracker``, ``WandBTracker``, ...) and
attaches them to the GRPO trainer's ``Accelerator``, so every training step's
statistics reach them through ``accelerator.log``; `Tracking.log_rows` then
logs each stage's evaluation after its row is written: one scalar per
experience (``matrix/<experience>/avg@k``, the step is the stage) and the
whole stage x experience matrix so far as a table (a W&B ``Table``, an MLflow
table artifact, or a markdown table as TensorBoard and trackio text). A
tracker whose package is not installed is a `TrackerUnavailableError` when the
experiment is loaded, before anything runs.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}


class TrackerUnavailableError(ValueError):
    """A tracker the experiment names whose package is not installed here."""


@dataclass
class TrackingSpec:
    """Which trackers a run logs to (``[]``: none beyond the run directory's own files)."""

    log_with: list[str] = field(default_factory=list)
    project: str = "contrail"

    def __post_init__(self) -> None:
        for name in self.log_with:
            if name not in TRACKERS:
                raise ValueError(f"log_with: unknown tracker {name!r}; valid: {', '.join(TRACKERS)}")
            if importlib.util.find_spec(TRACKERS[name]) is None:
                raise TrackerUnavailableError(
                    f"log_with: {name} is not installed here; pip install {TRACKERS[name]} (or remove it)"
                )
        if len(set(self.log_with)) != len(self.log_with):
            raise ValueError(f"log_with: each tracker once, got {self.log_with}")
        if not self.project:
            raise ValueError("project must be a non-empty name")


class Tracking:
    """The trackers of one run, on its ``Accelerator``; `log_rows` feeds them each stage's row.

    A tracker kind the accelerator already has (the trainer's own TensorBoard
    writer) is reused, not doubled; the others are opened, given the
    experiment's config, and added to ``accelerator.trackers``, so
    ``accelerator.log`` reaches them and ``end_training`` finishes them.
    """

    def __init__(self, spec: TrackingSpec, accelerator: Any, run_dir: str | Path, run_name: str,
                 config: dict[str, Any]) -> None:
        self.spec, self.run_dir, self.run_name = spec, Path(run_dir), run_name
        present = {getattr(t, "name", None): t for t in accelerator.trackers}
        self.trackers = []
        for name in spec.log_with:
            tracker = present.get(name)
            if tracker is None:
                tracker = _open(name, spec, self.run_dir, run_name)
                tracker.store_init_configuration(_flat(config))
                accelerator.trackers.append(tracker)
            self.trackers.append(tracker)
        self.logged = 0  # rows of results.jsonl already logged by this process

    def log_rows(self) -> int:
        """Log the rows of ``results.jsonl`` not logged yet; returns how many."""
        rows = read_rows(self.run_dir / "results.jsonl")
        new = rows[self.logged:]
        for index, row in enumerate(new, start=self.logged):
            columns, data = matrix_table(rows[: index + 1])
            for tracker in self.trackers:
                tracker.log(row_scalars(row), step=row["stage"])
                _log_table(tracker, columns, data, row["stage"])
        self.logged = len(rows)
        return len(new)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of ``results.jsonl`` (a torn last line is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def row_scalars(row: dict[str, Any]) -> dict[str, float]:
    """``matrix/<experience>/<metric>`` scalars of one row (avg@k, pass@k where recorded)."""
    scalars = {}
    for experience, result in row["results"].items():
        for metric in ("avg_at_k", "pass_at_k"):
            if isinstance(result.get(metric), (int, float)):
                scalars[f"matrix/{experience}/{metric.replace('_at_', '@')}"] = float(result[metric])
    return scalars


def matrix_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """The stage x experience avg@k matrix of ``rows`` as (columns, data)."""
    experiences = list(dict.fromkeys(name for row in rows for name in row["results"]))
    columns = ["stage", "name", *experiences]
    data = [
        [row["stage"], row["name"], *(_cell(row["results"].get(name)) for name in experiences)]
        for row in rows
    ]
    return columns, data


def markdown_table(columns: list[str], data: list[list[Any]]) -> str:
    """A markdown table (TensorBoard renders text summaries as markdown)."""
    def text(value: Any) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(text(v) for v in row) + " |" for row in data]
    return "\n".join(lines)


def _cell(result: dict[str, Any] | None) -> float | None:
    return None if result is None else result.get("avg_at_k")


def _open(name: str, spec: TrackingSpec, run_dir: Path, run_name: str) -> Any:
    from accelerate import tracking

    if name == "tensorboard":
        return tracking.TensorBoardTracker(run_name, run_dir / "tensorboard")
    if name == "wandb":
        return tracking.WandBTracker(spec.project, name=run_name, dir=str(run_dir))
    if name == "trackio":
        return tracking.TrackioTracker(spec.project, name=run_name)
    return tracking.MLflowTracker(experiment_name=spec.project, logging_dir=str(run_dir / "mlruns"), run_name=run_name)


def _log_table(tracker: Any, columns: list[str], data: list[list[Any]], step: int) -> None:
    if tracker.name == "wandb":
        tracker.log_table("matrix", columns=columns, data=data, step=step)
    elif tracker.name == "mlflow":
        import mlflow

        table = {column: [row[i] for row in data] for i, column in enumerate(columns)}
        mlflow.log_table(data=table, artifact_file=f"matrix/stage-{step:02d}.json")
    else:  # TensorBoard and trackio take text: a markdown table
        tracker.log({"matrix": markdown_table(columns, data)}, step=step)


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config as flat ``a.b`` keys with scalar values (what every tracker accepts)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flat(value, f"{name}."))
        else:
            flat[name] = value if isinstance(value, (int, float, str, bool)) else json.dumps(value)
    return flat
