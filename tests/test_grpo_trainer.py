"""GRPOTrainer end to end on tiny local models and a tiny environment."""

from __future__ import annotations

import json
import random

import pytest
import torch

from contrail.agent import ChatFormat, HFBackend, RolloutConfig, rollout
from contrail.grpo.config import GRPOConfig
from contrail.grpo.trainer import GRPOTrainer
from contrail.testing import MagicWordEnv, tiny_model, tiny_tokenizer


class CyclingSampler:
    """Seeded task sampler with resumable state (the strategies module has the real one)."""

    def __init__(self, tasks, seed=0):
        self.tasks, self.rng = list(tasks), random.Random(seed)

    def sample(self, n):
        return [self.rng.choice(self.tasks) for _ in range(n)]

    def state_dict(self):
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state):
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))


def make_env(task):
    return MagicWordEnv()


def train_tasks():
    return MagicWordEnv().tasks("train", "easy")


def success_rate(model, tokenizer, episodes=96, seed=123):
    chat = ChatFormat.from_tokenizer(tokenizer)
    backend = HFBackend(model, chat.stop_ids, tokenizer.pad_token_id, seed=seed)
    tasks = (MagicWordEnv().tasks("test", "easy") * 10)[:episodes]
    trajs = rollout(backend, chat, tasks, make_env, RolloutConfig(max_new_tokens=3, max_episode_tokens=256))
    return sum(t.success for t in trajs) / len(trajs)


def test_grpo_learns_the_magic_word(tmp_path):
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    model = tiny_model(tokenizer, hidden_size=32, seed=0)
    before = success_rate(model, tokenizer)
    config = GRPOConfig(lr=2e-2, group_size=8, tasks_per_step=4, max_new_tokens=3, max_episode_tokens=256,
                        seed=0, warmup_steps=0)
    trainer = GRPOTrainer(model, tokenizer, config, make_env, log_dir=tmp_path, show_progress=False)
    history = trainer.train(CyclingSampler(train_tasks()), steps=30)
    after = success_rate(trainer.model, tokenizer)
    assert after > before + 0.4, (before, after)
    assert history[-1]["success_rate"] > history[0]["success_rate"]
    logged = [json.loads(line) for line in open(tmp_path / "grpo_log.jsonl")]
    assert len(logged) == 30
    updated = [entry for entry in logged if "skipped_update" not in entry]
    assert updated, "no step had a group with different rewards"
    for key in ("reward_mean", "loss", "clip_fraction", "kl_mean", "entropy_mean", "grad_norm",
                "rollout_seconds", "update_seconds", "turns_mean", "generated_tokens"):
        assert key in updated[-1], key


@pytest.mark.parametrize("lora", [False, True])
def test_every_trainable_parameter_changes(lora):
    if lora:
        pytest.importorskip("peft")
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, seed=2)
    config = GRPOConfig(lr=1e-2, group_size=4, tasks_per_step=4, max_new_tokens=3, lora=lora, lora_r=4,
                        skip_zero_advantage=False, beta=0.1 if lora else 0.0)
    trainer = GRPOTrainer(model, tokenizer, config, make_env, show_progress=False)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    sampler = CyclingSampler(train_tasks())
    steps = 0
    while steps < 2 or any(torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters()
                           if p.requires_grad):
        # LoRA's A matrices get their first gradient one step after B leaves zero.
        stats = trainer.step(sampler)
        steps += "skipped_update" not in stats
        assert steps < 6, "some parameters never changed"
    for name, parameter in trainer.model.named_parameters():
        if parameter.requires_grad:
            assert not torch.equal(parameter.detach(), before[name]), name
        elif lora:
            assert "lora_" not in name


def test_first_update_has_ratio_one_and_reference_kl_starts_at_zero():
    tokenizer = tiny_tokenizer()
    config = GRPOConfig(lr=1e-3, group_size=4, tasks_per_step=4, max_new_tokens=3, beta=0.05,
                        skip_zero_advantage=False)
    trainer = GRPOTrainer(tiny_model(tokenizer, seed=3), tokenizer, config, make_env, show_progress=False)
    rewards = [1.0, 0.0, 0.0, 0.0] * 4  # every group has signal
    trainer._rollouts = lambda tasks: [_fake_traj(tokenizer, r) for r in rewards]
    stats = trainer.step(CyclingSampler(train_tasks()))
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert stats["clip_fraction"] == 0.0
    assert stats["kl_mean"] == pytest.approx(0.0, abs=1e-6)
    later = trainer.step(CyclingSampler(train_tasks(), seed=1))
    assert later["kl_mean"] > 0  # the policy moved away from the frozen reference


