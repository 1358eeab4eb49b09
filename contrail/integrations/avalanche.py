"""Avalanche: a contrail stream as an Avalanche scenario, and a run's results through Avalanche's loggers.

`as_scenario` turns a `contrail.stream.Stream` into Avalanche's generic
``CLScenario`` with a ``train_stream`` (one ``CLExperience`` per training
experience, or per stage of a plan) and a ``test_stream`` (every test
experience, held-out ones included), each experience carrying the contrail
`Experience`, its environment, difficulty and task ids as attributes.

`publish` reads a run directory (or a `contrail.runner.RunResult`) and sends
every recorded stage's evaluation to Avalanche loggers (``TextLogger``,
``InteractiveLogger``, ``TensorboardLogger``, ``WandBLogger``, or any
``BaseLogger``) as ``MetricValue``\\ s named the way Avalanche's own metrics
name theirs, at the x-position of the stage index (row 0, the untouched
model, at 0):

=================================================================  =====================================
name                                                               value after stage ``s``
=================================================================  =====================================
``Top1_Acc_Exp/eval_phase/test_stream/Task000/Exp00j``             ``R[s, j]`` (avg@k by default)
``Top1_Acc_Stream/eval_phase/test_stream/Task000``                 episode-weighted mean of ``R[s, :]``
``ExperienceForgetting/eval_phase/test_stream/Task000/Exp00j``     ``R[s_j, j] - R[s, j]``, for ``s_j < s``
``ExperienceBWT/eval_phase/test_stream/Task000/Exp00j``            ``R[s, j] - R[s_j, j]``, for ``s_j < s``
``StreamForgetting/eval_phase/test_stream``                        mean of ExperienceForgetting at ``s``
``StreamBWT/eval_phase/test_stream``                               mean of ExperienceBWT at ``s``
=================================================================  =====================================

``s_j`` is the stage that first trains experience ``j`` (``plan.json``'s
``trained_at``). These are Avalanche's definitions (``avalanche.evaluation.
metrics.forgetting_bwt``: forgetting is the accuracy right after training on
an experience minus the current one, BWT its negative), computed with
`contrail.metrics.per_experience` / `contrail.metrics.backward_transfer` on
the matrix up to stage ``s``. contrail's own ``forgetting`` (the drop from the
*best* score since ``s_j``, Chaudhry et al.) is reported by ``contrail
report``, not here. A value that is undefined (nothing trained before ``s``,
an experience missing from a row) is not published; Avalanche would log a 0
stream forgetting there, which reads as "no forgetting".

With ``task_labels=False`` (the default) every experience is Avalanche's task
0, as in a class-incremental benchmark: contrail's agent gets no task id, only
the environment's instruction. With ``task_labels=True`` each experience has
its own task label (its index in the test list; training-only experiences
after those) and the stream accuracy is split by task, as Avalanche's
``accuracy_metrics(stream=True)`` does with task-aware accuracy.

>>> from avalanche.logging import TensorboardLogger, TextLogger
>>> from contrail.integrations.avalanche import publish
>>> publish("runs/quickstart", [TextLogger(open("log.txt", "w")), TensorboardLogger("tb/quickstart")])
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from contrail import metrics
from contrail.results import result_matrix

if TYPE_CHECKING:
    from contrail.strategies import Stage
    from contrail.stream import Experience, Stream

__all__ = ["AvalancheMissingError", "ContrailResult", "StagePublisher", "as_scenario", "metric_values", "publish",
           "task_ids"]

INSTALL_HINT = "pip install 'contrail[avalanche]'"


class AvalancheMissingError(ImportError):
    """avalanche-lib is not installed here."""


def _avalanche(module: str):
    """Import ``module`` of avalanche-lib, or say in one line how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is not None and error.name.split(".")[0] == "avalanche":
            raise AvalancheMissingError(
                f"contrail.integrations.avalanche needs avalanche-lib: {INSTALL_HINT}"
            ) from None
        raise


# --- the scenario --------------------------------------------------------------------------


