"""The continual-learning strategies kl_anchor and ewc, end to end on the tiny model.

The stream is ``magic`` then ``magic-berry`` (contrail.testing): the same
question, a different winning word. Each test drives the loop the runner
drives (plan, before_stage, train on the stage's sampler, after_stage).
"""

from __future__ import annotations

import functools

import pytest
import torch

from contrail import strategies
from contrail.agent.rollout import RolloutConfig
from contrail.grpo.config import GRPOConfig
from contrail.grpo.trainer import GRPOTrainer
from contrail.stream import Stream, env_factory
from contrail.testing import tiny_model, tiny_tokenizer

ROLLOUT = RolloutConfig(max_new_tokens=3, max_episode_tokens=256)
STEPS = 3
SEED = 2  # a rollout seed whose random-model episodes give both stages a reward signal before their last step


def stream():
    return Stream.from_specs(["magic:easy", "magic-berry:easy"], train_tasks=6, test_tasks=2)


def make_trainer(the_stream, seed=0, lr=2e-2):
    tokenizer = tiny_tokenizer()
    # skip_zero_advantage=False: every step updates, so "the first update of a stage" is step 1.
    config = GRPOConfig(lr=lr, group_size=8, tasks_per_step=2, skip_zero_advantage=False)
    return GRPOTrainer(tiny_model(tokenizer, seed=0), tokenizer, config, ROLLOUT, env_factory(the_stream.experiences),
                       seed=seed, show_progress=False)


@functools.cache
def run_stages(name, seed=SEED, **options):
    """Train the two-stage stream like the runner; return the trainer, each stage's history and anchors."""
    the_stream = stream()
    strategy = strategies.make(name, steps_per_experience=STEPS, **options)
    trainer = make_trainer(the_stream, seed)
    history, anchors = {}, {}
    for stage in strategy.plan(the_stream, seed=seed):
        anchors[stage.index] = [p.detach().clone() for p in trainer.model.parameters()]
        strategy.before_stage(stage, trainer)
        history[stage.index] = trainer.train(strategies.stage_sampler(stage, the_stream), stage.steps)
        strategy.after_stage(stage, trainer)
    return trainer, history, anchors


def distance(trainer, anchor):
    return float(sum((p.detach() - a).pow(2).sum() for p, a in zip(trainer.model.parameters(), anchor)).sqrt())


# --- kl_anchor ----------------------------------------------------------------------------


def test_kl_anchor_is_zero_at_the_snapshot_and_positive_once_the_policy_moved():
    _, history, _ = run_stages("kl_anchor", beta=5.0)
    for stage in (1, 2):
        steps = history[stage]
        assert steps[0]["anchor_kl"] == pytest.approx(0.0, abs=1e-6), stage  # the first update is at the snapshot
        # The policy moves once a step had a reward signal (the KL's own gradient is 0 at the snapshot).
        moved = [i for i in range(1, len(steps)) if any(s["advantage_abs_mean"] > 0 for s in steps[:i])]
        assert moved, "no step had a reward signal"
        assert all(steps[i]["anchor_kl"] > 0 for i in moved), (stage, [s["anchor_kl"] for s in steps])


def test_kl_anchor_adds_beta_times_the_kl_to_the_loss_and_pulls_towards_the_anchor():
    beta = 5.0
    plain, plain_history, plain_anchors = run_stages("kl_anchor", beta=0.0)
    held, held_history, held_anchors = run_stages("kl_anchor", beta=beta)
    # The KL's gradient is 0 while the policy is at the snapshot, so both runs stay identical up to the
    # first step with a KL, and sample the same episodes there: the losses differ by exactly beta * KL.
    steps, plain_steps = held_history[1] + held_history[2], plain_history[1] + plain_history[2]
    first = next(i for i, step in enumerate(steps) if step["anchor_kl"] > 0)
    assert steps[first]["reward_mean"] == plain_steps[first]["reward_mean"]
    assert steps[first]["anchor_kl"] == pytest.approx(plain_steps[first]["anchor_kl"], rel=1e-4)
    assert steps[first]["loss"] == pytest.approx(plain_steps[first]["loss"] + beta * steps[first]["anchor_kl"],
                                                 rel=1e-4, abs=1e-6)
    # At the end of stage 2 the anchored policy is closer to its anchor (the stage-1 policy).
    assert held_history[2][-1]["anchor_kl"] < plain_history[2][-1]["anchor_kl"]
    assert distance(held, held_anchors[2]) < distance(plain, plain_anchors[2])