def test_groups_with_equal_rewards_are_skipped():
    tokenizer = tiny_tokenizer()
    config = GRPOConfig(group_size=2, tasks_per_step=2, max_new_tokens=2, max_turns=1)
    trainer = GRPOTrainer(tiny_model(tokenizer, seed=4), tokenizer, config, make_env, show_progress=False)
    trainer._rollouts = lambda tasks: [_fake_traj(tokenizer, 0.0) for _ in range(4)]
    stats = trainer.step(CyclingSampler(train_tasks()))
    assert stats["skipped_update"] == 1.0 and stats["trained_episodes"] == 0


def _fake_traj(tokenizer, reward):
    from contrail.agent.rollout import Trajectory
    from contrail.envs.base import Task

    ids = tokenizer("say the word . apple", add_special_tokens=False)["input_ids"]
    return Trajectory(Task("magic", 0, "train", "easy"), ids, [0, 0, 0, 0, 1], [0.0] * 5, [], reward=reward)


def test_resume_continues_the_same_task_sequence_and_weights(tmp_path):
    tokenizer = tiny_tokenizer()
    config = GRPOConfig(lr=1e-2, group_size=4, tasks_per_step=2, max_new_tokens=3, seed=5)

    def fresh(model=None):
        return GRPOTrainer(model or tiny_model(tokenizer, seed=6), tokenizer, config, make_env, show_progress=False)

    straight, sampler = fresh(), CyclingSampler(train_tasks(), seed=9)
    straight_stats = [straight.step(sampler) for _ in range(4)]

    first, sampler = fresh(), CyclingSampler(train_tasks(), seed=9)
    for _ in range(2):
        first.step(sampler)
    first.save(tmp_path / "ckpt", sampler=sampler)

    from contrail.models import load_model

    model, _ = load_model(str(tmp_path / "ckpt"))
    resumed, sampler = fresh(model), CyclingSampler(train_tasks(), seed=0)
    resumed.load_state(tmp_path / "ckpt", sampler=sampler)
    resumed_stats = [resumed.step(sampler) for _ in range(2)]
    assert [s["reward_mean"] for s in resumed_stats] == [s["reward_mean"] for s in straight_stats[2:]]
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.allclose(a, b, atol=1e-5)


def test_config_rejects_bad_combinations():
    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match="aggregation"):
        GRPOConfig(aggregation="sum")
    with pytest.raises(ValueError, match="minibatches"):
        GRPOConfig(group_size=2, tasks_per_step=1, minibatches=3)
    with pytest.raises(ValueError, match="temperature"):
        GRPOConfig(temperature=0)
    with pytest.raises(ValueError, match="precision"):
        GRPOConfig(precision="fp8")


def test_bf16_autocast_step_trains_fp32_master_weights():
    tokenizer = tiny_tokenizer()
    config = GRPOConfig(lr=1e-2, group_size=4, tasks_per_step=2, max_new_tokens=3, precision="bf16",
                        skip_zero_advantage=False)
    trainer = GRPOTrainer(tiny_model(tokenizer, seed=8), tokenizer, config, make_env, show_progress=False)
    trainer._rollouts = lambda tasks: [_fake_traj(tokenizer, r) for r in [1.0, 0.0, 0.0, 1.0] * 2]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    stats = trainer.step(CyclingSampler(train_tasks()))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert stats["grad_norm"] > 0 and any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_several_updates_per_batch_use_the_rollout_policy_as_old():
    tokenizer = tiny_tokenizer()
    config = GRPOConfig(lr=5e-2, group_size=4, tasks_per_step=2, max_new_tokens=3, ppo_epochs=2, minibatches=2,
                        skip_zero_advantage=False)
    trainer = GRPOTrainer(tiny_model(tokenizer, seed=9), tokenizer, config, make_env, show_progress=False)
    trainer._rollouts = lambda tasks: [_fake_traj(tokenizer, r) for r in [1.0, 0.0, 0.0, 1.0] * 2]
    stats = trainer.step(CyclingSampler(train_tasks()))
    assert stats["micro_batches"] >= 1
    # Four optimizer steps on one batch: later ones see a moved policy, so the mean ratio leaves 1.
    assert stats["ratio_mean"] != pytest.approx(1.0, abs=1e-7)