def task_ids(test: Sequence[str], train: Sequence[str] = ()) -> dict[str, int]:
    """Each experience's task id: its index in ``test``, then training-only experiences in order.

    The test experiences come first so that a test experience's task id equals
    its experience id in the test stream, in `as_scenario` and `publish` alike.
    """
    ids = {name: j for j, name in enumerate(test)}
    for name in train:
        ids.setdefault(name, len(ids))
    return ids


def as_scenario(stream: Stream, stages: Sequence[Stage] | None = None, *, task_labels: bool = False):
    """The stream as an Avalanche ``CLScenario`` with a ``train_stream`` and a ``test_stream``.

    ``train_stream``: one ``CLExperience`` per training experience of the
    stream (``stages=None``), or one per stage of a plan (``strategy.plan(...)``
    or ``plan.json``'s stages through `contrail.strategies.Stage.from_dict`).
    ``test_stream``: one per test experience, in the stream's (the matrix's)
    order, held-out ones included.

    Every experience carries ``experiences`` (the contrail `Experience`\\ s it
    trains newly, or the one it tests), ``task_ids`` (their `task_ids`),
    ``task_labels`` (Avalanche's list: the task ids, or ``[0]`` when
    ``task_labels`` is False) and, when it holds exactly one contrail
    experience, ``experience``, ``env``, ``difficulty``, ``task_id`` and
    ``task_label`` (``None`` otherwise). Train experiences also carry
    ``stage`` (the `Stage`, ``None`` without a plan), ``name``, ``steps`` and
    ``weights`` (the shares of tasks it samples, replayed experiences included);
    test experiences carry ``name``, ``trained_at`` (the 1-based stage that
    first trains it) and ``held_out``.
    """
    generic = _avalanche("avalanche.benchmarks.scenarios.generic_scenario")
    by_name = {e.name: e for e in stream.experiences}
    ids = task_ids([e.name for e in stream.test], [e.name for e in stream.train])
    if stages is None:
        units = [(None, e.name, (e,), e.steps) for e in stream.train]
    else:
        units = [(st, st.name, tuple(_lookup(by_name, n, st) for n in st.new), st.steps) for st in stages]
    train = []
    for stage, name, exps, steps in units:
        exp = _cl_experience(generic, exps, ids, task_labels)
        exp.stage, exp.name, exp.steps = stage, name, steps
        # The shares of tasks the stage samples, replayed experiences included.
        exp.weights = dict(stage.weights) if stage is not None else {name: 1.0}
        train.append(exp)
    trained_at = stream.trained_at([[e.name for e in u[2]] for u in units])
    test = []
    for experience, first in zip(stream.test, trained_at):
        exp = _cl_experience(generic, (experience,), ids, task_labels)
        exp.name, exp.trained_at, exp.held_out = experience.name, first, first is None
        test.append(exp)
    return generic.CLScenario([generic.EagerCLStream("train", train), generic.EagerCLStream("test", test)])


def _lookup(by_name: dict[str, Experience], name: str, stage: Stage) -> Experience:
    if name not in by_name:
        raise ValueError(f"stage {stage.index} ({stage.name}) trains {name!r}, which is not an experience of the "
                         f"stream; valid: {', '.join(by_name)}")
    return by_name[name]


def _cl_experience(generic, experiences: tuple[Experience, ...], ids: dict[str, int], task_labels: bool):
    """A ``CLExperience`` (its index and stream are set by the stream) carrying contrail's attributes."""
    exp = generic.CLExperience(current_experience=None, origin_stream=None)
    exp.experiences = experiences
    exp.task_ids = [ids[e.name] for e in experiences]
    exp.task_labels = list(exp.task_ids) if task_labels else [0]
    single = experiences[0] if len(experiences) == 1 else None
    exp.experience = single
    exp.env = single.env if single else None
    exp.difficulty = single.difficulty if single else None
    exp.task_id = exp.task_ids[0] if single else None
    exp.task_label = exp.task_labels[0] if len(exp.task_labels) == 1 else None
    return exp


