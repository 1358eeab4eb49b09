"""From a typed config to the objects a run needs, and the plan a dry run prints.

`build_stream` and `build_strategy` turn one run's config (see
`expand_runs`) into a `Stream` and a `Strategy`; `describe_plan` prints every
run's stages, budgets and evaluations without loading a model; `to_plan_json`
is what the runner writes as ``plan.json`` (the report reads it).

>>> cfg = load_experiment("experiments/quickstart.yaml")
>>> print(describe_plan(cfg))
>>> for run in expand_runs(cfg):
...     stream, strategy = build_stream(run), build_strategy(run)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from contrail import strategies
from contrail.config import ExperimentConfig, WarmStartConfig, expand_runs
from contrail.strategies import Stage, Strategy
from contrail.stream import Experience, Stream

__all__ = ["build_stream", "build_strategy", "describe_plan", "expand_runs", "to_plan_json"]


def build_stream(cfg: ExperimentConfig, cache: dict[str, Experience] | None = None) -> Stream:
    """The run's stream: ``stream.train`` in order, ``stream.test`` (or the training ones).

    Each experience's budget is ``stream.steps_per_experience``; its tasks are
    capped by ``train_tasks``/``test_tasks`` with ``task_seed``. ``cache``
    (spec → Experience) shares task lists between runs of one family.
    """
    s = cfg.stream
    cache = {} if cache is None else cache

    def get(spec: str) -> Experience:
        if spec not in cache:
            options = s.env_options.get(spec.partition(":")[0])
            cache[spec] = Experience.from_spec(
                spec, s.train_tasks, s.test_tasks, s.steps_per_experience, s.task_seed, options
            )
        return cache[spec]

    return Stream([get(spec) for spec in s.train], [get(spec) for spec in (s.test or s.train)])


def build_strategy(cfg: ExperimentConfig) -> Strategy:
    """The configured strategy, seeded by the run's seed (and given the stream's step budget)."""
    accepted = set(strategies.options(cfg.strategy.name))
    defaults = {"seed": cfg.seed, "steps_per_experience": cfg.stream.steps_per_experience}
    options = {k: v for k, v in defaults.items() if k in accepted}
    options.update(cfg.strategy.options)
    return strategies.make(cfg.strategy.name, **options)


def to_plan_json(
    stream: Stream,
    stages: Sequence[Stage],
    start_model: str = "",
    warmstart: WarmStartConfig | dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``plan.json`` of a run: test experiences, ``trained_at``, stages, start model, warm-start."""
    if dataclasses.is_dataclass(warmstart):
        warmstart = dataclasses.asdict(warmstart)
    return {
        "test": [e.name for e in stream.test],
        "trained_at": stream.trained_at([stage.experiences for stage in stages]),
        "stages": [stage.to_dict() for stage in stages],
        "start_model": start_model,
        "warmstart": warmstart,
    }


def describe_plan(cfg: ExperimentConfig) -> str:
    """Every run's plan in plain text (for ``contrail run --dry-run``); loads no model.

    Per run: the stages with their experiences and weights, GRPO steps, tasks
    per step and rollouts (steps × tasks_per_step × group_size); then the
    test experiences with their task counts, ``k`` and where each is trained.
    """
    runs = expand_runs(cfg)
    cache: dict[str, Experience] = {}
    lines = [f"experiment {cfg.name}: {len(runs)} run(s)", _describe_model(cfg), ""]
    for number, run in enumerate(runs, start=1):
        lines += _describe_run(run, number, len(runs), cache)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _describe_model(cfg: ExperimentConfig) -> str:
    m = cfg.model
    text = f"model {m.name} ({m.dtype}, device {m.device})"
    if m.warmstart is not None:
        w = m.warmstart
        text += (
            f"; warm-start on {', '.join(w.envs)}: {w.episodes} expert episodes in all (split evenly), "
            f"{w.epochs} epochs, lr {w.lr:g}"
        )
    return text


def _describe_run(run: ExperimentConfig, number: int, total: int, cache: dict[str, Experience]) -> list[str]:
    stream = build_stream(run, cache)
    strategy = build_strategy(run)
    note = ""
    base = None
    if strategy.needs_base_success:
        base = {e.name: 0.0 for e in stream.train}
        note = "  (order shown is the stream's; the run orders stages by the untouched model's measured success)"
    stages = strategy.plan(stream, base)
    g = run.grpo
    lines = [f"run {number}/{total}: {run.label}", f"  out {run.out}, seed {run.seed}, strategy {strategy.name}{note}"]
    sizes = {e.name: len(e.train_tasks) for e in stream.experiences}
    total_steps = total_rollouts = 0
    for stage in stages:
        rollouts = stage.steps * g.tasks_per_step * g.group_size
        total_steps += stage.steps
        total_rollouts += rollouts
        weights = ", ".join(f"{n} {w:.2f} ({sizes[n]} train tasks)" for n, w in stage.weights.items())
        lines.append(
            f"  stage {stage.index} {stage.name}: {stage.steps} steps × {g.tasks_per_step} tasks × "
            f"group {g.group_size} = {rollouts} rollouts; samples {weights}"
        )
    lines.append(f"  training total: {total_steps} steps, {total_rollouts} rollouts")
    trained_at = stream.trained_at([stage.experiences for stage in stages])
    k = run.eval.k
    tests = []
    for e, s in zip(stream.test, trained_at):
        where = f"trained in stage {s}" if s is not None else "held out"
        tests.append(f"{e.name} {len(e.test_tasks)} tasks ({where})")
    episodes = (len(stages) + 1) * sum(len(e.test_tasks) for e in stream.test) * k
    lines.append(f"  test after stages 0..{len(stages)} with k={k}: " + "; ".join(tests))
    lines.append(f"  evaluation total: {episodes} episodes")
    return lines
