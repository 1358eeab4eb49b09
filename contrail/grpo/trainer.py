"""Multi-turn GRPO on the masked-token trainer.

One step (Shao et al. 2024; multi-turn as in AgentGym-RL):

1. sample ``tasks_per_step`` tasks and play ``group_size`` episodes of each
   (the batched rollout engine; token-in/token-out);
2. advantages: each episode's reward against its own group
   (`group_advantages`), broadcast to every generated token of the episode;
3. updates: ``ppo_epochs`` passes of ``minibatches`` optimizer steps with the
   clipped loss (`policy_loss`), log-probs recomputed only for the sampled
   tokens, micro-batches packed by token budget.

The trainer knows nothing about continual learning: it takes anything with
``sample(n) -> list[Task]`` (and ``state_dict``/``load_state_dict`` to
resume) as its task sampler.
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch

from contrail.agent.rollout import RolloutConfig, Trajectory, rollout
from contrail.envs.base import Env, Task
from contrail.grpo.advantage import group_advantages
from contrail.grpo.config import GRPOConfig
from contrail.grpo.loss import policy_loss
from contrail.policy import Policy
from contrail.progress import StepProgress
from contrail.train.logprobs import sequence_logprobs
from contrail.train.trainer import Batch, MaskedTokenTrainer, Sample, collate, pack_by_tokens


class TaskSource(Protocol):
    def sample(self, n: int) -> list[Task]: ...


class GRPOTrainer:
    """Reinforcement fine-tuning of a chat model from environment rewards.

    >>> trainer = GRPOTrainer(model, tokenizer, GRPOConfig(), make_env=lambda t: envs.make(t.env))
    >>> trainer.train(sampler, steps=20)
    """

    def __init__(self, model, tokenizer, config: GRPOConfig, make_env: Callable[[Task], Env],
                 log_dir: str | Path | None = None, show_progress: bool = True):
        self.config = config
        self.make_env = make_env
        self.show_progress = show_progress
        self.trainer = MaskedTokenTrainer(model, tokenizer, config, log_dir=log_dir)
        self.accelerator = self.trainer.accelerator
        policy = Policy.from_model(self.trainer.unwrapped, tokenizer,
                                   seed=config.seed + 1000 * self.accelerator.process_index,
                                   autocast_bf16=config.precision == "bf16")
        self.chat, self.backend = policy.chat, policy.backend
        self.reference = self._make_reference() if config.beta > 0 else None
        self.log_path = Path(log_dir) / "grpo_log.jsonl" if log_dir else None
        self.step_count = 0

    # --- public API ---------------------------------------------------------------
    def train(self, sampler: TaskSource, steps: int, on_step: Callable[[dict], None] | None = None,
              description: str = "GRPO") -> list[dict[str, float]]:
        """Run ``steps`` GRPO steps drawing tasks from ``sampler``; return each step's stats."""
        history = []
        enabled = self.show_progress and self.accelerator.is_main_process
        with StepProgress(steps, description, enabled) as progress:
            for _ in range(steps):
                stats = self.step(sampler)
                history.append(stats)
                if on_step:
                    on_step(stats)
                progress.step_done(
                    f"reward {stats['reward_mean']:.2f}  success {stats['success_rate']:.2f}  "
                    f"loss {stats.get('loss', 0.0):+.3f}"
                )
        return history

    def step(self, sampler: TaskSource) -> dict[str, float]:
        """One GRPO step: rollouts, advantages, updates. Returns its logged stats."""
        start = time.perf_counter()
        tasks = sampler.sample(self.config.tasks_per_step)
        mine = tasks[self.accelerator.process_index::self.accelerator.num_processes] or tasks[:1]
        trajectories = self._rollouts(mine)
        rollout_seconds = time.perf_counter() - start

        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        advantages = group_advantages(rewards, self.config.group_size, scale=self.config.scale_advantages)
        samples = self._samples(trajectories, advantages)
        update_start = time.perf_counter()
        update_stats = self._update(samples) if self._should_update(samples, trajectories) else {"skipped_update": 1.0}
        stats = {
            "step": self.step_count + 1, **_rollout_stats(trajectories), **update_stats,
            "advantage_mean": float(advantages.mean()), "advantage_std": float(advantages.std()),
            "advantage_abs_mean": float(advantages.abs().mean()),
            "trained_episodes": len(samples), "rollout_seconds": rollout_seconds,
            "update_seconds": time.perf_counter() - update_start, "step_seconds": time.perf_counter() - start,
        }
        self.step_count += 1
        self._log(stats)
        return stats

    @property
    def model(self):
        """The model being trained (unwrapped from Accelerate / DDP)."""
        return self.trainer.unwrapped

    def save(self, directory: str | Path, sampler: Any = None, extra: dict | None = None) -> Path:
        """A resumable checkpoint: model, optimizer, scheduler, RNG, sampler and rollout-sampling state."""
        state = {"grpo_step": self.step_count, "backend_rng": self.backend.generator_state(), **(extra or {})}
        if sampler is not None and hasattr(sampler, "state_dict"):
            state["sampler"] = sampler.state_dict()
        return self.trainer.save(Path(directory), extra=state)

    def load_state(self, directory: str | Path, sampler: Any = None) -> dict:
        """Restore what `save` wrote (the model weights are loaded by the caller)."""
        extra = self.trainer.load_state(Path(directory))
        self.step_count = extra["grpo_step"]
        self.backend.set_generator_state(extra["backend_rng"])
        if sampler is not None and "sampler" in extra:
            sampler.load_state_dict(extra["sampler"])
        return extra

    # --- the three phases --------------------------------------------------------
    def _rollouts(self, tasks: list[Task]) -> list[Trajectory]:
        group = self.config.group_size
        episodes = [task for task in tasks for _ in range(group)]  # consecutive = one group
        samples = [i % group for i in range(len(episodes))]
        config = RolloutConfig(self.config.max_new_tokens, self.config.max_episode_tokens,
                               self.config.temperature, self.config.top_p, self.config.max_turns)
        return rollout(self.backend, self.chat, episodes, self.make_env, config, samples=samples)

    def _samples(self, trajectories: list[Trajectory], advantages: torch.Tensor) -> list[Sample]:
        samples = []
        for traj, advantage in zip(trajectories, advantages.tolist()):
            if sum(traj.mask) == 0:
                continue  # nothing generated (a prompt over the token limit): nothing to train
            if self.config.skip_zero_advantage and advantage == 0.0:
                continue  # its group's rewards were all equal: the gradient would be zero anyway
            samples.append(Sample(traj.ids, traj.mask, {"advantage": advantage}))
        return samples

    def _should_update(self, samples: list[Sample], trajectories: list[Trajectory]) -> bool:
        """Update when any process has a sample with signal; every process must then take part.

        Under data parallelism each process must run the same number of
        optimizer steps, so a process whose groups all had equal rewards
        trains on one of its episodes with advantage 0 (no policy gradient).
        """
        if self.trainer.sum_over_processes(float(len(samples))) == 0:
            return False
        if not samples:
            filler = next(t for t in trajectories if sum(t.mask))
            samples.append(Sample(filler.ids, filler.mask, {"advantage": 0.0}))
        return True

    def _update(self, samples: list[Sample]) -> dict[str, float]:
        self._attach_old_and_ref_logprobs(samples)
        rng = random.Random(self.config.seed * 7919 + self.step_count)
        totals: dict[str, list[float]] = {}
        for _ in range(self.config.ppo_epochs):
            order = list(range(len(samples)))
            rng.shuffle(order)
            minibatches = np.array_split(np.array(order), min(self.config.minibatches, len(order)))
            for indices in minibatches:
                batch = [samples[i] for i in indices]
                stats = self.trainer.step(batch, self._loss, normalizer=self._normalizer(batch))
                for key, value in stats.items():
                    totals.setdefault(key, []).append(value)
        return {key: float(np.mean(values)) for key, values in totals.items()}

    def _normalizer(self, batch: list[Sample]) -> float:
        if self.config.aggregation == "token-mean":
            local = float(sum(sum(s.mask) for s in batch))
        else:
            local = float(sum(1 for s in batch if any(s.mask)))
        return max(self.trainer.sum_over_processes(local), 1.0)

    @property
    def _single_update(self) -> bool:
        """One optimizer step per rollout batch: the old policy *is* the current one."""
        return self.config.ppo_epochs * self.config.minibatches == 1

    def _loss(self, model, batch: Batch, normalizer: float) -> tuple[torch.Tensor, dict[str, float]]:
        # Logits only from the first generated token on: the prompt's would be discarded.
        start = _first_masked_position(batch.loss_mask)
        logprobs, entropy = sequence_logprobs(model, batch.input_ids, batch.attention_mask, start=start,
                                              return_entropy=True)
        # With a single update the ratio is exactly 1 at this point (as TRL does): no extra forward.
        old = logprobs.detach() if self._single_update else batch.token_extra("old_logprobs")
        loss, stats = policy_loss(
            logprobs, old, batch.sample_extra("advantage"), batch.loss_mask,
            clip_low=self.config.clip_low, clip_high=self.config.clip_high, aggregation=self.config.aggregation,
            ref_logprobs=batch.token_extra("ref_logprobs") if self.reference is not None else None,
            beta=self.config.beta, entropy=entropy if self.config.entropy_coef > 0 else entropy.detach(),
            entropy_coef=self.config.entropy_coef, normalizer=normalizer,
        )
        return loss, {k: float(v) for k, v in stats.items() if k != "tokens"}

    @torch.no_grad()
    def _attach_old_and_ref_logprobs(self, samples: list[Sample]) -> None:
        """Log-probs of the sampled tokens under the policy before this step's updates (and the reference).

        Recomputed with the training forward rather than taken from the
        sampler, so the first update's ratio is exactly 1 (as TRL and verl do).
        """
        models = [] if self._single_update else [("old_logprobs", self.trainer.model)]
        if self.reference is not None:
            models.append(("ref_logprobs", self.reference))
        if not models:
            return
        self.trainer.model.eval()
        for group in pack_by_tokens([len(s.ids) for s in samples], self.config.micro_batch_tokens):
            batch = collate([samples[i] for i in group], self.trainer.tokenizer.pad_token_id, self.accelerator.device)
            for key, model in models:
                with self.trainer.autocast(), self._reference_context(key):
                    logprobs = sequence_logprobs(model, batch.input_ids, batch.attention_mask,
                                                 start=_first_masked_position(batch.loss_mask)).float().cpu()
                for row, index in enumerate(group):
                    samples[index].extras[key] = logprobs[row, : len(samples[index].ids)].tolist()

    def _make_reference(self):
        """The model at the start of training, frozen. With LoRA the base model *is* the reference."""
        if self.config.lora:
            return self.trainer.model
        reference = copy.deepcopy(self.trainer.unwrapped).eval()
        for parameter in reference.parameters():
            parameter.requires_grad_(False)
        return reference

    def _reference_context(self, key: str):
        import contextlib

        if key == "ref_logprobs" and self.config.lora:
            return self.trainer.unwrapped.disable_adapter()
        return contextlib.nullcontext()

    def _log(self, stats: dict[str, float]) -> None:
        self.accelerator.log({k: v for k, v in stats.items() if isinstance(v, (int, float))}, step=self.step_count)
        if self.log_path is not None and self.accelerator.is_main_process:
            with open(self.log_path, "a", encoding="utf-8") as sink:
                sink.write(json.dumps(stats) + "\n")


def _first_masked_position(mask: torch.Tensor) -> int:
    """The earliest position any row trains on (at least 1: position 0 has no predecessor)."""
    columns = torch.nonzero(mask.any(dim=0))
    return max(int(columns[0]) if len(columns) else 1, 1)


def _rollout_stats(trajectories: list[Trajectory]) -> dict[str, float]:
    turns = sum(t.turns for t in trajectories)
    return {
        "reward_mean": float(np.mean([t.reward for t in trajectories])),
        "success_rate": float(np.mean([t.success for t in trajectories])),
        "turns_mean": float(np.mean([t.turns for t in trajectories])),
        "generated_tokens": float(sum(t.generated_tokens for t in trajectories)),
        "episode_tokens_mean": float(np.mean([len(t.ids) for t in trajectories])),
        "invalid_rate": sum(t.invalid_actions for t in trajectories) / turns if turns else 0.0,
        "truncated_rate": float(np.mean([t.truncated for t in trajectories])),
        "episode_errors": float(sum(t.error is not None for t in trajectories)),
    }