# --- the metric values -------------------------------------------------------------------


@dataclass(frozen=True)
class ContrailResult:
    """The ``origin`` of the ``MetricValue``\\ s `publish` sends: contrail's results, by Avalanche metric name."""

    metric: str

    def __str__(self) -> str:
        return self.metric


def _name(metric: str, *, task: int | None = None, exp: int | None = None) -> str:
    # Avalanche's own template, so the names follow it exactly (e.g. Task000, Exp001).
    utils = _avalanche("avalanche.evaluation.metric_utils")
    info = {"metric_name": metric, "phase_name": "eval", "stream_name": "test", "task_label": task,
            "experience_id": exp}
    return utils.generic_get_metric_name(utils.default_metric_name_template, info)


def metric_values(test: Sequence[str], trained_at: Sequence[int | None], rows: Sequence[dict[str, Any]], *,
                  measure: str = "avg_at_k", task_labels: bool = False) -> list:
    """Every recorded stage's results as Avalanche ``MetricValue``\\ s (see the module docstring).

    ``test``/``trained_at`` are ``plan.json``'s (the matrix's columns and the
    stage that first trains each, ``None``: held out), ``rows`` the
    ``results.jsonl`` rows; ``measure`` is the `EvalResult` field published as
    accuracy. Stage ``s``'s values have ``x_plot = s``.
    """
    results = _avalanche("avalanche.evaluation.metric_results")
    R = result_matrix(list(rows), list(test), measure)
    episodes = _episodes(rows, test)
    labels = [j if task_labels else 0 for j in range(len(test))]
    values = []
    for s in range(R.shape[0]):
        for metric, name, value in _stage_values(R[: s + 1], episodes[s], list(trained_at), labels):
            if value is not None and math.isfinite(value):
                values.append(results.MetricValue(ContrailResult(metric), name, float(value), s))
    return values


def _episodes(rows: Sequence[dict[str, Any]], test: Sequence[str]) -> np.ndarray:
    """Episodes behind each cell (tasks * k); ``nan`` where a row does not say (then weighted 1)."""
    try:
        return result_matrix(list(rows), list(test), "tasks") * result_matrix(list(rows), list(test), "k")
    except ValueError:  # a row written by hand without tasks/k
        return np.full((len(rows), len(test)), np.nan)


def _stage_values(R: np.ndarray, episodes: np.ndarray, trained_at: list[int | None], labels: list[int]):
    """``(metric, name, value)`` after the last row of ``R``; ``None``/nan values are dropped by the caller."""
    s = R.shape[0] - 1
    now = R[s]
    for j, value in enumerate(now):
        yield "Top1_Acc_Exp", _name("Top1_Acc_Exp", task=labels[j], exp=j), value
    for label in sorted(set(labels)):
        columns = [j for j in range(len(now)) if labels[j] == label and np.isfinite(now[j])]
        yield "Top1_Acc_Stream", _name("Top1_Acc_Stream", task=label), _weighted(now, episodes, columns)
    if s == 0:
        return  # the untouched model: nothing trained, so no forgetting
    # An experience first trained after stage s is neither trained nor held out yet.
    seen = [t if t is not None and t <= s else None for t in trained_at]
    for j, terms in enumerate(metrics.per_experience(R, seen)):
        bwt = terms["backward_transfer"]
        yield "ExperienceForgetting", _name("ExperienceForgetting", task=labels[j], exp=j), -bwt
        yield "ExperienceBWT", _name("ExperienceBWT", task=labels[j], exp=j), bwt
    # Columns missing from a row (nan) leave the stream means, as Avalanche averages what it evaluated.
    keep = [j for j in range(R.shape[1]) if np.isfinite(R[:, j]).all()]
    if keep:
        stream_bwt = metrics.backward_transfer(R[:, keep], [seen[j] for j in keep])
        yield "StreamForgetting", _name("StreamForgetting"), -stream_bwt
        yield "StreamBWT", _name("StreamBWT"), stream_bwt


