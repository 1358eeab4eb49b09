"""A run directory: resolved config, one results row per stage, checkpoints, trajectories.

Layout of ``runs/<name>/``::

    config.yaml            the experiment (``Experiment.to_yaml()``, written by `RunDir.start`)
    plan.json              the stages and test experiences (written by the runner)
    results.jsonl          row 0 = the untouched model, row s = after stage s
    checkpoints/stage-03/  the model after stage 3 (and the trainer state, for the last recorded stage)
    checkpoints/in-progress/  the run within the stage it is training (`Experiment.checkpoint_minutes`)
    trajectories/stage-03.jsonl   the evaluation episodes after stage 3
    FINISHED               present once every stage is recorded
    report.md  matrix.csv  heatmap.png  success_by_stage.png

Nothing is lost: each row is written by replacing ``results.jsonl`` with a
complete new file (temp file, fsync, ``os.replace``), so a crash leaves the
old file or the new one, never half a line. A finished run is never
overwritten without ``force``; an unfinished one is continued with ``resume``
(only if its config matches) or restarted with ``force``.

>>> run = RunDir("runs/quickstart")
>>> run.start(experiment.to_yaml(), resume=True)
>>> run.completed_stages()        # -1: nothing yet, 0: row 0 only, s: stage s recorded
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import yaml

__all__ = ["RESULT_NEUTRAL_KEYS", "RunDir", "RunExistsError", "config_differences", "recorded_measures",
           "result_matrix"]

CONFIG = "config.yaml"
RESULTS = "results.jsonl"
FINISHED = "FINISHED"

# Dotted config keys that do not change what a run computes: a run may be
# resumed with different values for them (a new output path, another device,
# a different evaluation batch or micro-batch packing, fan-out bookkeeping).
RESULT_NEUTRAL_KEYS = frozenset(
    {
        "out",
        "label",
        "seeds",
        "orders",
        "model.device",
        "eval.batch_episodes",
        "grpo.micro_batch_tokens",
        "grpo.gradient_checkpointing",
        "checkpoint_minutes",
    }
)


class RunExistsError(Exception):
    """The run directory already holds a run that this call may not overwrite or continue."""


class RunDir:
    """One run's directory (see the module docstring for the layout)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    # --- lifecycle --------------------------------------------------------------
    def start(self, config: str | dict[str, Any], resume: bool = False, force: bool = False) -> None:
        """Prepare the directory for a run of ``config`` (YAML text, written as it is, or a mapping).

        - new or empty directory: create it and write ``config.yaml``;
        - with ``force``: wipe a run (finished or not) and start over;
        - with ``resume``: continue the run, finished or not, if the saved config
          equals ``config`` outside `RESULT_NEUTRAL_KEYS` (else `RunExistsError`
          listing the keys that differ);
        - otherwise a run there is a `RunExistsError` saying what to do.

        A non-empty directory that is not a run is never wiped.
        """
        text = config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False)
        if self.path.exists() and not self.path.is_dir():
            raise RunExistsError(f"{self.path} exists and is not a directory")
        if self._is_run():
            if force:
                shutil.rmtree(self.path)
            elif resume:
                self._check_resumable(yaml.safe_load(text) or {})
                return
            elif self.finished():
                raise RunExistsError(
                    f"{self.path} holds a finished run ({self.completed_stages()} stages); "
                    "use --force to delete it and start over, or choose another output directory"
                )
            else:
                raise RunExistsError(
                    f"{self.path} holds an unfinished run ({max(self.completed_stages(), 0)} stages recorded); "
                    "use --resume to continue it or --force to delete it and start over"
                )
        elif self.path.exists() and any(self.path.iterdir()):
            raise RunExistsError(
                f"{self.path} is not empty and holds no contrail run (no {CONFIG}); refusing to use it"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.path / CONFIG, text)

    def _is_run(self) -> bool:
        return (self.path / CONFIG).is_file()

    def _check_resumable(self, config: dict[str, Any]) -> None:
        saved = self.config()
        differ = [key for key in config_differences(saved, config) if key not in RESULT_NEUTRAL_KEYS]
        if differ:
            details = "; ".join(f"{k}: saved {_lookup(saved, k)!r}, now {_lookup(config, k)!r}" for k in differ)
            raise RunExistsError(
                f"cannot resume {self.path}: it holds a different experiment; the config differs in "
                f"{', '.join(differ)} ({details}); restore those values, or use --force to start over"
            )

    def config(self) -> dict[str, Any]:
        """The saved resolved config."""
        with open(self.path / CONFIG, encoding="utf-8") as f:
            return yaml.safe_load(f) or {}

    def mark_finished(self) -> None:
        """Record that every stage is done (a later `start` refuses to overwrite without force)."""
        _atomic_write(self.path / FINISHED, f"{self.completed_stages()} stages\n")

    def finished(self) -> bool:
        return (self.path / FINISHED).is_file()

    # --- results ----------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        """The parsed rows of ``results.jsonl``, in stage order (``[]`` when none)."""
        path = self.path / RESULTS
        return read_jsonl(path, "row") if path.is_file() else []

    def append_row(self, row: dict[str, Any]) -> None:
        """Append ``row`` atomically; its ``stage`` must be the next one (0 first)."""
        rows = self.rows()
        if row.get("stage") != len(rows):
            raise ValueError(f"the next row must have stage {len(rows)}, got {row.get('stage')!r}")
        lines = "".join(json.dumps(r) + "\n" for r in rows + [row])
        _atomic_write(self.path / RESULTS, lines)

    def completed_stages(self) -> int:
        """Stages recorded: rows minus one (row 0 is the untouched model); -1 when no row."""
        return len(self.rows()) - 1

    # --- artefacts ----------------------------------------------------------------
    def checkpoint_dir(self, stage: int) -> Path:
        """Where the model after ``stage`` is saved (the caller creates it)."""
        return self.path / "checkpoints" / f"stage-{stage:02d}"

    def progress_dir(self) -> Path:
        """Where a checkpoint taken within a stage, after some of its steps, is saved (one at a time)."""
        return self.path / "checkpoints" / "in-progress"

    def trajectories_path(self, stage: int) -> Path:
        """The evaluation episodes after ``stage`` (the parent directory is created)."""
        path = self.path / "trajectories" / f"stage-{stage:02d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def latest_checkpoint(self) -> Path | None:
        """The checkpoint of the last *recorded* stage that has one (``None`` when none).

        A checkpoint of a stage whose row was never written (a crash between
        saving and recording) is ignored: resuming repeats that stage.
        """
        for stage in range(self.completed_stages(), 0, -1):
            path = self.checkpoint_dir(stage)
            if path.is_dir() and any(path.iterdir()):
                return path
        return None


