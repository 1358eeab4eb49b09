"""GRPO settings, validated at construction.

Defaults suit the embedded 135M model on a laptop CPU. AgentGym-RL's values
for Qwen2.5-3B/7B-Instruct (see ``experiments/``): lr 1e-6, group size 8,
clip 0.2/0.28 (DAPO's clip-higher), KL beta 1e-3, 16-32 tasks per step,
up to 4096 tokens per episode, bf16, gradient checkpointing.

Sampling and episode limits are not here: they are the experiment's one
`contrail.agent.rollout.RolloutConfig`, shared with evaluation. Seeds are not
here either: `contrail.grpo.trainer.GRPOTrainer` takes ``seed=``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from contrail.train.config import (
    TrainConfig,
    check_bool,
    check_choice,
    check_int,
    check_number,
)

Aggregation = Literal["token-mean", "seq-mean-token-mean"]
MeanOver = Literal["trained", "played"]


@dataclass
class GRPOConfig(TrainConfig):
    """Everything one GRPO run needs besides the model, the rollout limits and the tasks."""

    lr: float = 2e-5
    group_size: int = 4            # rollouts per task; advantages are relative within a group
    tasks_per_step: int = 4        # distinct tasks per step (episodes = tasks_per_step * group_size)
    ppo_epochs: int = 1            # passes over each step's rollouts
    minibatches: int = 1           # optimizer steps per epoch
    clip_low: float = 0.2
    clip_high: float = 0.2
    beta: float = 0.0              # KL to the reference (the model at the start); 0 = no reference model
    entropy_coef: float = 0.0
    aggregation: Aggregation = "token-mean"
    scale_advantages: bool = True  # False = Dr. GRPO (centring only)
    skip_zero_advantage: bool = True  # groups whose rewards are all equal carry no gradient signal
    # Which episodes the loss's mean runs over. "trained": those with signal, so a step takes a
    # full-sized step whatever share of its groups had different rewards. "played": every episode
    # the step played (skipped groups count with their zero loss, as in TRL's and DeepSeekMath's
    # GRPO loss), so a step with little signal takes a small step. Skipping is then exact.
    mean_over: MeanOver = "trained"
    max_error_rate: float = 0.1    # share of a step's episodes whose environment may raise before the step fails
    # Truncated importance sampling for the sampler/trainer mismatch (TRL's
    # vllm_importance_sampling_correction): each sampled token's loss is weighted by
    # min(exp(logp_old - logp_sampler), importance_sampling_cap), logp_old the trainer's
    # log-prob before the update, logp_sampler the engine's. Needs temperature 1 and top_p 1
    # (the sampler's log-probs must be of the distribution the trainer scores).
    importance_sampling_correction: bool = False
    importance_sampling_cap: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("group_size", self.group_size, low=2)  # GRPO compares rollouts of one task
        check_int("tasks_per_step", self.tasks_per_step, low=1)
        check_int("ppo_epochs", self.ppo_epochs, low=1)
        check_int("minibatches", self.minibatches, low=1)
        episodes = self.group_size * self.tasks_per_step
        if self.minibatches > episodes:
            raise ValueError(
                f"minibatches must be in [1, group_size * tasks_per_step = {episodes}], got {self.minibatches}"
            )
        check_number("clip_low", self.clip_low, low=0.0, high=1.0, high_open=True)
        check_number("clip_high", self.clip_high, low=0.0)
        check_number("beta", self.beta, low=0.0)
        check_number("entropy_coef", self.entropy_coef)
        check_choice("aggregation", self.aggregation, get_args(Aggregation))
        check_bool("scale_advantages", self.scale_advantages)
        check_bool("skip_zero_advantage", self.skip_zero_advantage)
        check_choice("mean_over", self.mean_over, get_args(MeanOver))
        check_number("max_error_rate", self.max_error_rate, low=0.0, high=1.0)
        check_bool("importance_sampling_correction", self.importance_sampling_correction)
        check_number("importance_sampling_cap", self.importance_sampling_cap, low=1.0)