def _weighted(values: np.ndarray, weights: np.ndarray, columns: list[int]) -> float:
    # Avalanche's stream accuracy averages over every pattern; here every episode (tasks * k).
    if not columns:
        return math.nan
    w = np.array([weights[j] if np.isfinite(weights[j]) and weights[j] > 0 else 1.0 for j in columns])
    return float(np.dot(values[columns], w) / w.sum())


# --- publishing --------------------------------------------------------------------------


def publish(run: str | os.PathLike | Any, loggers: Iterable[Any], *, measure: str = "avg_at_k",
            task_labels: bool = False, from_stage: int = 0) -> list:
    """Send every recorded stage of ``run`` to Avalanche ``loggers``; return the ``MetricValue``\\ s sent.

    ``run`` is a run directory (``plan.json`` + ``results.jsonl``) or a
    `contrail.runner.RunResult`. Each stage's values go to every logger
    through ``logger.log_metrics`` (Avalanche's public entry, which calls
    ``log_single_metric(name, value, x_plot)``); a ``TextLogger`` (and so an
    ``InteractiveLogger``) then prints them under a stage header, as it does
    after an Avalanche evaluation, and a TensorBoard writer is flushed.
    Stages before ``from_stage`` are left out (already published: see
    `StagePublisher`).
    """
    test, trained_at, rows = _run_data(run)
    values = [v for v in metric_values(test, trained_at, rows, measure=measure, task_labels=task_labels)
              if v.x_plot >= from_stage]
    text_logger = _avalanche("avalanche.logging").TextLogger
    loggers = list(loggers)
    for s, row in enumerate(rows):
        if s < from_stage:
            continue
        stage_values = [v for v in values if v.x_plot == s]
        for logger in loggers:
            if isinstance(logger, text_logger):
                print(f"-- >> contrail stage {s} ({row.get('name', '')}): eval phase << --", file=logger.file)
            logger.log_metrics(stage_values)
            if isinstance(logger, text_logger):
                # What TextLogger.after_eval does: print this evaluation's values, then forget them.
                logger.print_current_metrics()
                logger.metric_vals = {}
    for logger in loggers:
        writer = getattr(logger, "writer", None)
        if writer is not None and hasattr(writer, "flush"):
            writer.flush()
        if isinstance(logger, text_logger) and hasattr(logger.file, "flush"):
            logger.file.flush()
    return values


class StagePublisher:
    """`publish` each stage once: every call sends the stages recorded since the previous call.

    Call it after each stage's row is written (from a loop that watches a
    running run's directory, or once after `contrail.runner.run`); the
    loggers see every stage exactly once, in order.

    >>> publisher = StagePublisher([TensorboardLogger("tb/run")])
    >>> publisher("runs/quickstart")     # stages 0..s so far; the next call sends s+1.. only
    """

    def __init__(self, loggers: Iterable[Any], *, measure: str = "avg_at_k", task_labels: bool = False) -> None:
        self.loggers = list(loggers)
        self.measure, self.task_labels = measure, task_labels
        self.published = 0  # rows already sent

    def __call__(self, run: str | os.PathLike | Any) -> list:
        """Publish the rows of ``run`` not sent yet; return their ``MetricValue``\\ s."""
        # One read of the run: a row written meanwhile is sent by the next call, not skipped.
        test, trained_at, rows = _run_data(run)
        snapshot = SimpleNamespace(test=test, trained_at=trained_at, rows=rows)
        values = publish(snapshot, self.loggers, measure=self.measure, task_labels=self.task_labels,
                         from_stage=self.published)
        self.published = len(rows)
        return values


def _run_data(run: Any) -> tuple[list[str], list[int | None], list[dict[str, Any]]]:
    """``(test, trained_at, rows)`` of a run directory or of a `RunResult`."""
    if all(hasattr(run, key) for key in ("test", "trained_at", "rows")):
        return list(run.test), list(run.trained_at), list(run.rows)
    from contrail.report import load_run

    path = Path(run)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such run directory")
    data = load_run(path)
    return data.test, data.trained_at, data.rows
