"""`run()` end to end on a tiny model and two tiny environments: every built-in planning strategy, the hooks."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from contrail.agent.rollout import RolloutConfig
from contrail.experiment import EvalSpec, Experiment, ModelSpec, StrategySpec, StreamSpec
from contrail.grpo.config import GRPOConfig
from contrail.grpo.trainer import GRPOTrainer
from contrail.results import RunExistsError
from contrail.runner import RunResult, run
from contrail.seeds import derive_seed
from contrail.strategies import Sequential, Stage
from contrail.testing import save_tiny_model

TRAIN = ["magic:easy", "magic-berry:easy"]
HELD_OUT = "magic:hard"  # never trained: held out
CORE_METRICS = ("final_performance", "backward_transfer", "forgetting", "forward_transfer", "heldout_gain")


@pytest.fixture
def base_model(tmp_path):
    return save_tiny_model(tmp_path / "tiny")


def experiment(base_model, out, strategy="sequential", options=None, test=None, steps=2, seed=0) -> Experiment:
    """A run of a few seconds: two 3-token-turn environments, 2 GRPO steps per experience."""
    return Experiment(
        name="tiny",
        stream=StreamSpec(train=list(TRAIN), test=list(test or TRAIN), train_tasks=8, test_tasks=4,
                          steps_per_experience=steps),
        strategy=StrategySpec(name=strategy, options=dict(options or {})),
        model=ModelSpec(name=base_model, dtype="float32", device="cpu"),
        rollout=RolloutConfig(max_new_tokens=3, max_episode_tokens=256),
        grpo=GRPOConfig(lr=1e-2, group_size=4, tasks_per_step=2),
        eval=EvalSpec(k=2),
        seed=seed,
        out=str(out),
    )


def defined_metrics(trained_at: list[int | None], stages: int) -> set[str]:
    """The core metrics whose set of experiences is non-empty (see `contrail.metrics`)."""
    trained = [s for s in trained_at if s is not None]
    defined = set()
    if trained:
        defined.add("final_performance")
    if any(s < stages for s in trained):
        defined |= {"backward_transfer", "forgetting"}
    if any(s >= 2 for s in trained):
        defined.add("forward_transfer")
    if any(s is None for s in trained_at):
        defined.add("heldout_gain")
    return defined


def check_metrics(result: RunResult, stages: int) -> None:
    """Every core metric is finite exactly where it is defined (and nan elsewhere)."""
    defined = defined_metrics(result.trained_at, stages)
    for name in CORE_METRICS:
        value = result.metrics[name]
        assert math.isfinite(value) == (name in defined), (name, value, result.trained_at)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_each_row_records_the_system_time_over_it_and_the_peak_memory_so_far(base_model, tmp_path, monkeypatch):
    import resource
    import time
    from types import SimpleNamespace

    # A clock for system time (so a row's must equal its wall time) and a peak that grows by 1 MiB a reading.
    readings = iter(range(1, 10_000))
    fake = lambda who: SimpleNamespace(ru_stime=time.perf_counter(), ru_maxrss=1024 * next(readings))  # noqa: E731
    monkeypatch.setattr(resource, "getrusage", fake)
    run(experiment(base_model, tmp_path / "run"), show_progress=False)
    rows = read_jsonl(tmp_path / "run" / "results.jsonl")
    assert len(rows) == 3
    for row in rows:  # over the row, not since the process started; row 0 counts the setup as its wall time does
        assert row["system_seconds"] == pytest.approx(row["wall_seconds"], abs=0.25), row
    peaks = [row["peak_memory_gb"] for row in rows]
    assert peaks == sorted(peaks) and len(set(peaks)) == 3 and all(p < 0.1 for p in peaks)  # KiB read as KiB


def test_sequential_run_writes_config_plan_rows_checkpoints_and_report(base_model, tmp_path):
    exp = experiment(base_model, tmp_path / "run", test=[*TRAIN, HELD_OUT])
    result = run(exp, show_progress=False)
    path = tmp_path / "run"
    assert result.path == path
    # config.yaml is exactly the experiment, and reads back as an equal one
    assert (path / "config.yaml").read_text() == exp.to_yaml()
    assert Experiment.from_yaml(path / "config.yaml") == exp
    rows = read_jsonl(path / "results.jsonl")
    assert [r["stage"] for r in rows] == [0, 1, 2]
    assert [r["name"] for r in rows] == ["untouched", "magic:easy", "magic-berry:easy"]
    assert [r["trained"] for r in rows] == [[], ["magic:easy"], ["magic-berry:easy"]]
    assert all(set(r["results"]) == {*TRAIN, HELD_OUT} for r in rows)
    assert rows[1]["train"]["steps"] == 2 and rows[0]["train"] == {}
    # every row's time, its evaluation's a part of it; row 0's counts the setup before its evaluation
    assert all(0 < r["eval_seconds"] < r["wall_seconds"] for r in rows)
    plan = json.loads((path / "plan.json").read_text())
    assert plan["test"] == [*TRAIN, HELD_OUT] and plan["trained_at"] == [1, 2, None]
    assert plan["seed"] == 0 and plan["label"] and plan["base_success"] is None
    assert plan["start_model"] == base_model and plan["warmstart"] is None
    assert [Stage.from_dict(s) for s in plan["stages"]] == Sequential(steps_per_experience=2).plan(
        _stream(exp), seed=0)
    assert result.trained_at == [1, 2, None] and result.matrix().shape == (3, 3)
    check_metrics(result, stages=2)
    for name in ("report.md", "matrix.csv", "FINISHED"):
        assert (path / name).exists(), name
    checkpoints = path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["stage-01", "stage-02"]
    assert (checkpoints / "stage-01" / "model" / "config.json").exists()
    assert (checkpoints / "stage-02" / "trainer_state.pt").exists()
    assert not (checkpoints / "stage-01" / "trainer_state.pt").exists()  # optimizer state: last stage only
    for stage in range(3):  # 3 experiences x 4 tasks x k=2
        assert len(read_jsonl(path / "trajectories" / f"stage-{stage:02d}.jsonl")) == 3 * 4 * 2
    log = read_jsonl(path / "grpo_log.jsonl")
    assert [entry["step"] for entry in log] == [1, 2, 3, 4]
    with pytest.raises(RunExistsError, match="--force"):
        run(exp, show_progress=False)
    with pytest.raises(RunExistsError, match="differs in seed"):
        run(replace(exp, seed=1), resume=True, show_progress=False)


def _stream(exp):
    from contrail.experiment import build_stream

    return build_stream(exp)


def test_out_argument_overrides_the_experiment_out(base_model, tmp_path):
    exp = experiment(base_model, tmp_path / "unused", strategy="mixture", steps=1)
    result = run(exp, tmp_path / "chosen", show_progress=False)
    assert result.path == tmp_path / "chosen" and (tmp_path / "chosen" / "FINISHED").exists()
    assert not (tmp_path / "unused").exists()


def test_replay_run_samples_earlier_experiences_in_later_stages(base_model, tmp_path):
    exp = experiment(base_model, tmp_path / "run", strategy="replay", options={"replay_share": 0.5})
    result = run(exp, show_progress=False)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert [s["weights"] for s in plan["stages"]] == [{"magic:easy": 1.0},
                                                      {"magic-berry:easy": 0.5, "magic:easy": 0.5}]
    assert result.trained_at == [1, 2]
    # stage 2 trained on both experiences: its rollouts played tasks of each
    assert [r["trained"] for r in result.rows] == [[], ["magic:easy"], ["magic-berry:easy"]]
    check_metrics(result, stages=2)


def test_mixture_run_is_one_stage_over_every_experience(base_model, tmp_path):
    exp = experiment(base_model, tmp_path / "run", strategy="mixture", test=[*TRAIN, HELD_OUT])
    result = run(exp, show_progress=False)
    assert [r["stage"] for r in result.rows] == [0, 1]
    assert result.rows[1]["trained"] == TRAIN and result.rows[1]["train"]["steps"] == 4  # equal compute
    assert result.trained_at == [1, 1, None]
    check_metrics(result, stages=1)
    assert math.isnan(result.metrics["backward_transfer"])  # nothing trained before the last stage


def test_measured_curriculum_measures_base_success_with_the_one_loaded_model(base_model, tmp_path, monkeypatch):
    from contrail import runner

    loads = []
    real_load = runner.load_model
    monkeypatch.setattr(runner, "load_model", lambda *a, **k: loads.append(a[0]) or real_load(*a, **k))
    exp = experiment(base_model, tmp_path / "run", strategy="curriculum", options={"by": "measured"}, seed=4)
    result = run(exp, show_progress=False)
    assert loads == [base_model]  # measured and trained with the same, once-loaded model
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    base = plan["base_success"]
    assert set(base) == set(TRAIN) and all(0.0 <= v <= 1.0 for v in base.values())
    # stages ordered by descending measured success (ties keep the stream order)
    expected = sorted(TRAIN, key=lambda name: -base[name])
    assert expected != TRAIN  # with seed 4 the measurement reverses the stream's order: the test can tell
    assert [s["name"] for s in plan["stages"]] == expected
    assert [r["name"] for r in result.rows[1:]] == expected
    check_metrics(result, stages=2)


def recording_evaluators(monkeypatch):
    """Record every Evaluator the runner builds and the descriptions it is called with."""
    from contrail import runner
    from contrail.evaluation import Evaluator

    built = []

    class Recording(Evaluator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.calls = []
            built.append(self)

        def __call__(self, *args, **kwargs):
            self.calls.append(kwargs.get("description"))
            return super().__call__(*args, **kwargs)

    monkeypatch.setattr(runner, "Evaluator", Recording)
    return built


def test_evaluation_uses_the_eval_rollout_and_one_seed_for_every_row(base_model, tmp_path, monkeypatch):
    built = recording_evaluators(monkeypatch)
    exp = replace(experiment(base_model, tmp_path / "run", seed=5), eval=EvalSpec(k=2, temperature=0.5, max_turns=2))
    run(exp, show_progress=False)
    [evaluator] = built  # one evaluator, hence one sampling seed, for rows 0, 1 and 2
    assert evaluator.calls == ["evaluating the start model", "evaluating after stage 1", "evaluating after stage 2"]
    assert evaluator.seed == derive_seed(5, "eval")
    assert evaluator.rollout == exp.eval_rollout
    assert evaluator.rollout.temperature == 0.5 and evaluator.rollout.max_new_tokens == exp.rollout.max_new_tokens
    assert evaluator.k == 2 and list(evaluator.tasks) == TRAIN


def test_base_success_is_measured_on_seeded_training_tasks(base_model, tmp_path, monkeypatch):
    from contrail import runner
    from contrail.evaluation import select_tasks
    from contrail.experiment import build_stream

    built = recording_evaluators(monkeypatch)
    monkeypatch.setattr(runner, "BASE_SUCCESS_TASKS", 3)  # fewer than the 8 training tasks: a sample
    exp = experiment(base_model, tmp_path / "run", strategy="curriculum", options={"by": "measured"}, seed=3)
    run(exp, show_progress=False)
    measuring, evaluating = built
    seed = derive_seed(3, "base-success")
    assert measuring.seed == seed and evaluating.seed == derive_seed(3, "eval")
    assert measuring.calls == ["measuring base success for the curriculum"]
    for experience in build_stream(exp).train:
        assert measuring.tasks[experience.name] == select_tasks(experience.train_tasks, 3, seed)
        assert len(measuring.tasks[experience.name]) == 3
    assert measuring.rollout == exp.eval_rollout and measuring.k == runner.BASE_SUCCESS_K


class RecordingHooks(Sequential):
    """Sequential, recording every hook call (named in the experiment as ``test_runner:RecordingHooks``)."""

    calls: list = []

    def before_stage(self, stage, trainer):
        RecordingHooks.calls.append(("before", stage, trainer, trainer.step_count))

    def after_stage(self, stage, trainer):
        RecordingHooks.calls.append(("after", stage, trainer, trainer.step_count))


def test_runner_calls_both_hooks_with_the_stage_and_the_trainer(base_model, tmp_path):
    RecordingHooks.calls = calls = []
    run(experiment(base_model, tmp_path / "run", strategy=f"{__name__}:RecordingHooks"), show_progress=False)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    stages = [Stage.from_dict(s) for s in plan["stages"]]
    assert [(c[0], c[1]) for c in calls] == [("before", stages[0]), ("after", stages[0]),
                                             ("before", stages[1]), ("after", stages[1])]
    assert all(isinstance(c[2], GRPOTrainer) for c in calls) and len({id(c[2]) for c in calls}) == 1
    assert [c[3] for c in calls] == [0, 2, 2, 4]  # before: no step of the stage yet; after: all of them


def test_a_bad_experiment_fails_before_anything_is_written(base_model, tmp_path):
    from contrail.experiment import ConfigError

    bad = experiment(base_model, tmp_path / "run", strategy="replay", options={"bogus": 1})
    with pytest.raises(ConfigError, match="bogus"):
        run(bad, show_progress=False)
    assert not (tmp_path / "run").exists()