def test_kl_anchor_snapshot_after_a_resume_is_the_loaded_model(tmp_path):
    """before_stage copies the model the trainer holds: after a resume, the last finished stage's weights."""
    from contrail.models import load_model

    the_stream = stream()
    strategy = strategies.make("kl_anchor", beta=0.5, steps_per_experience=2)
    trainer = make_trainer(the_stream)
    first, second = strategy.plan(the_stream, seed=0)
    strategy.before_stage(first, trainer)
    trainer.train(strategies.stage_sampler(first, the_stream), first.steps)
    strategy.after_stage(first, trainer)
    trainer.save(tmp_path / "stage-01")

    model, tokenizer = load_model(str(tmp_path / "stage-01" / "model"))
    resumed = GRPOTrainer(model, tokenizer, trainer.config, ROLLOUT, env_factory(the_stream.experiences),
                          show_progress=False)
    resumed.load_state(tmp_path / "stage-01")
    strategy = strategies.make("kl_anchor", beta=0.5, steps_per_experience=2)
    strategy.plan(the_stream, seed=0)
    strategy.before_stage(second, resumed)
    for a, b in zip(trainer.model.parameters(), strategy.anchor.parameters()):
        assert torch.equal(a, b)  # the anchor is the first stage's final policy
    stats = resumed.step(strategies.stage_sampler(second, the_stream))
    assert stats["anchor_kl"] == pytest.approx(0.0, abs=1e-6)
    strategy.after_stage(second, resumed)
    assert strategy.anchor is None  # released: no memory held during evaluation


# --- ewc ------------------------------------------------------------------------------------


def test_ewc_penalty_starts_in_stage_two_at_zero_and_grows():
    _, history, _ = run_stages("ewc", lam=1e4, fisher_tasks=2)
    assert all("ewc_penalty" not in step for step in history[1])  # nothing to protect in stage 1
    steps = history[2]
    assert steps[0]["ewc_penalty"] == 0.0
    moved = [i for i in range(1, len(steps)) if any(s["advantage_abs_mean"] > 0 for s in steps[:i])]
    assert moved, "no step of stage 2 had a reward signal"
    assert all(steps[i]["ewc_penalty"] > 0 for i in moved), [s["ewc_penalty"] for s in steps]


def test_ewc_adds_its_penalty_to_the_loss_and_pulls_weights_towards_the_previous_stage():
    lam = 1e4
    plain, plain_history, plain_anchors = run_stages("ewc", lam=0.0, fisher_tasks=2)
    held, held_history, held_anchors = run_stages("ewc", lam=lam, fisher_tasks=2)
    assert all(torch.equal(a, b) for a, b in zip(plain_anchors[2], held_anchors[2]))  # same stage 1
    # The penalty and its gradient are 0 at theta*, so both runs stay identical up to the first step with
    # a penalty, and sample the same episodes there.
    steps, plain_steps = held_history[2], plain_history[2]
    first = next(i for i, step in enumerate(steps) if step["ewc_penalty"] > 0)
    assert steps[first]["reward_mean"] == plain_steps[first]["reward_mean"] and plain_steps[first]["ewc_penalty"] == 0
    assert steps[first]["loss"] == pytest.approx(plain_steps[first]["loss"] + steps[first]["ewc_penalty"],
                                                 rel=1e-4, abs=1e-6)
    assert distance(held, held_anchors[2]) < distance(plain, plain_anchors[2])


def test_ewc_fisher_is_the_mean_squared_gradient_of_the_episode_log_likelihood():
    from contrail.strategies.ewc import diagonal_fisher
    from contrail.train.logprobs import sequence_logprobs
    from contrail.train.trainer import Sample, collate

    the_stream = stream()
    trainer = make_trainer(the_stream)
    episodes = trainer.collect(the_stream.train[0].train_tasks[:1])
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    fisher = diagonal_fisher(trainer, episodes, params)
    expected = [torch.zeros_like(p) for p in params]
    for episode in episodes:  # the definition, with .backward() instead of autograd.grad
        trainer.model.zero_grad()
        batch = collate([Sample(episode.ids, episode.mask)], trainer.tokenizer.pad_token_id, torch.device("cpu"))
        (sequence_logprobs(trainer.model, batch.input_ids, batch.attention_mask) * batch.loss_mask).sum().backward()
        for e, p in zip(expected, params):
            e += p.grad.pow(2) / len(episodes)
    for f, e in zip(fisher, expected):
        assert torch.allclose(f, e, rtol=1e-4, atol=1e-10)
    assert sum(float(f.sum()) for f in fisher) > 0


def test_ewc_before_stage_needs_the_plan():
    trainer = make_trainer(stream())
    strategy = strategies.make("ewc")
    stages = strategies.make("sequential").plan(stream(), seed=0)
    with pytest.raises(RuntimeError, match="plan\\(\\) must run before"):
        strategy.before_stage(stages[1], trainer)
    with pytest.raises(ValueError, match="lam must be >= 0"):
        strategies.make("ewc", lam=-1.0)
    with pytest.raises(ValueError, match="beta must be a finite number"):
        strategies.make("kl_anchor", beta=float("nan"))
