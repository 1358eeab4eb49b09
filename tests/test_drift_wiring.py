"""Forgetting beyond success, wired into `run()` (issue #12, item 4), and what the diagnostics get from a run.

One two-stage run of the tiny model (a high lr, so the policy moves) is
shared by the checks: every stage row carries ``"drift"`` (KL to the start
model on its own row-0 samples, the share of parameters changed since the
previous stage), ``drift-start.json`` holds those samples with the start
model's own log-probs, ``plan.json`` the evaluation's turn limits, each
trajectory record its experience and each model turn the environment's
validity verdict; ``report.md`` shows the drift and turnover sections.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from contrail import drift
from contrail.agent import ChatFormat, Generation, rollout
from contrail.agent.rollout import RolloutConfig
from contrail.diagnostics import turn_validity
from contrail.experiment import EvalSpec, Experiment, ModelSpec, StrategySpec, StreamSpec
from contrail.grpo.config import GRPOConfig
from contrail.models import load_model
from contrail.report import analyse
from contrail.runner import run
from contrail.testing import MagicWordEnv, save_tiny_model, tiny_model, tiny_tokenizer

TRAIN = ["magic:easy", "magic-berry:easy"]
TEST = [*TRAIN, "magic:hard"]  # magic:hard: never trained, turn limit 1


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def experiment(base_model, out, **eval_options) -> Experiment:
    return Experiment(
        name="drift",
        stream=StreamSpec(train=list(TRAIN), test=list(TEST), train_tasks=8, test_tasks=4, steps_per_experience=2),
        strategy=StrategySpec(name="sequential"),
        model=ModelSpec(name=base_model, dtype="float32", device="cpu"),
        rollout=RolloutConfig(max_new_tokens=3, max_episode_tokens=256),
        grpo=GRPOConfig(lr=3e-2, group_size=8, tasks_per_step=2),
        eval=EvalSpec(k=2, **eval_options),
        seed=1,  # a seed whose random-model rollouts give each stage a reward signal (an update)
        out=str(out),
    )


@pytest.fixture(scope="module")
def finished(base_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run"
    run(experiment(base_model, out), show_progress=False)
    return out


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def records(out, stage: int) -> list[dict]:
    return [json.loads(line) for line in (out / "trajectories" / f"stage-{stage:02d}.jsonl").read_text().splitlines()]


def trainable(path) -> dict[str, torch.Tensor]:
    model, _ = load_model(str(path), dtype="float32", device="cpu")
    return {name: p.detach() for name, p in model.named_parameters()}


# --- the rows ---------------------------------------------------------------------------------


def test_every_stage_row_carries_a_positive_kl_per_test_experience_and_row_0_none(finished):
    recorded = rows(finished)
    assert "drift" not in recorded[0]  # nothing has moved yet
    for row in recorded[1:]:
        kl = row["drift"]["kl"]
        assert set(kl) == set(TEST)
        for estimate in kl.values():
            assert estimate["k3"] > 0 and estimate["k2"] > 0 and estimate["tokens"] > 0
            assert estimate["sequences"] == 4 * 2  # every row-0 episode of the experience (tasks x k)


def test_the_start_samples_have_zero_kl_to_the_start_model_itself(finished, base_model):
    samples = drift.load_samples(finished / "drift-start.json")
    assert set(samples) == set(TEST)
    start, tokenizer = load_model(base_model, dtype="float32", device="cpu")
    for estimate in drift.kl_to_start(start, samples, pad_id=tokenizer.pad_token_id).values():
        assert abs(estimate.k1) < 1e-9 and abs(estimate.k3) < 1e-9 and estimate.tokens > 0


def test_the_parameter_change_is_measured_against_the_previous_stage(finished, base_model):
    recorded = rows(finished)
    weights = [trainable(base_model)] + [trainable(finished / "checkpoints" / f"stage-{s:02d}" / "model")
                                         for s in (1, 2)]
    for stage in (1, 2):
        expected = drift.parameter_change(weights[stage - 1], weights[stage]).to_dict()
        assert recorded[stage]["drift"]["params"] == expected
        assert 0 < expected["fraction"] <= 1


def test_the_tracker_compares_each_stage_with_the_one_before_not_with_the_start(tmp_path):
    model = tiny_model(tiny_tokenizer())
    tracker = drift.DriftTracker(model, tmp_path / "none.json")
    weight = dict(model.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    with torch.no_grad():
        weight[0, :5] += 1.0
    first = tracker.measure()
    with torch.no_grad():
        weight[1, :3] += 1.0
    second = tracker.measure()
    assert first["params"]["changed"] == 5 and second["params"]["changed"] == 3  # not 8: the baseline moved
    assert "kl" not in first  # no start samples were kept
    model.model.layers[1].requires_grad_(False)  # frozen weights are neither copied nor counted
    assert drift.DriftTracker(model, tmp_path / "none.json").measure()["params"]["total"] < second["params"]["total"]


def test_the_report_shows_drift_and_turnover(finished):
    report = (finished / "report.md").read_text()
    assert "## Forgetting beyond success" in report
    assert "## Correct-set turnover" in report
    drift_lines = report.split("## Forgetting beyond success")[1].split("##")[0]
    assert "| 1 " in drift_lines and "| 2 " in drift_lines and "%" in drift_lines
    turnover = analyse(finished, resamples=50).turnover
    assert turnover is not None and len(turnover) == 3
    assert all(turnover[s][name].tasks == 4 for s in (1, 2) for name in TEST)


def test_drift_can_be_switched_off(base_model, tmp_path):
    out = tmp_path / "run"
    run(experiment(base_model, out, drift=False), show_progress=False)
    assert all("drift" not in row for row in rows(out))
    assert not (out / "drift-start.json").exists()
    assert "## Forgetting beyond success" not in (out / "report.md").read_text()


# --- what the report and the diagnostics read from a run ----------------------------------------


def test_plan_records_each_test_experiences_turn_limit(finished, base_model, tmp_path):
    plan = json.loads((finished / "plan.json").read_text())
    assert plan["turn_limits"] == {"magic:easy": 3, "magic-berry:easy": 3, "magic:hard": 1}
    forced = experiment(base_model, tmp_path / "forced", max_turns=2)
    from contrail.experiment import build_stream
    from contrail.runner import turn_limits

    assert turn_limits(forced, build_stream(forced)) == dict.fromkeys(TEST, 2)


def test_out_of_turns_is_counted_with_the_plans_turn_limits(finished):
    """`magic` has no default limit in the diagnostics: only plan.json's turn_limits can tag these episodes."""
    analysis = analyse(finished, resamples=50)
    failed = [r for r in records(finished, 0)
              if r["experience"] == "magic:easy" and not r["success"] and not r["truncated"] and r["turns"] == 3]
    assert failed, "the start model should fail some easy tasks by running out of its 3 turns"
    column = TEST.index("magic:easy")
    assert analysis.failures.counts[0][column]["out_of_turns"] == len(failed)


