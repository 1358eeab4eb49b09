"""contrail.integrations.avalanche: the stream as an Avalanche scenario, and a run through Avalanche's loggers.

These need avalanche-lib (which pulls torchvision and its torch), so they run
in their own environment: ``scripts/test_avalanche.sh DIR`` builds it and runs
``pytest -m avalanche`` here. In the default suite they are skipped, except
the one that checks the install hint shown when avalanche is missing.
"""

from __future__ import annotations

import importlib.util
import io
import json
import re

import pytest

from contrail.envs.base import Task
from contrail.runner import RunResult
from contrail.strategies import Stage
from contrail.stream import Experience, Stream

HAVE_AVALANCHE = importlib.util.find_spec("avalanche") is not None

TEST = ["babyai:easy", "textcraft:easy", "searchqa"]
TRAINED_AT = [1, 2, None]          # searchqa is held out
# avg@k after stage 0 (untouched), 1 (babyai), 2 (textcraft); textcraft has twice the episodes.
R = [[0.2, 0.1, 0.3], [0.8, 0.2, 0.35], [0.5, 0.9, 0.25]]
TASKS = {"babyai:easy": 10, "textcraft:easy": 20, "searchqa": 10}
K = 4


def _row(stage: int, name: str, trained: list[str]) -> dict:
    results = {}
    for j, exp in enumerate(TEST):
        results[exp] = {"tasks": TASKS[exp], "k": K, "avg_at_k": R[stage][j], "pass_at_k": 1.0, "reward": 0.0,
                        "turns": 3.0, "generated_tokens": 10.0, "invalid_rate": 0.0, "truncated_rate": 0.0,
                        "errors": 0}
    return {"stage": stage, "name": name, "trained": trained, "results": results, "train": {}, "wall_seconds": 1.0}


ROWS = [_row(0, "start", []), _row(1, "babyai:easy", ["babyai:easy"]), _row(2, "textcraft:easy", ["textcraft:easy"])]

# Hand-computed: stream accuracy weights each experience by its episodes (40, 80, 40 of 160).
EXPECTED = {
    0: {"Top1_Acc_Exp/eval_phase/test_stream/Task000/Exp000": 0.2,
        "Top1_Acc_Exp/eval_phase/test_stream/Task000/Exp001": 0.1,
        "Top1_Acc_Exp/eval_phase/test_stream/Task000/Exp002": 0.3,
        "Top1_Acc_Stream/eval_phase/test_stream/Task000": (8 + 8 + 12) / 160},
    # stage 1: babyai was trained at stage 1 itself, so nothing has been forgotten yet
    1: {"Top1_Acc_Exp/eval_phase/test_stream/Task000/Exp000": 0.8,
        "Top1_Acc_Exp/eval_phase/test_stream/Task000/Exp001": 0.2,
        "Top1_Acc_Exp/eval_phase/test_stream/Task000/Exp002": 0.35,
        "Top1_Acc_Stream/eval_phase/test_stream/Task000": (32 + 16 + 14) / 160},
    # stage 2: babyai fell from 0.8 (right after its stage) to 0.5
    2: {"Top1_Acc_Exp/eval_phase/test_stream/Task000/Exp000": 0.5,
        "Top1_Acc_Exp/eval_phase/test_stream/Task000/Exp001": 0.9,
        "Top1_Acc_Exp/eval_phase/test_stream/Task000/Exp002": 0.25,
        "Top1_Acc_Stream/eval_phase/test_stream/Task000": (20 + 72 + 10) / 160,
        "ExperienceForgetting/eval_phase/test_stream/Task000/Exp000": 0.3,
        "ExperienceBWT/eval_phase/test_stream/Task000/Exp000": -0.3,
        "StreamForgetting/eval_phase/test_stream": 0.3,
        "StreamBWT/eval_phase/test_stream": -0.3},
}


@pytest.fixture
def avalanche():
    """avalanche-lib, or the test is skipped (it lives in its own environment, not the default one)."""
    return pytest.importorskip("avalanche")


@pytest.fixture
def run_dir(tmp_path):
    """A hand-made run directory: plan.json and results.jsonl as the runner writes them."""
    stages = [{"index": 1, "name": "babyai:easy", "new": ["babyai:easy"], "steps": 5,
               "weights": {"babyai:easy": 1.0}, "seed": 1},
              {"index": 2, "name": "textcraft:easy", "new": ["textcraft:easy"], "steps": 5,
               "weights": {"textcraft:easy": 1.0}, "seed": 2}]
    plan = {"test": TEST, "trained_at": TRAINED_AT, "stages": stages, "label": "sequential", "seed": 0}
    (tmp_path / "plan.json").write_text(json.dumps(plan), encoding="utf-8")
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    return tmp_path


def _by_stage(values) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for value in values:
        out.setdefault(value.x_plot, {})[value.name] = value.value
    return out


def _assert_matches(got: dict[int, dict[str, float]]) -> None:
    assert sorted(got) == sorted(EXPECTED)
    for stage, expected in EXPECTED.items():
        assert sorted(got[stage]) == sorted(expected), f"stage {stage}"
        for name, value in expected.items():
            assert got[stage][name] == pytest.approx(value), f"stage {stage}: {name}"


