"""Forgetting beyond success: the KL estimators against a KL known in closed form, parameter change, turnover."""

import math
from types import SimpleNamespace

import pytest
import torch

from contrail.agent.rollout import Trajectory
from contrail.drift import (
    Samples,
    drift_row,
    kl_from_logprobs,
    kl_to_start,
    load_samples,
    parameter_change,
    policy_kl,
    save_samples,
    start_samples,
    task_successes,
    turnover,
)
from contrail.envs.base import Task
from contrail.testing import tiny_model, tiny_tokenizer


class ConstantLM(torch.nn.Module):
    """Predicts the same next-token distribution softmax(logits) at every position: KL is known exactly."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.tensor(logits, dtype=torch.float64))

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.logits.expand(*input_ids.shape, -1))


def closed_form_kl(a, b):
    p = torch.softmax(torch.tensor(a, dtype=torch.float64), -1)
    q = torch.softmax(torch.tensor(b, dtype=torch.float64), -1)
    return float((p * (p.log() - q.log())).sum())


def test_estimates_match_a_known_kl():
    a, b = [2.0, 0.0, -1.0, 0.5], [0.0, 1.0, 0.0, -0.5]
    truth = closed_form_kl(a, b)  # 0.777 nats
    p, q = ConstantLM(a), ConstantLM(b)
    generator = torch.Generator().manual_seed(0)
    sequences = torch.multinomial(torch.softmax(torch.tensor(a), -1), 200 * 50, replacement=True,
                                  generator=generator).reshape(200, 50)
    masks = torch.ones_like(sequences)
    masks[:, :5] = 0  # a prompt: not sampled, not scored
    estimate = policy_kl(p, q, sequences, masks, batch_size=64)
    assert estimate.tokens == 200 * 45 and estimate.sequences == 200
    assert estimate.exact == pytest.approx(truth, rel=1e-9)  # every position has the same distribution
    for value, se in ((estimate.k1, estimate.se_k1), (estimate.k3, estimate.se_k3)):
        assert abs(value - truth) < 4 * se and se < 0.05
    # only log p of the sampled tokens, as the start model's sampler records them
    logp = torch.log_softmax(torch.tensor(a, dtype=torch.float64), -1)[sequences] * masks
    again = kl_from_logprobs(q, sequences.tolist(), masks.tolist(), logp.tolist(), batch_size=7)
    assert again.k1 == pytest.approx(estimate.k1) and again.k3 == pytest.approx(estimate.k3)
    assert math.isnan(again.exact)


def test_tiny_models_exact_kl_and_identical_models():
    tokenizer = tiny_tokenizer()
    p, q = tiny_model(tokenizer, seed=0).eval(), tiny_model(tokenizer, seed=1).eval()
    sequences = [[5, 9, 12, 7, 30], [4, 8, 15]]
    masks = [[0, 0, 1, 1, 1], [0, 1, 1]]
    estimate = policy_kl(p, q, sequences, masks, batch_size=1)
    # batched with right padding and in chunks of 3 positions: the same numbers (up to float noise)
    chunked = policy_kl(p, q, sequences, masks, batch_size=2, chunk_rows=3)
    assert chunked.to_dict() == pytest.approx(estimate.to_dict(), rel=1e-5)
    # the exact term by hand: full-vocabulary KL at the scored positions 2, 3, 4 and 1, 2
    total = 0.0
    with torch.no_grad():
        for ids, mask in zip(sequences, masks):
            x = torch.tensor([ids])
            lp = torch.log_softmax(p(input_ids=x).logits[0].double(), -1)
            lq = torch.log_softmax(q(input_ids=x).logits[0].double(), -1)
            scored = [t for t in range(1, len(ids)) if mask[t]]
            total += sum(float((lp[t - 1].exp() * (lp[t - 1] - lq[t - 1])).sum()) for t in scored)
    assert estimate.tokens == 5 and estimate.exact == pytest.approx(total / 5, rel=1e-6)
    assert estimate.k3 >= 0 and estimate.k2 >= 0
    same = policy_kl(p, p, sequences, masks)
    assert same.k1 == same.k2 == same.k3 == 0.0 and same.exact == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="mask has"):
        policy_kl(p, q, [[1, 2, 3]], [[1, 1]])


def test_parameter_change_counts_elements_beyond_the_tolerance():
    shared = torch.zeros(3)
    before = {"w": torch.zeros(2, 2), "b": torch.ones(4), "tied": shared, "tied_too": shared,
              "steps": torch.tensor([3])}
    after = {"w": torch.tensor([[0.0, 0.1], [0.0, 1e-6]]), "b": torch.tensor([1.0, 1.0, 1.5, 1.0]),
             "tied": torch.tensor([0.0, 2.0, 0.0]), "steps": torch.tensor([9])}
    after["tied_too"] = after["tied"]  # one tensor under two names counts once
    exact = parameter_change(before, after)
    assert (exact.changed, exact.total) == (4, 11)  # w: 2, b: 1, tied: 1; the integer buffer is skipped
    loose = parameter_change(before, after, atol=1e-3)
    assert loose.changed == 3 and loose.fraction == pytest.approx(3 / 11)
    assert parameter_change(before, after, rtol=0.6, atol=1e-3).changed == 2  # b's +0.5 is within 60% of 1
    with pytest.raises(ValueError, match="differ in their names"):
        parameter_change(before, {"w": after["w"]})


def test_turnover_from_per_task_successes():
    def rec(task_id, success):
        return {"task": {"env": "a", "id": task_id, "split": "test"}, "success": success}

    before = task_successes([rec(0, True), rec(0, True), rec(1, True), rec(1, False), rec(2, False), rec(2, False),
                             rec(3, True), rec(3, True)])
    after = task_successes([rec(0, False), rec(0, False), rec(1, True), rec(1, True), rec(2, True), rec(2, False),
                            rec(4, True)])
    assert before[("a", 1, "test")] == 0.5
    result = turnover(before, after)  # 0: lost; 1: kept (0.5 counts as solved); 2: gained; 3, 4: not in both
    assert result.to_dict() == {"lost": 1, "gained": 1, "kept": 1, "never": 0, "tasks": 3}
    # at 0.75, task 1 (0.5 -> 1.0) is gained and task 2 (0 -> 0.5) never solved
    assert turnover(before, after, threshold=0.75).to_dict() == {"lost": 1, "gained": 1, "kept": 0, "never": 1,
                                                                 "tasks": 3}


def test_drift_row_shape():
    row = drift_row(params=parameter_change({"w": torch.zeros(2)}, {"w": torch.ones(2)}))
    assert row == {"params": {"changed": 2, "total": 2, "fraction": 1.0, "atol": 0.0, "rtol": 0.0}}


def test_start_samples_round_trip_and_kl_to_start(tmp_path):
    a, b = [1.0, 0.0, -1.0], [0.0, 0.5, 0.0]
    logp = torch.log_softmax(torch.tensor(a, dtype=torch.float64), -1)
    generator = torch.Generator().manual_seed(1)
    trajectories = []
    for i in range(60):
        ids = torch.multinomial(logp.exp(), 30, replacement=True, generator=generator).tolist()
        mask = [0, 0] + [1] * 28
        trajectories.append(Trajectory(Task("x", i, "test", "easy"), ids, mask,
                                       [float(logp[t]) * m for t, m in zip(ids, mask)], []))
    trajectories.append(Trajectory(Task("x", 99, "test", "easy"), [], [], [], []))  # failed at reset: no samples
    samples = start_samples({"x:easy": trajectories})
    assert len(samples["x:easy"].ids) == 60
    save_samples(tmp_path / "start.json", samples)
    loaded = load_samples(tmp_path / "start.json")
    assert loaded == samples and isinstance(loaded["x:easy"], Samples)
    result = kl_to_start(ConstantLM(b), loaded)["x:easy"]
    assert abs(result.k3 - closed_form_kl(a, b)) < 4 * result.se_k3
    assert start_samples({"x:easy": trajectories}, per_experience=5)["x:easy"].ids == samples["x:easy"].ids[:5]
