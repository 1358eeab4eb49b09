"""`ContrailRollout` as TRL 1.16's ``rollout_func``: one real ``trl.GRPOTrainer`` step on contrail episodes."""

from __future__ import annotations

import re

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import contrail.envs as envs  # noqa: E402
from contrail.agent.rollout import RolloutConfig, Trajectory  # noqa: E402
from contrail.envs.base import Step, Task  # noqa: E402
from contrail.integrations.trl import (  # noqa: E402
    ContrailRollout,
    env_reward,
    split_trajectory,
    task_dataset,
    task_of,
    task_prompt,
)
from contrail.testing import MagicWordEnv, tiny_model, tiny_tokenizer  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """TRL's trainer leaves Accelerate's process-wide state behind (bf16 mixed precision among it);
    later trainers in this process would inherit it, so it is reset after each test."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


class ParityEnv(MagicWordEnv):
    """Two turns; reward 1 when the second reply has an even number of words (a reward that varies)."""

    default_max_turns = 2

    def turn_limit(self, task: Task) -> int:
        return 2

    def on_step(self, text: str) -> Step:
        if self.turns == 1:
            return Step(observation="again .")
        even = len(re.findall(r"\S+", text)) % 2 == 0
        return Step(observation="done", reward=float(even), done=True, success=even)


def test_prompts_name_tasks():
    task = Task("magic", 3, "train", "easy")
    assert task_of(task_prompt(task)) == task
    assert task_dataset([task, task])["prompt"] == [task_prompt(task)] * 2
    with pytest.raises(ValueError, match="task_dataset"):
        task_of("Solve 2 + 2")


def test_split_trajectory_keeps_observations_under_env_mask_zero():
    trajectory = Trajectory(
        task=Task("magic", 0, "train", "easy"),
        ids=[1, 2, 3, 10, 11, 4, 5, 12, 6], mask=[0, 0, 0, 1, 1, 0, 0, 1, 0],
        logprobs=[0, 0, 0, -0.5, -0.25, 0, 0, -1.0, 0], messages=[],
    )
    piece = split_trajectory(trajectory, fallback_id=99)
    assert piece["prompt_ids"] == [1, 2, 3]
    assert piece["completion_ids"] == [10, 11, 4, 5, 12]  # the closing after the last sampled id is cut
    assert piece["env_mask"] == [1, 1, 0, 0, 1]
    assert piece["logprobs"] == [-0.5, -0.25, 0, 0, -1.0]
    failed = Trajectory(task=trajectory.task, ids=[], mask=[], logprobs=[], messages=[], error="boom")
    assert split_trajectory(failed, fallback_id=99) == {
        "prompt_ids": [99], "completion_ids": [99], "logprobs": [0.0], "env_mask": [0]}


def test_one_trl_grpo_step_trains_on_contrail_episodes(tmp_path):
    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    with envs.registered("parity", type("Parity", (ParityEnv,), {})):
        tasks = envs.make("parity").tasks("train")[:2]
        rollout_func = ContrailRollout(rollout=RolloutConfig(max_new_tokens=6, max_episode_tokens=256), seed=3)
        args = trl.GRPOConfig(
            output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4, max_steps=1,
            learning_rate=1e-2, beta=0.0, report_to="none", use_cpu=True, save_strategy="no", logging_steps=1,
        )
        trainer = trl.GRPOTrainer(
            model=str(tmp_path / "model"), reward_funcs=env_reward, args=args, train_dataset=task_dataset(tasks),
            processing_class=tokenizer, rollout_func=rollout_func,
        )
        before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        trainer.train()
    episodes = rollout_func.last_trajectories
    assert len(episodes) == 8 and all(e.error is None and e.turns == 2 for e in episodes)
    assert len({e.reward for e in episodes}) == 2  # a reward that varies, so the step has a gradient
    changed = [name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])]
    assert changed, "the TRL step did not change any weight"
    logged = next(entry for entry in trainer.state.log_history if "completions/mean_length" in entry)
    sampled = sum(sum(m for m in e.mask) for e in episodes) / len(episodes)
    assert logged["completions/mean_length"] == pytest.approx(sampled)  # TRL counted env_mask, not all tokens
    assert logged["reward"] == pytest.approx(sum(e.reward for e in episodes) / len(episodes))