def test_trajectory_records_name_their_experience(finished):
    for stage in (0, 1, 2):
        found = records(finished, stage)
        assert [r["experience"] for r in found].count("magic:hard") == 4 * 2
        assert all(r["task"]["difficulty"] == r["experience"].split(":")[1] for r in found)


def test_ambiguous_experiences_are_told_apart_by_the_record(base_model, tmp_path):
    """``magic`` and ``magic:easy`` share tasks: without the record's key both would claim every easy episode."""
    exp = experiment(base_model, tmp_path / "run")
    exp = replace(exp, stream=replace(exp.stream, test=["magic", "magic:easy"], test_tasks=2),
                  grpo=replace(exp.grpo, lr=1e-3), eval=EvalSpec(k=1, drift=False))
    exp = replace(exp, stream=replace(exp.stream, train=["magic:easy"], steps_per_experience=1))
    result = run(exp, show_progress=False)
    found = records(result.path, 0)
    assert sorted(r["experience"] for r in found) == ["magic", "magic", "magic:easy", "magic:easy"]
    grouped = {name: [r for r in found if r["experience"] == name] for name in ("magic", "magic:easy")}
    for name, group in grouped.items():
        assert result.rows[0]["results"][name]["tasks"] == len(group)


# --- the rollout records validity -------------------------------------------------------------------


class Replies:
    """A backend that says the same fixed texts in every episode."""

    def __init__(self, tokenizer, chat, replies):
        self.tokenizer, self.chat, self.replies, self.calls = tokenizer, chat, list(replies), 0

    def generate(self, prompts, params):
        ids = self.tokenizer(self.replies[self.calls], add_special_tokens=False)["input_ids"]
        self.calls += 1
        ids += [self.chat.assistant_close_ids[0]]
        return [Generation(ids, [-0.5] * len(ids), stopped=True) for _ in prompts]


def test_each_model_turn_records_the_environments_validity_verdict():
    tokenizer = tiny_tokenizer()
    chat = ChatFormat.from_tokenizer(tokenizer)
    task = MagicWordEnv().tasks("test", "easy")[0]
    [traj] = rollout(Replies(tokenizer, chat, ["hello", "grape", "lemon"]), chat, [task], lambda t: MagicWordEnv())
    record = json.loads(json.dumps(traj.to_record()))  # still JSON-able
    said = [m for m in record["messages"] if m["role"] == "assistant"]
    assert [m.get("valid") for m in said] == [None, False, True, True]  # the prompt's example turn: no verdict
    # MagicWordEnv has no diagnostics rule and 1 invalid of 3 settles nothing: only the flags tell.
    assert turn_validity(record) == [False, True, True]
