"""The experiment loop: plan → evaluate the start model → (train stage → evaluate → record) per stage.

One `Experiment` value drives everything. The runner warm-starts the model
if asked (cached), loads the start model once, measures its base success if
the strategy orders stages by it, plans the stages once and writes them to
``plan.json``; then per stage it calls the strategy's ``before_stage`` hook,
trains, calls ``after_stage``, saves a checkpoint, evaluates every test
experience and appends the stage's row (atomically). Every seed is derived
from ``experiment.seed`` by name (`contrail.seeds.derive_seed`).

Resuming works after a kill at any moment and reproduces the uninterrupted
run exactly: the stages are replayed from ``plan.json`` (the strategy must
plan them again, identically); training continues from the checkpoint of the
last *recorded* stage, whose optimizer state (and the strategy's own state,
if it has one) is kept until the next row is written, and then from the
checkpoint taken within the next stage, if there is one
(``checkpoint_minutes``); checkpoints (`contrail.checkpoints`) are
written to a staging directory and renamed into place; evaluation leaves
the global random state alone, so a checkpoint saved before it resumes the
same streams; ``grpo_log.jsonl`` is cut back to the checkpoint's step; a KL
reference stays the start model; and a finished run gets its report rebuilt.

With ``eval.drift`` (the default) every stage's row also carries
``"drift"`` (`contrail.drift`): the KL from the start model on the samples it
drew for row 0 (kept, with its own log-probs, in ``drift-start.json``), and
the share of trainable parameters changed since the previous stage (a CPU
copy of them is kept between stages; a resumed run takes it from the loaded
checkpoint, which holds exactly those weights).

>>> experiment = load_experiment("experiments/quickstart.yaml")
>>> result = run(experiment)                       # into experiment.out
>>> result.matrix(), result.metrics
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import yaml
from accelerate import PartialState

from contrail import checkpoints, drift, eval_cache
from contrail.evaluation import EvalResult, Evaluator, select_tasks
from contrail.integrations.trackers import Tracking
from contrail.metrics import summarize
from contrail.models import load_model
from contrail.precision import describe_precision
from contrail.progress import console
from contrail.results import RunDir, RunExistsError, result_matrix, truncate_log
from contrail.seeds import derive_seed
from contrail.strategies import Stage, stage_sampler
from contrail.stream import Stream, env_factory
from contrail.train.sft import warmstart
from contrail.train.trainer import process_state

if TYPE_CHECKING:
    from contrail.experiment import Experiment
    from contrail.grpo.trainer import GRPOTrainer
    from contrail.strategies import Strategy

__all__ = ["BASE_SUCCESS_TASKS", "RunResult", "measure_base_success", "run"]

PLAN = "plan.json"
DRIFT_SAMPLES = "drift-start.json"
GRPO_LOG = "grpo_log.jsonl"
BASE_SUCCESS_TASKS = 16   # training tasks per experience the base success is measured on
BASE_SUCCESS_K = 2        # samples per task for the base success


@dataclass
class RunResult:
    """What a finished (or resumed-to-the-end) run measured.

    ``test`` names the test experiences (the matrix's columns) and
    ``trained_at[j]`` is the 1-based stage that first trains ``test[j]``
    (``None``: held out); ``rows`` are the parsed ``results.jsonl`` rows.
    """

    path: Path
    test: list[str]
    trained_at: list[int | None]
    rows: list[dict[str, Any]]

    def matrix(self, measure: str = "avg_at_k") -> np.ndarray:
        """The stage × experience matrix R of ``measure`` (row 0: the start model)."""
        return result_matrix(self.rows, self.test, measure)

    @property
    def metrics(self) -> dict[str, float]:
        """The continual-learning metrics of the avg@k matrix (``nan`` where undefined)."""
        return summarize(self.matrix(), self.trained_at)


def run(experiment: Experiment, out: str | Path | None = None, *, resume: bool = False, force: bool = False,
        show_progress: bool = True) -> RunResult:
    """Run ``experiment`` stage by stage, evaluating every test experience after each; return the result.

    Args:
        experiment: the whole run (stream, strategy, model and warm-start, rollout,
            GRPO, evaluation, root seed). Saved as ``config.yaml`` (``experiment.to_yaml()``).
        out: the run directory; ``None`` uses ``experiment.out``.
        resume: continue an unfinished run in ``out`` (its ``config.yaml`` must
            describe the same experiment, up to result-neutral keys such as the
            device; the error lists the keys that differ). A finished run is
            returned as it is (its report is rebuilt: a kill may have left none).
        force: delete the run in ``out`` (finished or not) and start over.
        show_progress: show progress bars (rows are printed either way).

    Raises:
        RunExistsError: ``out`` holds a run that ``resume``/``force`` do not allow
            to continue or overwrite, or a directory that is not a run.
    """
    started = time.perf_counter()  # row 0's wall time counts the setup: model, warm-start, loading
    usage = _usage()
    experiment.check()  # environments, strategy, device: fail before anything is written
    run_dir = RunDir(out if out is not None else experiment.out)
    processes = process_state()  # under `accelerate launch` every process trains; the main one writes
    if processes.is_main_process:
        run_dir.start(experiment.to_yaml(), resume=resume, force=force)
    processes.wait_for_everyone()
    if run_dir.finished():
        return _finish(run_dir, processes)

    stream = _build_stream(experiment)
    strategy = _build_strategy(experiment)
    done = run_dir.completed_stages()  # -1: nothing yet; 0: row 0 only; s: stage s recorded
    saved_plan = _read_plan(run_dir)  # None unless resuming a run that got past planning
    if saved_plan is not None and done >= len(saved_plan["stages"]):
        return _finish(run_dir, processes)  # killed after the last row, before FINISHED

    start_model = _start_model(experiment, show_progress)
    model, tokenizer = _load(experiment, run_dir, done, start_model)
    if saved_plan is None and processes.is_main_process:  # one process measures; every process reads plan.json
        _write_json(run_dir.path / PLAN,
                    _make_plan(experiment, stream, strategy, model, tokenizer, start_model, show_progress))
    processes.wait_for_everyone()
    stages = _replay_plan(run_dir, experiment, stream, strategy)

    trainer = _make_trainer(experiment, stream, model, tokenizer, run_dir, show_progress)
    if processes.is_main_process:
        device = trainer.accelerator.device
        console.print(f"GRPO and evaluation in {describe_precision(experiment.grpo.precision, device)}")
    tracking = Tracking(experiment.tracking, trainer.accelerator, run_dir.path, experiment.name,
                        yaml.safe_load(experiment.to_yaml()))
    within = (checkpoints.resume(run_dir, done, stages, trainer, strategy, experiment, start_model)
              if done >= 0 else None)
    if processes.is_main_process:
        # The steps the checkpoints hold (the one within the next stage, if any); the rest are logged again.
        steps = within["grpo_step"] if within else trainer.step_count
        truncate_log(run_dir.path / GRPO_LOG,
                     lambda entry: isinstance(entry.get("step"), int) and entry["step"] <= steps)
        checkpoints.drop_stale(run_dir, done)
    evaluator = _make_evaluator(experiment, stream, show_progress)
    # One unshard (FSDP) and merge (LoRA) for both: drift's baseline takes the whole weights, as its
    # later measures see them, and the main process evaluates row 0 alone, with no collectives.
    with trainer.full_weights():
        tracker = _drift_tracker(run_dir, trainer) if experiment.eval.drift and processes.is_main_process else None
        if done < 0 and processes.is_main_process:
            row0 = "warm-start" if experiment.model.warmstart is not None else "untouched"
            evaluating = time.perf_counter()
            results = _evaluate_start(evaluator, trainer, run_dir, experiment, stream, start_model, tracker)
            now = time.perf_counter()
            _record(run_dir, 0, row0, [], results, {}, now - started, eval_seconds=now - evaluating,
                    since=usage)
    processes.wait_for_everyone()
    if processes.is_main_process:
        tracking.log_rows()  # row 0, or a resumed run's rows
    for stage in stages[max(done, 0):]:
        _run_stage(stage, len(stages), strategy, trainer, stream, evaluator, run_dir, experiment, processes,
                   tracker)
        if processes.is_main_process:
            tracking.log_rows()
    result = _finish(run_dir, processes)
    trainer.end()  # last: it ends the process group _finish still synchronises on
    return result


# --- setup -------------------------------------------------------------------------------------


def _build_stream(experiment: Experiment) -> Stream:
    from contrail.experiment import build_stream

    return build_stream(experiment)


def _build_strategy(experiment: Experiment) -> Strategy:
    from contrail.experiment import build_strategy

    return build_strategy(experiment)


def _start_model(experiment: Experiment, show_progress: bool) -> str:
    """The model row 0 evaluates: the configured one, or its (cached) warm-start."""
    spec = experiment.model
    if spec.warmstart is None:
        return spec.name
    path = warmstart(spec.name, spec.warmstart, seed=derive_seed(experiment.seed, "warmstart"),
                     dtype=spec.dtype, show_progress=show_progress)
    return str(path)


def _load(experiment: Experiment, run_dir: RunDir, done: int, start_model: str):
    """Load the one model of the run: the start model, or the last recorded stage's checkpoint."""
    source = str(run_dir.checkpoint_dir(done) / "model") if done >= 1 else start_model
    device = experiment.model.device
    # "auto": the trainer's accelerator places the model (one device per process).
    return load_model(source, dtype=experiment.model.dtype, device=None if device == "auto" else device)


def _make_plan(experiment: Experiment, stream: Stream, strategy: Strategy, model, tokenizer, start_model: str,
               show_progress: bool) -> dict[str, Any]:
    """``plan.json``: everything the report needs besides the rows and trajectories."""
    base_success = None
    if strategy.needs_base_success:
        base_success = measure_base_success(model, tokenizer, stream, experiment, show_progress=show_progress)
    stages = _plan_stages(strategy, stream, experiment, base_success)
    warm = experiment.model.warmstart
    return {
        "test": [e.name for e in stream.test],
        "trained_at": stream.trained_at([stage.new for stage in stages]),
        "stages": [stage.to_dict() for stage in stages],
        "start_model": start_model,
        "warmstart": None if warm is None else {"base_model": experiment.model.name, **dataclasses.asdict(warm)},
        "base_success": base_success,
        "turn_limits": turn_limits(experiment, stream),
        "label": _label(experiment),
        "seed": experiment.seed,
    }


def turn_limits(experiment: Experiment, stream: Stream) -> dict[str, int]:
    """Per test experience, the turn limit its evaluation episodes run under (for ``out_of_turns``).

    The evaluation's ``max_turns`` when set, else the environment's own
    ``turn_limit`` of the experience's test tasks (its ``max_turns`` option or
    default; SearchQA's differs by split). An experience whose tasks have
    different limits is left out (the diagnostics then use their defaults).
    Building an environment starts no engine, so this is cheap.
    """
    forced = experiment.eval_rollout.max_turns
    make_env = env_factory(stream.experiences)
    limits: dict[str, int] = {}
    for experience in stream.test:
        if forced is not None:
            limits[experience.name] = forced
            continue
        if not experience.test_tasks:
            continue
        env = make_env(experience.test_tasks[0])
        try:
            found = {env.turn_limit(task) for task in experience.test_tasks}
        finally:
            env.close()
        if len(found) == 1:
            limits[experience.name] = found.pop()
    return limits


def _plan_stages(strategy: Strategy, stream: Stream, experiment: Experiment,
                 base_success: dict[str, float] | None) -> list[Stage]:
    # Strategies that keep what plan() saw (EWC: the stages' tasks) get their plan() call in every process.
    return strategy.plan(stream, seed=experiment.seed, base_success=base_success)


def _replay_plan(run_dir: RunDir, experiment: Experiment, stream: Stream, strategy: Strategy) -> list[Stage]:
    """The stages of ``plan.json``, which the strategy (given the recorded base success) must plan again.

    Training follows the recorded plan, also after a resume; a strategy that
    now plans differently (changed code) would silently train another run,
    so that is refused.
    """
    plan = _read_plan(run_dir)
    recorded = [Stage.from_dict(d) for d in plan["stages"]]
    stages = _plan_stages(strategy, stream, experiment, plan.get("base_success"))
    if stages != recorded:
        raise RunExistsError(
            f"cannot continue {run_dir.path}: strategy {experiment.strategy.name!r} now plans other stages "
            f"than {run_dir.path / PLAN} records; use --force to start over"
        )
    return recorded


def _label(experiment: Experiment) -> str:
    from contrail.experiment import run_label

    return experiment.label or run_label(experiment)


def measure_base_success(model, tokenizer, stream: Stream, experiment: Experiment, *,
                         show_progress: bool = False) -> dict[str, float]:
    """The start model's avg@k on a seeded sample of each training experience's train tasks.

    ``BASE_SUCCESS_TASKS`` tasks per experience, ``BASE_SUCCESS_K`` samples
    each, with the evaluation's rollout settings; the task sample and the
    sampling both come from ``derive_seed(experiment.seed, "base-success")``.
    """
    seed = derive_seed(experiment.seed, "base-success")
    tasks = {e.name: select_tasks(e.train_tasks, BASE_SUCCESS_TASKS, seed) for e in stream.train}
    evaluator = Evaluator(tasks, env_factory(stream.train), experiment.eval_rollout, k=BASE_SUCCESS_K,
                          batch_episodes=experiment.eval.batch_episodes, seed=seed, show_progress=show_progress)
    results = evaluator(model, tokenizer, description="measuring base success for the curriculum")
    return {name: r.avg_at_k for name, r in results.items()}


def _make_trainer(experiment: Experiment, stream: Stream, model, tokenizer, run_dir: RunDir,
                  show_progress: bool) -> GRPOTrainer:
    from contrail.grpo.trainer import GRPOTrainer

    return GRPOTrainer(model, tokenizer, experiment.grpo, experiment.rollout, env_factory(stream.experiences),
                       seed=experiment.seed, log_dir=run_dir.path, show_progress=show_progress)


def _make_evaluator(experiment: Experiment, stream: Stream, show_progress: bool) -> Evaluator:
    # One seed for every row: differences between rows come from the model, not the sampling.
    return Evaluator({e.name: e.test_tasks for e in stream.test}, env_factory(stream.experiences),
                     experiment.eval_rollout, k=experiment.eval.k, batch_episodes=experiment.eval.batch_episodes,
                     seed=derive_seed(experiment.seed, "eval"), show_progress=show_progress)


# --- one stage ---------------------------------------------------------------------------------


def _run_stage(stage: Stage, total: int, strategy: Strategy, trainer: GRPOTrainer, stream: Stream,
               evaluator: Evaluator, run_dir: RunDir, experiment: Experiment, processes: PartialState,
               tracker: drift.DriftTracker | None = None) -> None:
    """Train ``stage``, checkpoint it, evaluate (and measure drift), record its row, then drop state it made
    unneeded."""
    started, usage = time.perf_counter(), _usage()
    sampler = stage_sampler(stage, stream)  # from the plain-data stage: plan.json replays exactly
    strategy.before_stage(stage, trainer)
    within = checkpoints.StepCheckpoints(run_dir, stage, trainer, strategy, sampler, experiment.checkpoint_minutes,
                                         processes)
    trainer.train(sampler, stage.steps, on_step=within.after_step,
                  description=f"stage {stage.index}/{total} {stage.name}", done=len(within.history))
    history = within.history
    strategy.after_stage(stage, trainer)
    checkpoints.save_checkpoint(trainer, strategy, run_dir.checkpoint_dir(stage.index), sampler, processes,
                                extra={"stage": stage.index})
    with trainer.full_weights():  # the main process evaluates alone: no collectives in its forwards
        if processes.is_main_process:
            evaluating = time.perf_counter()
            results = _evaluate(evaluator, trainer, run_dir, stage.index, experiment)
            evaluated = time.perf_counter()
            moved = tracker.measure() if tracker is not None else None
            _record(run_dir, stage.index, stage.name, list(stage.new), results, _train_summary(history),
                    time.perf_counter() - started, drift_entry=moved, eval_seconds=evaluated - evaluating,
                    since=usage)
            # Only now are the previous stage's optimizer state and this stage's checkpoint within it unneeded:
            # a kill before this row resumes from them (the stage's own checkpoint counts once its row is written).
            checkpoints.drop_stale(run_dir, stage.index)
    processes.wait_for_everyone()


def _evaluate(evaluator: Evaluator, trainer: GRPOTrainer, run_dir: RunDir, stage: int,
              experiment: Experiment, episodes: dict[str, list] | None = None) -> dict[str, EvalResult]:
    description = f"evaluating after stage {stage}" if stage else "evaluating the start model"
    return evaluator(trainer.model, trainer.tokenizer, trajectories_path=run_dir.trajectories_path(stage),
                     description=description, autocast_bf16=trainer.precision == "bf16",
                     episodes=episodes)


def _evaluate_start(evaluator: Evaluator, trainer: GRPOTrainer, run_dir: RunDir, experiment: Experiment,
                    stream: Stream, start_model: str, tracker: drift.DriftTracker | None) -> dict[str, EvalResult]:
    """Row 0: the start model's evaluation, read back from its warm-start's cache when played before.

    Only a warm-started model is cached (its directory is keyed by its
    inputs, `contrail.eval_cache`), and only without drift tracking, which
    needs the episodes' token ids.
    """
    cacheable = experiment.model.warmstart is not None and tracker is None
    if cacheable:
        entry = eval_cache.entry_dir(start_model, _start_evaluation_key(experiment, stream, start_model,
                                                                        trainer.precision))
        results = eval_cache.load(entry, run_dir.trajectories_path(0))
        if results is not None:
            console.print(f"row 0: reusing the warm-start's evaluation from {entry}")
            return results
    episodes: dict[str, list] = {}
    results = _evaluate(evaluator, trainer, run_dir, 0, experiment, episodes=episodes)
    if tracker is not None:
        tracker.keep_start_samples(episodes)  # before row 0: a kill in between redoes both
    if cacheable:
        eval_cache.store(entry, results, run_dir.trajectories_path(0))
    return results


def _start_evaluation_key(experiment: Experiment, stream: Stream, start_model: str, precision: str) -> str:
    """Everything that decides row 0's episodes (see `_make_evaluator` and `_evaluate`)."""
    return eval_cache.evaluation_key(
        start_model=str(start_model),
        test=[(e.name, e.test_tasks) for e in stream.test],
        env_options={e.name: e.env_options for e in stream.experiences},
        rollout=experiment.eval_rollout, k=experiment.eval.k, batch_episodes=experiment.eval.batch_episodes,
        seed=derive_seed(experiment.seed, "eval"), sampling="per-episode streams",  # `evaluation.episode_seed`
        batches="each experience apart",  # bf16 rounds by batch shape; entries from mixed batches are not reused
        prefill="buckets extended in place",  # nor entries from the cache layout before `HFBackend._extend`'s joint
        precision=precision,  # resolved: an "auto" run's episodes depend on what it resolved to
        dtype=experiment.model.dtype, device=experiment.model.device,
        lora=[experiment.grpo.lora, experiment.grpo.lora_r, experiment.grpo.lora_target_modules],
    )


def _drift_tracker(run_dir: RunDir, trainer: GRPOTrainer) -> drift.DriftTracker:
    # Built after the weights (and a resumed run's checkpoint) are in place: they are stage 1's baseline.
    return drift.DriftTracker(trainer.model, run_dir.path / DRIFT_SAMPLES, pad_id=trainer.tokenizer.pad_token_id or 0)


def _record(run_dir: RunDir, stage: int, name: str, trained: Sequence[str], results: dict[str, EvalResult],
            train: dict[str, Any], seconds: float, drift_entry: dict[str, Any] | None = None,
            eval_seconds: float | None = None, since: _Usage | None = None) -> None:
    """Append row ``stage``: ``seconds`` it took in all (row 0: the setup too), ``eval_seconds`` its evaluation,
    and the process's system time over the row and peak memory so far (from the usage taken at its ``since``)."""
    row = {"stage": stage, "name": name, "trained": list(trained),
           "results": {k: r.to_dict() for k, r in results.items()}, "train": train, "wall_seconds": seconds}
    if eval_seconds is not None:
        row["eval_seconds"] = eval_seconds
    now = _usage()
    if since is not None and now is not None:
        row["system_seconds"] = now.system_seconds - since.system_seconds
        row["peak_memory_gb"] = now.peak_memory_gb
    if drift_entry is not None:
        row["drift"] = drift_entry
    run_dir.append_row(row)
    cells = "  ".join(f"{n} {r.avg_at_k:.2f}" for n, r in results.items())
    errors = sum(r.errors for r in results.values())
    console.print(f"[bold]row {stage}[/] ({name}): avg@k  {cells}" + (f"  ({errors} env errors)" if errors else ""))


@dataclass(frozen=True)
class _Usage:
    """This process's system CPU time so far (all threads) and its peak resident memory."""

    system_seconds: float
    peak_memory_gb: float


def _usage() -> _Usage | None:
    """The process's `_Usage` now, or None where the OS does not report it (no ``resource`` module).

    A row records both. The peak is the memory a run needs; system time shows
    a machine that is slow to hand out fresh memory: on some cloud VMs every
    page a process touches for the first time costs microseconds in the
    kernel, and minutes over a run (README, "Measured here").
    """
    try:
        import resource
    except ImportError:  # Windows
        return None
    usage = resource.getrusage(resource.RUSAGE_SELF)
    peak_bytes = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # bytes on macOS, KiB on Linux
    return _Usage(system_seconds=usage.ru_stime, peak_memory_gb=peak_bytes / 1e9)


def _train_summary(history: list[dict[str, float]]) -> dict[str, Any]:
    if not history:
        return {}
    keys = ("reward_mean", "success_rate", "loss", "kl_mean", "invalid_rate", "cut_rate", "step_seconds")
    return {
        "steps": len(history),
        "first": {k: history[0].get(k) for k in keys},
        "last": {k: history[-1].get(k) for k in keys},
        "mean_success_rate": float(np.mean([h["success_rate"] for h in history])),
        "episode_errors": float(sum(h.get("episode_errors", 0.0) for h in history)),
        "seconds": float(sum(h.get("step_seconds", 0.0) for h in history)),
    }


# --- the run's end -----------------------------------------------------------------------------


def _read_plan(run_dir: RunDir) -> dict[str, Any] | None:
    path = run_dir.path / PLAN
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _finish(run_dir: RunDir, processes: PartialState) -> RunResult:
    """Mark the run finished and write its report.

    The report is rebuilt every time (it is a pure function of the run
    directory), so a kill after ``FINISHED`` but during or before the report
    is repaired by resuming.
    """
    if processes.is_main_process:
        if not run_dir.finished():
            checkpoints.drop_stale(run_dir, run_dir.completed_stages())  # a kill may have beaten the cleanup
            run_dir.mark_finished()
        _write_report(run_dir.path)
    processes.wait_for_everyone()
    plan = _read_plan(run_dir) or {}
    return RunResult(run_dir.path, list(plan.get("test", [])), list(plan.get("trained_at", [])), run_dir.rows())


def _write_json(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=2), encoding="utf-8")
    partial.replace(path)


def _write_report(path: Path) -> None:
    from contrail.report import write_report

    for written in write_report(path):
        console.print(f"wrote {written}")