# --- without avalanche ---------------------------------------------------------------------


@pytest.mark.skipif(HAVE_AVALANCHE, reason="checks the message shown when avalanche-lib is missing")
def test_missing_avalanche_names_the_extra(run_dir):
    from contrail.integrations.avalanche import AvalancheMissingError, publish

    with pytest.raises(AvalancheMissingError, match=re.escape("pip install 'contrail[avalanche]'")):
        publish(run_dir, [])


# --- the scenario ----------------------------------------------------------------------------


def _experience(name: str) -> Experience:
    env, _, difficulty = name.partition(":")
    tasks = [Task(env, i, "test", difficulty or "default") for i in range(2)]
    return Experience(name, env, difficulty or None, [], tasks, steps=5)


def _stream() -> Stream:
    babyai, textcraft, searchqa = (_experience(n) for n in TEST)
    return Stream(train=[babyai, textcraft], test=[babyai, textcraft, searchqa])


@pytest.mark.avalanche
def test_scenario_streams_carry_the_experiences(avalanche):
    from avalanche.benchmarks.scenarios.generic_scenario import CLExperience, CLScenario

    from contrail.integrations.avalanche import as_scenario

    stream = _stream()
    scenario = as_scenario(stream)
    assert isinstance(scenario, CLScenario)
    assert sorted(scenario.streams) == ["test", "train"]
    train, test = list(scenario.train_stream), list(scenario.test_stream)
    assert all(isinstance(e, CLExperience) for e in train + test)
    assert [e.current_experience for e in train] == [0, 1]
    assert [e.origin_stream.name for e in train] == ["train", "train"]
    assert [e.experience for e in train] == stream.train
    assert [(e.env, e.difficulty, e.task_id, e.task_labels) for e in train] == [
        ("babyai", "easy", 0, [0]), ("textcraft", "easy", 1, [0])]
    assert [e.stage for e in train] == [None, None]
    assert [e.weights for e in train] == [{"babyai:easy": 1.0}, {"textcraft:easy": 1.0}]
    # The test stream: every test experience, in the matrix's order, the held-out one included.
    assert [e.name for e in test] == TEST
    assert [e.current_experience for e in test] == [0, 1, 2]
    assert [e.experience for e in test] == stream.test
    assert [e.trained_at for e in test] == TRAINED_AT
    assert [e.held_out for e in test] == [False, False, True]
    assert [(e.env, e.difficulty, e.task_id) for e in test] == [
        ("babyai", "easy", 0), ("textcraft", "easy", 1), ("searchqa", None, 2)]
    assert test[0].experience.test_tasks[0] == Task("babyai", 0, "test", "easy")


@pytest.mark.avalanche
def test_scenario_from_a_plan_has_one_experience_per_stage(avalanche):
    from contrail.integrations.avalanche import as_scenario

    stream = _stream()
    stages = [Stage(index=1, name="both", new=("babyai:easy", "textcraft:easy"), steps=7,
                    weights={"babyai:easy": 0.5, "textcraft:easy": 0.5}, seed=3),
              Stage(index=2, name="replay", new=(), steps=2, weights={"babyai:easy": 1.0}, seed=4)]
    scenario = as_scenario(stream, stages, task_labels=True)
    train = list(scenario.train_stream)
    assert [e.stage for e in train] == stages
    assert [e.steps for e in train] == [7, 2]
    assert train[1].weights == {"babyai:easy": 1.0}
    assert [tuple(x.name for x in e.experiences) for e in train] == [("babyai:easy", "textcraft:easy"), ()]
    assert train[0].task_labels == [0, 1] and train[0].task_label is None and train[0].experience is None
    test = list(scenario.test_stream)
    assert [e.trained_at for e in test] == [1, 1, None]
    assert [e.task_label for e in test] == [0, 1, 2]
    bad = [Stage(index=1, name="x", new=("webshop",), steps=1, weights={"webshop": 1.0}, seed=0)]
    with pytest.raises(ValueError, match="webshop"):
        as_scenario(stream, bad)


# --- publishing ------------------------------------------------------------------------------


@pytest.mark.avalanche
def test_metric_values_follow_avalanche_definitions(avalanche, run_dir):
    from avalanche.evaluation.metric_results import MetricValue

    from contrail.integrations.avalanche import metric_values

    values = metric_values(TEST, TRAINED_AT, ROWS)
    assert all(isinstance(v, MetricValue) for v in values)
    _assert_matches(_by_stage(values))
    # Task-aware: each experience its own task, the stream accuracy split by task.
    aware = _by_stage(metric_values(TEST, TRAINED_AT, ROWS, task_labels=True))
    assert aware[2]["Top1_Acc_Exp/eval_phase/test_stream/Task001/Exp001"] == pytest.approx(0.9)
    assert aware[2]["Top1_Acc_Stream/eval_phase/test_stream/Task002"] == pytest.approx(0.25)
    assert aware[2]["ExperienceForgetting/eval_phase/test_stream/Task000/Exp000"] == pytest.approx(0.3)


