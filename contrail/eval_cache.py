"""The start model's evaluation, kept beside its cached warm-start.

Row 0 of a run is the warm-started model on the stream's test tasks. That
model is cached (`contrail.train.sft.warmstart`), and its evaluation is as
deterministic as the model: the same weights, tasks, rollout settings,
sampling seed and precision give the same episodes. So a rerun with a warm
cache reads row 0 back instead of playing it again (on the 2-core
quickstart, one of three evaluations, about a minute and a half).

The entry lives in ``<warm-start>/evaluations/<key>/`` (``results.json`` and
``trajectories.jsonl``, plain JSON: nothing loaded runs code) and goes when
the warm-start goes. Its key covers every input of the evaluation; like the
warm-start's key it includes contrail's version, not the code itself, so
clear ``$CONTRAIL_CACHE`` after changing an environment's code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from contrail import __version__
from contrail.evaluation import EvalResult

RESULTS = "results.json"
TRAJECTORIES = "trajectories.jsonl"


def evaluation_key(**inputs: Any) -> str:
    """A short hash of everything that decides an evaluation's episodes (JSON-serialisable values)."""
    identity = {**inputs, "version": __version__}
    text = json.dumps(identity, sort_keys=True, default=_plain)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def entry_dir(start_model: str | Path, key: str) -> Path:
    """Where the evaluation ``key`` of the warm-started model in ``start_model`` is kept."""
    return Path(start_model).parent / "evaluations" / key


def load(directory: Path, trajectories_path: Path) -> dict[str, EvalResult] | None:
    """The cached results, their episodes copied to ``trajectories_path``; None when nothing is cached."""
    results, trajectories = directory / RESULTS, directory / TRAJECTORIES
    if not (results.is_file() and trajectories.is_file()):
        return None
    shutil.copyfile(trajectories, trajectories_path)
    return {name: EvalResult(**fields) for name, fields in json.loads(results.read_text()).items()}


def store(directory: Path, results: dict[str, EvalResult], trajectories_path: Path) -> None:
    """Keep ``results`` and the episodes in ``trajectories_path``, whole or not at all."""
    staging = directory.with_name(directory.name + f".partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shutil.copyfile(trajectories_path, staging / TRAJECTORIES)
    (staging / RESULTS).write_text(json.dumps({name: r.to_dict() for name, r in results.items()}, indent=2))
    shutil.rmtree(directory, ignore_errors=True)
    staging.replace(directory)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return repr(value)
