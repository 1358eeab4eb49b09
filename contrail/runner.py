"""The experiment loop: plan → evaluate the start model → (train stage → evaluate → record) per stage.

Data flows one way: the strategy plans stages over the stream; the GRPO
trainer trains each stage; after every stage the model is evaluated on every
test experience and the row is written at once (atomically), after the
stage's checkpoint, so a killed run resumes after its last completed stage.

>>> stream = Stream.from_specs(["babyai:easy", "textcraft:easy"], test_tasks=10)
>>> result = run(stream, Sequential(steps_per_experience=5), model="smollm2-135m", out="runs/demo")
>>> result.matrix, result.metrics
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from accelerate import PartialState

from contrail.agent.rollout import RolloutConfig
from contrail.config import EvalConfig
from contrail.evaluation import EvalResult, evaluate, select_tasks
from contrail.experiment import to_plan_json
from contrail.grpo.config import GRPOConfig
from contrail.grpo.trainer import GRPOTrainer
from contrail.metrics import summarize
from contrail.models import load_model
from contrail.policy import Policy
from contrail.progress import console
from contrail.results import RunDir, result_matrix
from contrail.strategies import Strategy
from contrail.stream import Stream, env_factory
from contrail.train.demos import DemoSpec
from contrail.train.sft import SFTConfig, warmstart


@dataclass
class WarmStart:
    """A behaviour-cloning warm-start applied to the model before row 0 (cached and reused)."""

    demos: DemoSpec
    sft: SFTConfig = field(default_factory=SFTConfig)


@dataclass
class RunResult:
    """What a finished (or resumed-to-the-end) run measured."""

    path: Path
    test: list[str]
    trained_at: list[int | None]
    rows: list[dict[str, Any]]

    def matrix(self, measure: str = "avg_at_k") -> np.ndarray:
        """The stage × experience matrix R (row 0: the start model)."""
        return result_matrix(self.rows, self.test, measure)

    @property
    def metrics(self) -> dict[str, float]:
        return summarize(self.matrix(), self.trained_at)


def run(
    stream: Stream,
    strategy: Strategy,
    model: str = "smollm2-135m",
    out: str | Path = "runs/experiment",
    grpo: GRPOConfig | None = None,
    eval: EvalConfig | None = None,  # noqa: A002 - mirrors the config section's name
    warm_start: WarmStart | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    seed: int = 0,
    resume: bool = False,
    force: bool = False,
    config: dict[str, Any] | None = None,
    show_progress: bool = True,
) -> RunResult:
    """Train ``stream`` with ``strategy`` stage by stage, evaluating every test experience after each.

    ``config`` is the resolved experiment configuration saved in the run
    directory (a resumed run must match it); by default it is built from the
    arguments.
    """
    grpo = grpo or GRPOConfig(seed=seed)
    eval = eval or EvalConfig()
    # Under `accelerate launch` every process trains; only the main one evaluates and writes.
    processes = PartialState()
    main = processes.is_main_process
    run_dir = RunDir(out)
    if main:
        run_dir.start(config or _default_config(stream, strategy, model, grpo, eval, warm_start, dtype, seed),
                      resume=resume, force=force)
    processes.wait_for_everyone()

    start_model = str(warmstart(model, warm_start.demos, warm_start.sft, dtype, show_progress)) if warm_start else model
    base_success = _base_success(stream, strategy, start_model, eval, dtype, device, seed)
    stages = strategy.plan(stream, base_success)
    trained_at = stream.trained_at([stage.experiences for stage in stages])
    plan = to_plan_json(stream, stages, start_model=start_model,
                        warmstart=_describe_warm_start(warm_start, model))
    plan["base_success"] = base_success
    if main:
        _write_json(run_dir.path / "plan.json", plan)

    done = run_dir.completed_stages()  # -1: nothing yet; 0: row 0 only; s: stage s finished
    load_from = str(run_dir.checkpoint_dir(done) / "model") if done >= 1 else start_model
    policy_model, tokenizer = load_model(load_from, dtype=dtype, device=device)
    trainer = GRPOTrainer(policy_model, tokenizer, grpo, env_factory(stream.experiences),
                          log_dir=run_dir.path, show_progress=show_progress)
    if done >= 1:
        trainer.load_state(run_dir.checkpoint_dir(done))
        console.print(f"resuming {run_dir.path} after stage {done} of {len(stages)}")
    evaluator = _Evaluator(trainer, stream, eval, seed, run_dir, show_progress)

    if done < 0 and main:
        row0 = "warm-start" if warm_start else "untouched"
        _record(run_dir, 0, row0, [], evaluator(0), {}, 0.0)
    processes.wait_for_everyone()
    for stage in stages[max(done, 0):]:
        started = time.perf_counter()
        # Checkpoints are written at stage ends and every stage has its own seeded
        # sampler, so a resumed stage replays exactly as it would have run.
        strategy.before_stage(stage, trainer)
        history = trainer.train(stage.sampler, stage.steps, description=f"stage {stage.index}/{len(stages)} {stage.name}")
        strategy.after_stage(stage, trainer)
        trainer.save(run_dir.checkpoint_dir(stage.index), sampler=stage.sampler, extra={"stage": stage.index})
        if main:
            _drop_optimizer_state(run_dir, stage.index)
            _record(run_dir, stage.index, stage.name, stage.experiences, evaluator(stage.index),
                    _train_summary(history), time.perf_counter() - started)
        processes.wait_for_everyone()
    trainer.accelerator.end_training()
    if main:
        run_dir.mark_finished()
        _write_report(run_dir.path)
    return RunResult(run_dir.path, [e.name for e in stream.test], trained_at, run_dir.rows())


class _Evaluator:
    """Evaluates the training model on every test experience, sampling from the same seed at every stage."""

    def __init__(self, trainer: GRPOTrainer, stream: Stream, eval: EvalConfig, seed: int, run_dir: RunDir,
                 show_progress: bool):
        self.trainer, self.eval, self.seed, self.run_dir = trainer, eval, seed, run_dir
        self.tasks = {e.name: e.test_tasks for e in stream.test}
        self.make_env = env_factory(stream.experiences)
        self.show_progress = show_progress
        self.config = RolloutConfig(eval.max_new_tokens, eval.max_episode_tokens, eval.temperature, 1.0, eval.max_turns)

    def __call__(self, stage: int) -> dict[str, EvalResult]:
        # Same seed at every stage: differences between rows come from the model, not the sampling.
        policy = Policy.from_model(self.trainer.model, self.trainer.trainer.tokenizer, seed=self.seed + 10_007,
                                   autocast_bf16=self.trainer.config.precision == "bf16")
        path = self.run_dir.trajectories_path(stage)
        path.unlink(missing_ok=True)
        return evaluate(policy.backend, policy.chat, self.tasks, self.make_env, k=self.eval.k, config=self.config,
                        batch_episodes=self.eval.batch_episodes, trajectories_path=path,
                        description=f"evaluating after stage {stage}" if stage else "evaluating the start model",
                        show_progress=self.show_progress)


def _record(run_dir: RunDir, stage: int, name: str, trained: list[str], results: dict[str, EvalResult],
            train: dict[str, Any], seconds: float) -> None:
    row = {"stage": stage, "name": name, "trained": list(trained),
           "results": {k: r.to_dict() for k, r in results.items()}, "train": train, "wall_seconds": seconds}
    run_dir.append_row(row)
    _print_row(row)


def _print_row(row: dict[str, Any]) -> None:
    cells = "  ".join(f"{name} {r['avg_at_k']:.2f}" for name, r in row["results"].items())
    console.print(f"[bold]row {row['stage']}[/] ({row['name']}): avg@k  {cells}")


def _train_summary(history: list[dict[str, float]]) -> dict[str, Any]:
    if not history:
        return {}
    keys = ("reward_mean", "success_rate", "loss", "kl_mean", "invalid_rate", "step_seconds")
    return {
        "steps": len(history),
        "first": {k: history[0].get(k) for k in keys},
        "last": {k: history[-1].get(k) for k in keys},
        "mean_success_rate": float(np.mean([h["success_rate"] for h in history])),
        "seconds": float(sum(h["step_seconds"] for h in history)),
    }


def _base_success(stream: Stream, strategy: Strategy, model: str, eval: EvalConfig, dtype: str, device: str,
                  seed: int) -> dict[str, float] | None:
    """The start model's success on a few training tasks per experience, when the strategy asks for it."""
    if not getattr(strategy, "needs_base_success", False):
        return None
    policy = Policy.load(model, device=device, dtype=dtype, seed=seed)
    tasks = {e.name: select_tasks(e.train_tasks, 16, seed) for e in stream.train}
    config = RolloutConfig(eval.max_new_tokens, eval.max_episode_tokens, eval.temperature, 1.0, eval.max_turns)
    results = evaluate(policy.backend, policy.chat, tasks, env_factory(stream.train), k=2, config=config,
                       description="measuring base success for the curriculum")
    return {name: r.avg_at_k for name, r in results.items()}