@pytest.mark.avalanche
def test_text_logger_prints_each_stage(avalanche, run_dir):
    from avalanche.logging import TextLogger

    from contrail.integrations.avalanche import publish

    out = io.StringIO()
    publish(run_dir, [TextLogger(out)])
    sections = re.split(r"^-- >> contrail stage (\d+) .*<< --$", out.getvalue(), flags=re.M)[1:]
    printed: dict[int, dict[str, float]] = {}
    for stage, body in zip(sections[::2], sections[1::2]):
        lines = [line.strip().split(" = ") for line in body.strip().splitlines()]
        printed[int(stage)] = {name: float(value) for name, value in lines}
    _assert_matches(printed)  # TextLogger prints 4 decimals: every expected value is exact at 4


@pytest.mark.avalanche
def test_tensorboard_logger_writes_the_tags(avalanche, run_dir, tmp_path):
    from avalanche.logging import TensorboardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from contrail.integrations.avalanche import publish

    logger = TensorboardLogger(tb_log_dir=tmp_path / "tb")
    publish(run_dir, [logger])
    logger.writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    written: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            written.setdefault(event.step, {})[tag] = event.value
    _assert_matches(written)


@pytest.mark.avalanche
def test_publish_takes_a_run_result(avalanche, run_dir):
    from avalanche.logging import TextLogger

    from contrail.integrations.avalanche import publish

    result = RunResult(run_dir, TEST, TRAINED_AT, ROWS)
    _assert_matches(_by_stage(publish(result, [TextLogger(io.StringIO())])))
    with pytest.raises(FileNotFoundError, match="no such run directory"):
        publish(run_dir / "missing", [])


@pytest.mark.avalanche
def test_stage_publisher_sends_each_stage_once(avalanche, run_dir):
    from avalanche.logging import TextLogger

    from contrail.integrations.avalanche import StagePublisher

    results = run_dir / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]), encoding="utf-8")  # stages 0, 1 so far
    out = io.StringIO()
    publisher = StagePublisher([TextLogger(out)])
    first = publisher(run_dir)
    assert sorted({v.x_plot for v in first}) == [0, 1]
    assert publisher(run_dir) == []                        # nothing new
    results.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")   # stage 2 recorded
    second = publisher(run_dir)
    assert {v.x_plot for v in second} == {2}
    assert _by_stage(second)[2] == pytest.approx(EXPECTED[2])
    assert re.findall(r"contrail stage (\d+)", out.getvalue()) == ["0", "1", "2"]


@pytest.mark.avalanche
def test_a_real_run_publishes_its_matrix(avalanche, tmp_path):
    """The runner's own run directory (a tiny model, two stages): values and scenario agree with it."""
    import numpy as np
    from avalanche.logging import TextLogger

    import contrail.testing as testing  # registers the tiny "magic" environments
    from contrail import metrics
    from contrail.agent.rollout import RolloutConfig
    from contrail.experiment import EvalSpec, Experiment, ModelSpec, StrategySpec, StreamSpec, build_stream
    from contrail.grpo.config import GRPOConfig
    from contrail.integrations.avalanche import as_scenario, publish
    from contrail.runner import run
    from contrail.strategies import Stage

    tokenizer = testing.tiny_tokenizer()
    testing.tiny_model(tokenizer, seed=0).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    exp = Experiment(
        name="tiny",
        stream=StreamSpec(train=["magic:easy", "magic-berry:easy"],
                          test=["magic:easy", "magic-berry:easy", "magic:hard"],
                          train_tasks=4, test_tasks=2, steps_per_experience=1),
        strategy=StrategySpec(name="sequential"),
        model=ModelSpec(name=str(tmp_path / "tiny"), dtype="float32", device="cpu"),
        rollout=RolloutConfig(max_new_tokens=3, max_episode_tokens=256),
        grpo=GRPOConfig(lr=1e-2, group_size=2, tasks_per_step=2),
        eval=EvalSpec(k=2), out=str(tmp_path / "run"),
    )
    result = run(exp, show_progress=False)
    got = _by_stage(publish(result.path, [TextLogger(io.StringIO())]))
    R = result.matrix()
    assert sorted(got) == [0, 1, 2]
    for s in range(3):
        for j in range(3):
            assert got[s][f"Top1_Acc_Exp/eval_phase/test_stream/Task000/Exp{j:03}"] == pytest.approx(R[s, j])
    assert got[2]["StreamBWT/eval_phase/test_stream"] == pytest.approx(metrics.backward_transfer(R, result.trained_at))
    assert np.isclose(got[2]["ExperienceForgetting/eval_phase/test_stream/Task000/Exp000"], R[1, 0] - R[2, 0])

    plan = json.loads((result.path / "plan.json").read_text(encoding="utf-8"))
    scenario = as_scenario(build_stream(exp), [Stage.from_dict(d) for d in plan["stages"]])
    assert [e.name for e in scenario.test_stream] == plan["test"]
    assert [e.trained_at for e in scenario.test_stream] == plan["trained_at"] == [1, 2, None]
    assert [e.stage.new for e in scenario.train_stream] == [("magic:easy",), ("magic-berry:easy",)]
