"""GRPOTrainer end to end on tiny local models and a tiny environment, through its public API."""

from __future__ import annotations

import json
import random

import pytest
import torch

from contrail.agent import ChatFormat, HFBackend, RolloutConfig, Trajectory, rollout
from contrail.envs.base import Task
from contrail.grpo.config import GRPOConfig
from contrail.grpo.trainer import GRPOTrainer, TooManyEpisodeErrors
from contrail.testing import MagicWordEnv, fed_widths, tiny_model, tiny_tokenizer
from contrail.train import checkpointed_prefix
from contrail.train.trainer import CheckpointError, NonFiniteError


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


ROLLOUT = RolloutConfig(max_new_tokens=3, max_episode_tokens=256)


def grpo(model, tokenizer, config, rollout=ROLLOUT, seed=0, **kwargs):
    return GRPOTrainer(model, tokenizer, config, rollout, make_env, seed=seed, show_progress=False, **kwargs)


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
    config = GRPOConfig(lr=2e-2, group_size=8, tasks_per_step=4, warmup_steps=0)
    trainer = grpo(model, tokenizer, config, log_dir=tmp_path)
    history = trainer.train(CyclingSampler(train_tasks()), steps=30)
    after = success_rate(trainer.model, tokenizer)
    assert after > before + 0.4, (before, after)
    assert history[-1]["success_rate"] > history[0]["success_rate"]
    logged = [json.loads(line) for line in (tmp_path / "grpo_log.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in logged] == list(range(1, 31))
    updated = [entry for entry in logged if "skipped_update" not in entry]
    assert updated, "no step had a group with different rewards"
    for key in ("reward_mean", "loss", "clip_fraction", "kl_mean", "entropy_mean", "grad_norm",
                "rollout_seconds", "update_seconds", "turns_mean", "generated_tokens"):
        assert key in updated[-1], key


def test_a_step_reports_the_share_of_its_turns_cut_at_the_token_limit():
    tokenizer = tiny_tokenizer()
    trainer = grpo(tiny_model(tokenizer, seed=3), tokenizer, GRPOConfig(lr=1e-3, group_size=4, tasks_per_step=4))
    played = []
    trainer.add_trajectory_editor(lambda trajectories, _: played.extend(trajectories) or trajectories)
    stats = trainer.step(CyclingSampler(train_tasks()))
    cut, turns = sum(t.cut_turns for t in played), sum(t.turns for t in played)
    assert 0 < cut < turns  # a random model rarely ends a turn within 3 tokens, but sometimes does
    assert stats["cut_rate"] == pytest.approx(cut / turns)


@pytest.mark.parametrize("lora", [False, True])
def test_every_trainable_parameter_changes(lora):
    if lora:
        pytest.importorskip("peft")
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, seed=2)
    config = GRPOConfig(lr=1e-2, group_size=4, tasks_per_step=4, lora=lora, lora_r=4,
                        skip_zero_advantage=False, beta=0.1 if lora else 0.0)
    trainer = grpo(model, tokenizer, config)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    sampler = CyclingSampler(train_tasks())
    steps = 0
    while steps < 2 or any(torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters()
                           if p.requires_grad):
        # LoRA's A matrices get their first gradient one step after B leaves zero.
        trajectories = trainer.collect(sampler.sample(config.tasks_per_step))
        for index, trajectory in enumerate(trajectories):
            trajectory.reward = float(index % 3 == 0)  # signal in every group, whatever the random model said
        stats = trainer.update(trajectories)
        steps += "skipped_update" not in stats
        assert steps < 6, "some parameters never changed"
    for name, parameter in trainer.model.named_parameters():
        if parameter.requires_grad:
            assert not torch.equal(parameter.detach(), before[name]), name
        elif lora:
            assert "lora_" not in name


def test_first_update_has_ratio_one_and_reference_kl_starts_at_zero():
    tokenizer = tiny_tokenizer()
    config = GRPOConfig(lr=1e-3, group_size=4, tasks_per_step=4, beta=0.05, skip_zero_advantage=False)
    trainer = grpo(tiny_model(tokenizer, seed=3), tokenizer, config)
    rewards = [1.0, 0.0, 0.0, 0.0] * 4  # every group has signal
    stats = trainer.update(fake_groups(tokenizer, rewards))
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert stats["clip_fraction"] == 0.0
    assert stats["kl_mean"] == pytest.approx(0.0, abs=1e-6)
    later = trainer.update(fake_groups(tokenizer, rewards))
    assert later["kl_mean"] > 0  # the policy moved away from the frozen reference
    assert trainer.step_count == 2


def test_groups_with_equal_rewards_are_skipped():
    tokenizer = tiny_tokenizer()
    config = GRPOConfig(group_size=2, tasks_per_step=2)
    trainer = grpo(tiny_model(tokenizer, seed=4), tokenizer, config)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    stats = trainer.update(fake_groups(tokenizer, [0.0] * 4, group_size=2))
    assert stats["skipped_update"] == 1.0 and stats["trained_episodes"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def fake_traj(tokenizer, reward, task_id=0, error=None, word="apple"):
    ids = tokenizer(f"say the word . {word}", add_special_tokens=False)["input_ids"]
    return Trajectory(Task("magic", task_id, "train", "easy"), ids, [0, 0, 0, 0, 1], [0.0] * 5, [], reward=reward,
                      error=error)


def fake_groups(tokenizer, rewards, group_size=4, errors=()):
    """Trajectories in groups of ``group_size`` (one task per group); indices in ``errors`` raised."""
    return [fake_traj(tokenizer, r, task_id=i // group_size, error="ValueError: boom" if i in errors else None)
            for i, r in enumerate(rewards)]


def test_resume_continues_the_same_task_sequence_and_weights(tmp_path):
    tokenizer = tiny_tokenizer()
    config = GRPOConfig(lr=1e-2, group_size=4, tasks_per_step=2)

    def fresh(model=None):
        return grpo(model or tiny_model(tokenizer, seed=6), tokenizer, config, seed=5)

    straight, sampler = fresh(), CyclingSampler(train_tasks(), seed=9)
    straight_stats = [straight.step(sampler) for _ in range(4)]

    first, sampler = fresh(), CyclingSampler(train_tasks(), seed=9)
    for _ in range(2):
        first.step(sampler)
    first.save(tmp_path / "ckpt", sampler=sampler)

    from contrail.models import load_model

    model, _ = load_model(str(tmp_path / "ckpt"))
    resumed, sampler = fresh(model), CyclingSampler(train_tasks(), seed=0)
    assert resumed.load_state(tmp_path / "ckpt", sampler=sampler) == {}
    assert resumed.step_count == 2
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
    with pytest.raises(ValueError, match="precision"):
        GRPOConfig(precision="fp8")


def test_bf16_autocast_step_trains_fp32_master_weights():
    tokenizer = tiny_tokenizer()
    config = GRPOConfig(lr=1e-2, group_size=4, tasks_per_step=2, precision="bf16", skip_zero_advantage=False)
    trainer = grpo(tiny_model(tokenizer, seed=8), tokenizer, config)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    stats = trainer.update(fake_groups(tokenizer, [1.0, 0.0, 0.0, 1.0] * 2))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert stats["grad_norm"] > 0 and any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_several_updates_per_batch_use_the_rollout_policy_as_old():
    tokenizer = tiny_tokenizer()
    config = GRPOConfig(lr=5e-2, group_size=4, tasks_per_step=2, ppo_epochs=2, minibatches=2,
                        skip_zero_advantage=False)
    trainer = grpo(tiny_model(tokenizer, seed=9), tokenizer, config)
    stats = trainer.update(fake_groups(tokenizer, [1.0, 0.0, 0.0, 1.0] * 2))
    assert stats["micro_batches"] >= 1
    # Four optimizer steps on one batch: later ones see a moved policy, so the mean ratio leaves 1.
    assert stats["ratio_mean"] != pytest.approx(1.0, abs=1e-7)


# --- the public seams -------------------------------------------------------------------


def test_collect_plays_whole_groups_in_task_order():
    tokenizer = tiny_tokenizer()
    trainer = grpo(tiny_model(tokenizer, seed=10), tokenizer, GRPOConfig(group_size=3, tasks_per_step=2))
    tasks = train_tasks()[:2]
    trajectories = trainer.collect(tasks)
    assert [t.task for t in trajectories] == [tasks[0]] * 3 + [tasks[1]] * 3
    assert [t.sample for t in trajectories] == [0, 1, 2, 0, 1, 2]
    assert all(sum(t.mask) > 0 for t in trajectories)


def test_a_step_of_more_than_64_episodes_keeps_its_kv_cache_across_turns():
    """A step's episodes play as one batch whose histories are prefilled once, however many there are."""
    tokenizer = tiny_tokenizer()
    trainer = grpo(tiny_model(tokenizer, seed=10), tokenizer, GRPOConfig(group_size=4, tasks_per_step=20),
                   rollout=RolloutConfig(max_new_tokens=3, max_episode_tokens=256, max_turns=3))
    with fed_widths(trainer.model) as widths:
        trajectories = trainer.collect(train_tasks()[:20])  # 80 episodes
    assert len(trajectories) == 80 and max(t.turns for t in trajectories) == 3
    assert sum(width >= widths[0] for width in widths) == 1  # the shared instructions, prefilled once


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_a_mean_over_played_episodes_is_the_unskipped_loss(aggregation):
    """``mean_over="played"`` counts the skipped zero-advantage groups in the mean, as TRL's loss does."""
    tokenizer = tiny_tokenizer()
    rewards = [1.0, 0.0, 0.0, 0.0] + [0.0] * 4  # the second group carries no signal
    words = ["apple", "berry", "cherry", "grape", "lemon", "mango", "red", "blue"]  # distinct episodes
    groups = [fake_traj(tokenizer, r, task_id=i // 4, word=w) for i, (r, w) in enumerate(zip(rewards, words))]

    def update(skip, mean_over, term=False):
        config = GRPOConfig(lr=1e-3, group_size=4, tasks_per_step=2, aggregation=aggregation,
                            skip_zero_advantage=skip, mean_over=mean_over)
        trainer = grpo(tiny_model(tokenizer, seed=12), tokenizer, config)
        if term:
            trainer.add_loss_term(lambda model, batch, logprobs: (torch.tensor(5.0), {}))
        return trainer.update(groups)

    played, unskipped, trained = update(True, "played"), update(False, "trained"), update(True, "trained")
    assert played["trained_episodes"] == 4 and unskipped["trained_episodes"] == 8
    # (At ratio 1 the policy loss itself is zero up to round-off: the gradients are what differ.)
    assert played["grad_norm"] == pytest.approx(unskipped["grad_norm"], rel=1e-5)
    # Over the trained episodes only, the same gradient is twice as large (4 of the 8 carried signal).
    assert trained["grad_norm"] == pytest.approx(2 * played["grad_norm"], rel=1e-5)
    # A loss term still counts once per optimizer step.
    assert update(True, "played", term=True)["loss"] == pytest.approx(played["loss"] + 5.0, abs=1e-5)


def test_a_loss_term_adds_to_the_loss_the_same_for_any_micro_batching():
    tokenizer = tiny_tokenizer()
    rewards = [1.0, 0.0, 0.0, 0.0] * 2

    def run(budget, with_term):
        config = GRPOConfig(lr=1e-3, group_size=4, tasks_per_step=2, micro_batch_tokens=budget)
        trainer = grpo(tiny_model(tokenizer, seed=11), tokenizer, config)
        seen = []

        def nll_of_sampled_tokens(model, batch, logprobs):
            assert logprobs.shape == batch.input_ids.shape and logprobs.requires_grad
            seen.append(len(batch.samples))
            mask = batch.loss_mask.bool()
            value = -(logprobs * mask).sum() / mask.sum()
            return 3.0 * value, {"sampled_nll": float(value.detach())}

        if with_term:
            trainer.add_loss_term(nll_of_sampled_tokens)
        return trainer.update(fake_groups(tokenizer, rewards)), seen

    plain, _ = run(10_000, False)
    whole, seen_whole = run(10_000, True)
    split, seen_split = run(10, True)  # two samples per micro-batch
    assert seen_whole == [8] and len(seen_split) == 4
    assert whole["loss"] == pytest.approx(plain["loss"] + 3.0 * whole["sampled_nll"], rel=1e-5)
    assert split["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-4)
    assert whole["grad_norm"] != pytest.approx(plain["grad_norm"], rel=1e-3)


def test_loss_terms_and_editors_can_be_removed():
    tokenizer = tiny_tokenizer()
    trainer = grpo(tiny_model(tokenizer, seed=12), tokenizer, GRPOConfig(group_size=2, tasks_per_step=2))
    remove = trainer.add_loss_term(lambda model, batch, logprobs: (logprobs.sum() * 0, {"term_ran": 1.0}))
    stats = trainer.update(fake_groups(tokenizer, [1.0, 0.0, 0.0, 1.0], group_size=2))
    assert stats["term_ran"] == 1.0
    remove()
    assert "term_ran" not in trainer.update(fake_groups(tokenizer, [1.0, 0.0, 0.0, 1.0], group_size=2))
    calls = []
    remove_editor = trainer.add_trajectory_editor(
        lambda trajectories, t: calls.append(len(trajectories)) or trajectories)
    trainer.step(CyclingSampler(train_tasks()))
    remove_editor()
    trainer.step(CyclingSampler(train_tasks()))
    assert calls == [4]


def test_a_trajectory_editor_adds_replayed_groups_and_drops_others():
    tokenizer = tiny_tokenizer()
    trainer = grpo(tiny_model(tokenizer, seed=13), tokenizer,
                   GRPOConfig(group_size=4, tasks_per_step=2, skip_zero_advantage=False))
    replayed = fake_groups(tokenizer, [1.0, 0.0, 1.0, 0.0])

    def replace_first_group(trajectories, t):
        assert t is trainer
        return replayed + trajectories[4:]

    trainer.add_trajectory_editor(replace_first_group)
    stats = trainer.step(CyclingSampler(train_tasks()))
    assert stats["trained_episodes"] == 8 and stats["advantage_abs_mean"] > 0
    trainer.add_trajectory_editor(lambda trajectories, t: trajectories[:-1])  # breaks a group: refused
    with pytest.raises(ValueError, match="whole groups of group_size=4"):
        trainer.step(CyclingSampler(train_tasks()))


def test_the_trainer_names_its_parts():
    tokenizer = tiny_tokenizer()
    trainer = grpo(tiny_model(tokenizer, seed=14), tokenizer, GRPOConfig())
    assert trainer.tokenizer is tokenizer and trainer.policy.tokenizer is tokenizer
    assert trainer.policy.model is trainer.model  # the policy samples from the trained weights
    assert trainer.accelerator is trainer.masked_trainer.accelerator
    with pytest.raises(TypeError, match="rollout must be a RolloutConfig"):
        GRPOTrainer(trainer.model, tokenizer, GRPOConfig(), {"max_new_tokens": 3}, make_env)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        grpo(trainer.model, tokenizer, GRPOConfig(), RolloutConfig(temperature=0.0))


def test_rollout_seed_comes_from_the_root_seed():
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, seed=15)
    tasks = train_tasks()[:2]
    texts = [[t.messages[-1]["content"] for t in grpo(model, tokenizer, GRPOConfig(), seed=s).collect(tasks)]
             for s in (1, 1, 2)]
    assert texts[0] == texts[1] and texts[0] != texts[2]


# --- episodes whose environment raised ----------------------------------------------------


def test_a_group_with_a_failed_episode_never_enters_the_update():
    tokenizer = tiny_tokenizer()
    config = GRPOConfig(lr=1e-2, group_size=4, tasks_per_step=4, skip_zero_advantage=False)
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0] * 2
    clean = grpo(tiny_model(tokenizer, seed=16), tokenizer, config)
    clean_stats = clean.update(fake_groups(tokenizer, rewards[4:]))
    failing = grpo(tiny_model(tokenizer, seed=16), tokenizer, config)
    stats = failing.update(fake_groups(tokenizer, rewards, errors={1}))  # 1 of 16 failed: under 10%
    assert stats["episode_errors"] == 1 and stats["dropped_groups"] == 1
    assert stats["trained_episodes"] == clean_stats["trained_episodes"] == 12
    for a, b in zip(clean.model.parameters(), failing.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


class BrokenOnOddTasks(MagicWordEnv):
    """Raises on every step of odd task ids (an environment bug)."""

    def on_step(self, text):
        if self.task.id % 2:
            raise ValueError(f"boom on task {self.task.id}")
        return super().on_step(text)


def test_too_many_failed_episodes_fail_the_step_with_the_first_error():
    tokenizer = tiny_tokenizer()
    tasks = [Task("magic", 0, "train", "easy"), Task("magic", 1, "train", "hard")]

    class Fixed:
        def sample(self, n):
            return tasks[:n]

    config = GRPOConfig(group_size=2, tasks_per_step=2)
    trainer = GRPOTrainer(tiny_model(tokenizer, seed=17), tokenizer, config, ROLLOUT, lambda t: BrokenOnOddTasks(),
                          show_progress=False)
    with pytest.raises(TooManyEpisodeErrors, match=r"2 of 4 episodes .* max_error_rate=0.1; first: magic task 1: "
                                                   r"ValueError: boom on task 1"):
        trainer.step(Fixed())
    tolerant = GRPOTrainer(tiny_model(tokenizer, seed=17), tokenizer, GRPOConfig(group_size=2, tasks_per_step=2,
                           max_error_rate=0.5), ROLLOUT, lambda t: BrokenOnOddTasks(), show_progress=False)
    stats = tolerant.step(Fixed())
    assert stats["episode_errors"] == 2 and stats["dropped_groups"] == 1 and stats["trained_episodes"] <= 2


# --- non-finite updates -------------------------------------------------------------------


def test_non_finite_losses_skip_the_update_and_stop_the_run_when_repeated(tmp_path, caplog):
    tokenizer = tiny_tokenizer()
    config = GRPOConfig(lr=1e-2, group_size=4, tasks_per_step=2, skip_zero_advantage=False, max_nonfinite_steps=2)
    trainer = grpo(tiny_model(tokenizer, seed=18), tokenizer, config, log_dir=tmp_path)
    poison = {"on": True}
    trainer.add_loss_term(lambda model, batch, logprobs: (
        logprobs.sum() * (float("nan") if poison["on"] else 0.0), {}))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    rewards = [1.0, 0.0, 0.0, 1.0] * 2
    stats = trainer.update(fake_groups(tokenizer, rewards))
    assert stats["nonfinite_skipped"] == 1.0 and "non-finite" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # skipped
    assert trainer.masked_trainer.global_step == 0
    poison["on"] = False
    assert "nonfinite_skipped" not in trainer.update(fake_groups(tokenizer, rewards))  # a good one resets the count
    poison["on"] = True
    trainer.update(fake_groups(tokenizer, rewards))
    with pytest.raises(NonFiniteError, match="2 updates in a row had a non-finite loss"):
        trainer.update(fake_groups(tokenizer, rewards))
    trainer.save(tmp_path / "ckpt")  # the weights stayed finite: saving is fine


def test_an_infinite_learning_rate_stops_at_once_and_nothing_is_saved(tmp_path):
    tokenizer = tiny_tokenizer()
    config = GRPOConfig(group_size=4, tasks_per_step=2, skip_zero_advantage=False)
    config.lr = float("inf")  # bypasses validation, as a corrupted config would
    trainer = grpo(tiny_model(tokenizer, seed=19), tokenizer, config)
    with pytest.raises(NonFiniteError, match="made the weights non-finite"):
        trainer.update(fake_groups(tokenizer, [1.0, 0.0, 0.0, 1.0] * 2))
    with pytest.raises(NonFiniteError, match="refusing to save non-finite weights"):
        trainer.save(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "model").exists()


# --- checkpoints: tensors and JSON only ----------------------------------------------------


class RunsCode:
    """Unpickling this calls ``Path.touch(marker)``: what a crafted checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        from pathlib import Path

        return (Path.touch, (Path(self.marker),))


def test_checkpoints_are_tensors_and_json_and_a_crafted_pickle_is_refused(tmp_path):
    tokenizer = tiny_tokenizer()
    trainer = grpo(tiny_model(tokenizer, seed=20), tokenizer, GRPOConfig(group_size=2, tasks_per_step=2), seed=3)
    sampler = CyclingSampler(train_tasks())
    trainer.step(sampler)
    trainer.save(tmp_path / "ckpt", sampler=sampler, extra={"stage": 1})
    state = torch.load(tmp_path / "ckpt" / "trainer_state.pt", weights_only=True)
    assert set(state) == {"optimizer", "scheduler", "rng", "extra"}
    assert isinstance(state["extra"]["backend_rng"], torch.Tensor)
    meta = json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())
    assert meta["extra"]["grpo_step"] == 1 and meta["extra"]["extra"] == {"stage": 1}
    assert sorted(p.name for p in (tmp_path / "ckpt" / "model").iterdir() if p.suffix in (".bin", ".pt")) == []

    marker = tmp_path / "pwned"
    torch.save({"optimizer": RunsCode(marker)}, tmp_path / "ckpt" / "trainer_state.pt")
    with pytest.raises(CheckpointError, match="trainer_state.pt: refused to load: not a tensors-only checkpoint"):
        trainer.load_state(tmp_path / "ckpt")
    assert not marker.exists()
    torch.load(tmp_path / "ckpt" / "trainer_state.pt", weights_only=False)  # the file really runs code
    assert marker.exists()


@pytest.mark.parametrize("checkpointing, lora", [(False, False), (False, True), (True, False), (True, True)])
def test_sharing_a_groups_prompt_in_the_update_changes_nothing_but_the_work(checkpointing, lora):
    if checkpointing and not checkpointed_prefix.supported():
        pytest.skip("this transformers drops a checkpointed layer's cache")
    tokenizer = tiny_tokenizer()
    collector = grpo(tiny_model(tokenizer, seed=2), tokenizer, GRPOConfig(group_size=4, tasks_per_step=2))
    trajectories = collector.collect(train_tasks()[:2])
    for index, trajectory in enumerate(trajectories):
        trajectory.reward = float(index % 2)  # every group has signal
    results = []
    # The group's prompt forwarded once and the rows after it packed without padding (the default on a CPU
    # without checkpointing), the rows padded, and nothing shared.
    for share, pack in ((True, True), (True, False), (False, False)):
        config = GRPOConfig(lr=1e-2, group_size=4, tasks_per_step=2, share_prefix=share, pack_rows=pack, ppo_epochs=2,
                            gradient_checkpointing=checkpointing, lora=lora)
        trainer = grpo(tiny_model(tokenizer, seed=3), tokenizer, config)
        batches: list[tuple[int, bool]] = []

        def record_batch(model, batch, logprobs, seen=batches):
            seen.append((batch.shared_prefix, batch.packed))
            return logprobs.sum() * 0, {}

        trainer.add_loss_term(record_batch)
        stats = trainer.update(trajectories)
        weights = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        results.append((stats, weights, batches))
    plain_stats, plain_weights, plain_batches = results[-1]
    assert set(plain_batches) == {(0, False)}
    for (stats, weights, batches), packs in zip(results[:2], (not checkpointing, False)):
        assert min(prefix for prefix, _ in batches) >= 16  # the group's prompt was forwarded once
        assert {packed for _, packed in batches} == {packs}
        assert stats["loss"] == pytest.approx(plain_stats["loss"], abs=1e-5)
        assert stats["grad_norm"] == pytest.approx(plain_stats["grad_norm"], rel=1e-4)
        # Adam at lr 1e-2 divides each gradient by its own scale, so a weight whose gradient is near rounding
        # size moves by a rounding-decided step: differences of ~1e-5 (LoRA), and on some CPUs one full
        # fine-tuning weight in 20k at 3.8e-5. A wrong shared prefix moves the loss and the weights by far more.
        torch.testing.assert_close(weights, plain_weights, rtol=0, atol=5e-5)


def test_a_vllm_trainer_and_its_evaluator_ask_for_the_same_engine(monkeypatch):
    """vLLM engines are shared by their settings: a step-sized limit would build a second engine for evaluation."""
    import contrail.agent.vllm as vllm
    from contrail.evaluation import Evaluator

    asked = []
    monkeypatch.setattr(vllm, "vllm_backend", lambda model, stop_ids, **kwargs: asked.append(kwargs["max_batch_size"])
                        or HFBackend(model, stop_ids, 0))
    tokenizer = tiny_tokenizer()
    config = RolloutConfig(max_new_tokens=3, max_episode_tokens=256, backend="vllm")
    trainer = grpo(tiny_model(tokenizer), tokenizer, GRPOConfig(group_size=4, tasks_per_step=20), rollout=config)
    Evaluator({"magic:easy": train_tasks()[:1]}, make_env, config, k=1, batch_episodes=8,
              show_progress=False)(trainer.model, tokenizer)
    assert len(asked) == 2 and asked[0] == asked[1]