def _drop_optimizer_state(run_dir: RunDir, stage: int) -> None:
    """Keep model weights of every stage but optimizer state only for the latest (it is large)."""
    for earlier in range(1, stage):
        state = run_dir.checkpoint_dir(earlier) / "trainer_state.pt"
        state.unlink(missing_ok=True)


def _describe_warm_start(warm_start: WarmStart | None, model: str) -> dict[str, Any] | None:
    if warm_start is None:
        return None
    return {"base_model": model, "envs": list(warm_start.demos.envs), "episodes": warm_start.demos.episodes,
            "epochs": warm_start.sft.epochs, "lr": warm_start.sft.lr, "seed": warm_start.demos.seed}


def _default_config(stream, strategy, model, grpo, eval, warm_start, dtype, seed) -> dict[str, Any]:
    return {
        "model": {"name": model, "dtype": dtype, "warmstart": _describe_warm_start(warm_start, model)},
        "stream": {"train": [e.name for e in stream.train], "test": [e.name for e in stream.test],
                   "train_tasks": [len(e.train_tasks) for e in stream.train],
                   "test_tasks": [len(e.test_tasks) for e in stream.test]},
        "strategy": {"name": strategy.name, "options": _public_fields(strategy)},
        "grpo": asdict(grpo), "eval": asdict(eval), "seed": seed,
    }


def _public_fields(obj: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(obj).items() if not k.startswith("_") and isinstance(v, (int, float, str, bool, dict, list, type(None)))}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=2, default=str))
    partial.replace(path)


def _write_report(path: Path) -> None:
    from contrail.report import write_report

    for written in write_report(path):
        console.print(f"wrote {written}")


__all__ = ["RunResult", "WarmStart", "run"]