def result_matrix(rows: list[dict[str, Any]], test_names: list[str], measure: str = "avg_at_k") -> np.ndarray:
    """The ``(S+1, N)`` matrix of ``measure`` (an `EvalResult` field) from results rows.

    Row ``s`` is stage ``s``; column ``j`` is ``test_names[j]``; an experience
    missing from a row is ``nan``, and so is a measure the row's results do
    not hold while another row's do (one added since that row was written).
    """
    known = recorded_measures(rows)
    if known and measure not in known:
        raise ValueError(f"unknown measure {measure!r}; valid: {', '.join(sorted(known))}")
    R = np.full((len(rows), len(test_names)), np.nan)
    for i, row in enumerate(rows):
        results = row.get("results", {})
        for j, name in enumerate(test_names):
            value = results.get(name, {}).get(measure)
            R[i, j] = math.nan if value is None else float(value)
    return R


def recorded_measures(rows: list[dict[str, Any]]) -> set[str]:
    """The measures any experience's results hold in any of ``rows`` (a run's older rows may lack newer ones)."""
    return {key for row in rows for cell in row.get("results", {}).values() for key in cell}


def config_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two nested configs (sorted)."""
    flat_a, flat_b = dict(_flatten(a)), dict(_flatten(b))
    missing = object()
    return sorted(k for k in set(flat_a) | set(flat_b) if flat_a.get(k, missing) != flat_b.get(k, missing))


def _flatten(config: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    if isinstance(config, dict) and config:
        for key, value in config.items():
            yield from _flatten(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, config


def _lookup(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return "(absent)"
        node = node[part]
    return node


def read_jsonl(path: str | os.PathLike, what: str = "record") -> list[Any]:
    """Every JSON line of ``path`` in order (blank lines skipped); a bad line names the file, line and ``what``."""
    path = Path(path)
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number}: not a JSON {what} ({error})") from None
    return records


def truncate_log(path: Path, keep: Callable[[dict[str, Any]], bool]) -> None:
    """Rewrite the JSONL log ``path`` (atomically) with only the entries ``keep`` accepts.

    A resumed run logs its interrupted steps again, so its log is first cut back
    to what its checkpoint covers; a half-written last line (a kill during the
    write) is dropped too. A missing file is left missing.
    """
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and keep(entry):
            kept.append(line + "\n")
    _atomic_write(path, "".join(kept))


def _atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so readers see the old or the new file, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
