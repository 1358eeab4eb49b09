"""GRPO settings, validated at construction.

Defaults suit the embedded 135M model on a laptop CPU. AgentGym-RL's values
for Qwen2.5-3B/7B-Instruct (see ``experiments/``): lr 1e-6, group size 8,
clip 0.2/0.28 (DAPO's clip-higher), KL beta 1e-3, 16-32 tasks per step,
up to 4096 tokens per episode, bf16, gradient checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass

from contrail.grpo.loss import AGGREGATIONS
from contrail.train.config import TrainConfig


@dataclass
class GRPOConfig(TrainConfig):
    """Everything one GRPO run needs besides the model and the tasks."""

    lr: float = 2e-5
    group_size: int = 4            # rollouts per task; advantages are relative within a group
    tasks_per_step: int = 4        # distinct tasks per step (episodes = tasks_per_step * group_size)
    ppo_epochs: int = 1            # passes over each step's rollouts
    minibatches: int = 1           # optimizer steps per epoch
    clip_low: float = 0.2
    clip_high: float = 0.2
    beta: float = 0.0              # KL to the reference (the model at the start); 0 = no reference model
    entropy_coef: float = 0.0
    aggregation: str = "token-mean"
    scale_advantages: bool = True  # False = Dr. GRPO (centring only)
    max_turns: int | None = None   # None = each environment's own limit
    max_new_tokens: int = 64       # per turn
    max_episode_tokens: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    skip_zero_advantage: bool = True  # groups whose rewards are all equal carry no gradient signal

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 (GRPO compares rollouts of one task), got {self.group_size}"
            )
        if self.tasks_per_step < 1:
            raise ValueError(f"tasks_per_step must be >= 1, got {self.tasks_per_step}")
        episodes = self.group_size * self.tasks_per_step
        if not 1 <= self.minibatches <= episodes:
            raise ValueError(
                f"minibatches must be in [1, group_size * tasks_per_step = {episodes}], got {self.minibatches}"
            )
        if self.ppo_epochs < 1:
            raise ValueError(f"ppo_epochs must be >= 1, got {self.ppo_epochs}")
        if self.clip_low < 0 or self.clip_high < 0 or self.clip_low >= 1:
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.max_episode_tokens <= self.max_new_tokens:
            raise ValueError(
                f"max_episode_tokens ({self.max_episode_tokens}) must exceed max_new_tokens ({self.max_new_tokens})"
            )
        if self.temperature <= 0:
            raise ValueError(
                f"temperature must be > 0 for GRPO (greedy rollouts make every group identical), got {self.temperature}"
            )
