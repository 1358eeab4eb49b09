"""Multi-turn GRPO on the masked-token trainer.

One step (Shao et al. 2024; multi-turn as in AgentGym-RL) is `collect` then
`update`:

1. ``collect(tasks)``: play ``group_size`` episodes of each task (the batched
   rollout engine; token-in/token-out);
2. trajectory editors (if any) may add episodes (replay) or drop some;
3. ``update(trajectories)``: groups where an environment raised are left out
   whole; advantages: each episode's reward against its own group
   (`group_advantages`), broadcast to every generated token of the episode;
   ``ppo_epochs`` passes of ``minibatches`` optimizer steps with the clipped
   loss (`policy_loss`) plus any added loss terms, log-probs recomputed only
   for the sampled tokens, micro-batches packed by token budget.

The trainer knows nothing about continual learning. A strategy changes what
it does only through public seams: `add_loss_term` (a regulariser, given the
model, the batch and the policy's log-probs of the sampled tokens) and
`add_trajectory_editor` (a buffer); it reaches `model`, `tokenizer`,
`policy` and `accelerator` by name. The task sampler is anything with
``sample(n) -> list[Task]`` (and ``state_dict``/``load_state_dict`` to resume).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from contrail.agent.backend import prepare_update, sync_after_update
from contrail.agent.rollout import RolloutConfig, Trajectory, per_turn_rate, rollout
from contrail.envs.base import Env, Task
from contrail.grpo.advantage import group_advantages
from contrail.grpo.config import GRPOConfig
from contrail.grpo.loss import policy_loss
from contrail.grpo.samples import (
    GRPOSample,
    check_groups,
    drop_failed_groups,
    padded,
    to_samples,
)
from contrail.policy import Policy
from contrail.progress import StepProgress
from contrail.seeds import check_seed, derive_seed
from contrail.train.logprobs import sequence_logprobs
from contrail.train.trainer import Batch, MaskedTokenTrainer, load_tensors_file

__all__ = ["GRPOTrainer", "LossTerm", "TaskSource", "TooManyEpisodeErrors", "TrajectoryEditor"]

LossTerm = Callable[[torch.nn.Module, Batch, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]
"""``fn(model, batch, logprobs) -> (loss, stats)``: see `GRPOTrainer.add_loss_term`."""

TrajectoryEditor = Callable[[list[Trajectory], "GRPOTrainer"], list[Trajectory]]
"""``fn(trajectories, trainer) -> trajectories``: see `GRPOTrainer.add_trajectory_editor`."""


class TaskSource(Protocol):
    def sample(self, n: int) -> list[Task]: ...


class TooManyEpisodeErrors(RuntimeError):
    """More of a step's episodes failed in their environment than ``GRPOConfig.max_error_rate`` allows."""


class GRPOTrainer:
    """Reinforcement fine-tuning of a chat model from environment rewards.

    >>> trainer = GRPOTrainer(model, tokenizer, GRPOConfig(), RolloutConfig(max_new_tokens=64),
    ...                       make_env=lambda task: envs.make(task.env), seed=0)
    >>> trainer.train(sampler, steps=20)

    ``seed`` is the run's root seed: rollout sampling uses
    ``derive_seed(seed, "rollout", process_index)``, the minibatch shuffle of
    update ``n`` ``derive_seed(seed, "update", n)``.

    Attributes reachable by name: ``model`` (unwrapped), ``tokenizer``,
    ``policy`` (chat format + sampling backend over the same weights),
    ``accelerator``, ``masked_trainer`` (the optimizer loop), ``config``,
    ``rollout`` and ``step_count`` (updates done, also after a resume).
    """

    def __init__(self, model, tokenizer, config: GRPOConfig, rollout: RolloutConfig,
                 make_env: Callable[[Task], Env], *, seed: int = 0, log_dir: str | Path | None = None,
                 show_progress: bool = True):
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"config must be a GRPOConfig, got {type(config).__name__}")
        if not isinstance(rollout, RolloutConfig):
            raise TypeError(
                f"rollout must be a RolloutConfig, got {type(rollout).__name__}; the signature is "
                "GRPOTrainer(model, tokenizer, config, rollout, make_env, *, seed=0, log_dir=None)"
            )
        if rollout.temperature <= 0:
            raise ValueError(
                f"temperature must be > 0 for GRPO training (greedy rollouts make every group identical), "
                f"got {rollout.temperature}"
            )
        if config.importance_sampling_correction and (rollout.temperature != 1 or rollout.top_p != 1):
            raise ValueError(
                "importance_sampling_correction needs rollout.temperature 1 and rollout.top_p 1 (the sampler's "
                f"log-probs must be of the distribution the trainer scores), got temperature {rollout.temperature} "
                f"and top_p {rollout.top_p}"
            )
        self.config, self.rollout, self.make_env = config, rollout, make_env
        self.seed = check_seed(seed)
        self.show_progress = show_progress
        self.masked_trainer = MaskedTokenTrainer(model, tokenizer, config, log_dir=log_dir, seed=seed)
        self.accelerator = self.masked_trainer.accelerator
        self.policy = Policy.from_model(self.model, tokenizer,
                                        seed=derive_seed(seed, "rollout", self.accelerator.process_index),
                                        autocast_bf16=self.precision == "bf16", rollout=rollout,
                                        # a step's episodes in one batch, its KV cache kept across turns
                                        max_batch_size=config.tasks_per_step * config.group_size)
        self.reference = self._make_reference() if config.beta > 0 else None
        self.log_path = Path(log_dir) / "grpo_log.jsonl" if log_dir else None
        self.step_count = 0
        self._loss_terms: list[LossTerm] = []
        self._editors: list[TrajectoryEditor] = []

    # --- names ------------------------------------------------------------------
    @property
    def model(self):
        """The model being trained (unwrapped from Accelerate / DDP); the same weights the policy samples from."""
        return self.masked_trainer.unwrapped

    @property
    def tokenizer(self):
        return self.masked_trainer.tokenizer

    @property
    def precision(self) -> str:
        """What updates and rollouts compute in, ``"fp32"`` or ``"bf16"`` (``"auto"`` resolved for this device)."""
        return self.masked_trainer.precision

    def full_weights(self):
        """A context to sample in: the whole model on every process (FSDP unshards it), LoRA merged in.

        Every process enters it together. `collect` and the runner's
        evaluations sample inside it; a strategy that samples from the model
        itself should too. See `MaskedTokenTrainer.full_weights`.
        """
        return self.masked_trainer.full_weights()

    # --- seams for strategies ------------------------------------------------------
    def add_loss_term(self, fn: LossTerm) -> Callable[[], None]:
        """Add ``fn(model, batch, logprobs) -> (loss, stats)`` to every update's loss; returns its remover.

        ``batch`` is a micro-batch (`contrail.train.trainer.Batch`: ``input_ids``,
        ``attention_mask``, ``loss_mask`` = 1 on the sampled tokens, ``start``);
        ``logprobs`` are the current policy's ``(batch, tokens)`` log-probs of
        those tokens (gradients flow through them). ``loss`` is a scalar: the
        term's mean over the batch's sampled tokens, or a value that does not
        depend on the batch (a penalty on the weights). The trainer weights it
        by the batch's share of the minibatch, so micro-batching and data
        parallelism leave the total unchanged. ``stats`` (floats) join the
        step's stats, averaged over micro-batches weighted by their sampled tokens.
        """
        self._loss_terms.append(fn)
        return lambda: self._loss_terms.remove(fn) if fn in self._loss_terms else None

    def add_trajectory_editor(self, fn: TrajectoryEditor) -> Callable[[], None]:
        """Let ``fn(trajectories, trainer)`` edit each `step`'s trajectories before the update; returns its remover.

        It may add episodes (replayed ones) or drop some, in whole groups of
        ``group_size`` consecutive episodes of one task. Editors run in the
        order they were added; `update` itself trains on what it is given.
        """
        self._editors.append(fn)
        return lambda: self._editors.remove(fn) if fn in self._editors else None

    # --- the loop -----------------------------------------------------------------
    def train(self, sampler: TaskSource, steps: int, on_step: Callable[[dict], None] | None = None,
              description: str = "GRPO", done: int = 0) -> list[dict[str, float]]:
        """Run GRPO steps ``done + 1 .. steps`` drawing tasks from ``sampler``; return each one's stats.

        ``done`` steps of the ``steps`` ran before (a stage taken up from a
        checkpoint within it): the progress bar counts them, nothing reruns them.
        """
        if not 0 <= done <= steps:
            raise ValueError(f"train: done must be in [0, steps = {steps}], got {done}")
        history = []
        enabled = self.show_progress and self.accelerator.is_main_process
        with StepProgress(steps, description, enabled, start=done) as progress:
            for _ in range(steps - done):
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
        """One GRPO step: `collect` this process's share of ``tasks_per_step`` tasks, edit, `update`; log it."""
        start = time.perf_counter()
        tasks = sampler.sample(self.config.tasks_per_step)
        mine = tasks[self.accelerator.process_index::self.accelerator.num_processes] or tasks[:1]
        trajectories = self.collect(mine)
        rollout_seconds = time.perf_counter() - start
        played = _rollout_stats(trajectories)
        for editor in self._editors:
            trajectories = editor(trajectories, self)
        update_start = time.perf_counter()
        update_stats = self.update(trajectories)
        stats = {
            "step": self.step_count, **played, **update_stats, "rollout_seconds": rollout_seconds,
            "update_seconds": time.perf_counter() - update_start, "step_seconds": time.perf_counter() - start,
        }
        self._log(stats)
        return stats

    def collect(self, tasks: list[Task]) -> list[Trajectory]:
        """Play ``group_size`` episodes of each task with the current policy, on this process.

        Returns the trajectories in groups: episodes ``[i*G, (i+1)*G)`` are
        task ``i``'s, with ``sample`` numbers ``0..G-1``. An episode whose
        environment raised is returned with its ``error`` set.
        """
        group = self.config.group_size
        episodes = [task for task in tasks for _ in range(group)]
        samples = [i % group for i in range(len(episodes))]
        with self.full_weights():  # each process plays its own number of forwards
            return rollout(self.policy.backend, self.policy.chat, episodes, self.make_env, self.rollout,
                           samples=samples)

    def update(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """Train on ``trajectories`` (whole groups); return the update's stats. Counts one step.

        Groups with an episode whose environment raised are left out whole
        (``episode_errors``, ``dropped_groups``); when more than
        ``max_error_rate`` of the episodes failed it raises
        `TooManyEpisodeErrors` naming the first error. With no group left
        that carries signal the optimizer is not stepped (``skipped_update``).
        """
        group = self.config.group_size
        check_groups(trajectories, group)
        errors = self._check_error_rate(trajectories)
        kept, dropped = drop_failed_groups(trajectories, group)
        rewards = torch.tensor([t.reward for t in kept], dtype=torch.float32)
        advantages = group_advantages(rewards, group, scale=self.config.scale_advantages)
        samples = to_samples(kept, advantages, self.config.skip_zero_advantage)
        stats = {"episode_errors": float(errors), "dropped_groups": float(dropped),
                 "trained_episodes": float(len(samples)), **_advantage_stats(advantages)}
        if self._has_signal(samples):
            prepare_update(self.policy.backend)  # vLLM sleep mode frees the engine's memory here
            stats.update(self._optimize(samples or [_filler(trajectories)], self._dilution(kept, samples)))
        else:
            stats["skipped_update"] = 1.0
        # The next rollout must sample from the weights just trained (a stale engine is the classic bug).
        sync_after_update(self.policy.backend, self.model)
        self.step_count += 1
        return stats

    def end(self) -> None:
        """Finish training: trackers and process group (`MaskedTokenTrainer.end`); the policy still samples."""
        self.masked_trainer.end()

    # --- checkpoints -----------------------------------------------------------------
    def save(self, directory: str | Path, sampler: Any = None, extra: dict | None = None) -> Path:
        """A resumable checkpoint: model, optimizer, scheduler, RNGs, step count, sampler and ``extra``.

        Tensors go to safetensors / a ``weights_only`` file, the rest
        (``extra`` and the sampler's state included) to JSON; non-finite
        weights are refused (`contrail.train.trainer.NonFiniteError`).
        """
        state: dict[str, Any] = {"grpo_step": self.step_count, "extra": dict(extra or {}),
                                 "backend_rng": self.policy.backend.generator_state()}
        if sampler is not None and hasattr(sampler, "state_dict"):
            state["sampler"] = sampler.state_dict()
        saved = self.masked_trainer.save(Path(directory), extra=state)
        # Each process samples its own episodes from its own generator: keep every process's state,
        # not only the main process's (the shared state files are written by the main process alone).
        path = saved / f"rollout_rng-{self.accelerator.process_index}.pt"
        partial = path.with_name(path.name + ".partial")
        torch.save({"backend_rng": self.policy.backend.generator_state()}, partial)
        partial.replace(path)
        self.accelerator.wait_for_everyone()
        return saved

    def load_weights(self, directory: str | Path) -> None:
        """Load the weights a `save` wrote (``directory/model``) into the live model, in place, and sample from them.

        For a checkpoint taken within a run (`contrail.runner`): a strategy's
        ``before_stage`` has already seen the stage's starting weights. One
        process, DDP or FSDP; not DeepSpeed (`MaskedTokenTrainer.load_weights`).
        """
        self.masked_trainer.load_weights(Path(directory) / "model")
        sync_after_update(self.policy.backend, self.model)  # a backend with its own copy must take these

    def load_state(self, directory: str | Path, sampler: Any = None) -> dict:
        """Restore what `save` wrote (the caller loads the model weights); return its ``extra``."""
        state = self.masked_trainer.load_state(Path(directory))
        self.step_count = int(state["grpo_step"])
        own = Path(directory) / f"rollout_rng-{self.accelerator.process_index}.pt"
        rng = load_tensors_file(own)["backend_rng"] if own.is_file() else state["backend_rng"]
        self.policy.backend.set_generator_state(rng)
        if sampler is not None and "sampler" in state:
            sampler.load_state_dict(state["sampler"])
        return state.get("extra", {})

    # --- inside an update ------------------------------------------------------------
    def _check_error_rate(self, trajectories: list[Trajectory]) -> int:
        failed = [t for t in trajectories if t.error is not None]
        total_failed = self.masked_trainer.sum_over_processes(float(len(failed)))
        total = self.masked_trainer.sum_over_processes(float(len(trajectories)))
        if total and total_failed / total > self.config.max_error_rate:
            first = (f"first: {failed[0].task.env} task {failed[0].task.id}: {failed[0].error}" if failed
                     else "the failures were on another process")
            raise TooManyEpisodeErrors(
                f"{int(total_failed)} of {int(total)} episodes of step {self.step_count + 1} failed in their "
                f"environment, above max_error_rate={self.config.max_error_rate:g}; {first}"
            )
        return len(failed)

    def _has_signal(self, samples: list[GRPOSample]) -> bool:
        """Update when any process has a sample with signal; every process must then take part.

        Under data parallelism each process must run the same number of
        optimizer steps, so a process with nothing to train on trains on a
        filler sample whose mask is empty (it adds nothing to any loss).
        """
        return self.masked_trainer.sum_over_processes(float(len(samples))) > 0

    def _dilution(self, played: list[Trajectory], samples: list[GRPOSample]) -> float:
        """How many times the loss's units (episodes or tokens) the mean runs over exceed the trained ones.

        1 under ``mean_over="trained"``. Under ``"played"`` the units of every
        episode the update kept (skipped zero-advantage groups included, each
        adding 0) over those of the trained samples, summed over processes.
        """
        if self.config.mean_over == "trained":
            return 1.0
        played_total = self.masked_trainer.sum_over_processes(self._units(played))
        trained_total = self.masked_trainer.sum_over_processes(self._units(samples))
        return played_total / trained_total if trained_total else 1.0

    def _optimize(self, samples: list[GRPOSample], dilution: float = 1.0) -> dict[str, float]:
        self._attach_old_and_ref_logprobs(samples)
        rng = random.Random(derive_seed(self.seed, "update", self.step_count))
        totals: dict[str, list[float]] = {}
        loss = functools.partial(self._loss, dilution=dilution)
        for _ in range(self.config.ppo_epochs):
            order = list(range(len(samples)))
            rng.shuffle(order)
            for indices in np.array_split(np.array(order), min(self.config.minibatches, len(order))):
                batch = [samples[i] for i in indices]
                normalizer = self._normalizer(batch) * dilution
                stats = self.masked_trainer.step(batch, loss, normalizer=normalizer)
                for key, value in stats.items():
                    totals.setdefault(key, []).append(value)
        out = {key: float(np.mean(values)) for key, values in totals.items()}
        if "nonfinite_skipped" in totals:
            out["nonfinite_skipped"] = float(sum(totals["nonfinite_skipped"]))
        return out

    def _units(self, episodes: list[GRPOSample] | list[Trajectory]) -> float:
        """What the loss's mean counts in ``episodes`` on this process: trained tokens or episodes with any."""
        if self.config.aggregation == "token-mean":
            return float(sum(sum(e.mask) for e in episodes))
        return float(sum(1 for e in episodes if any(e.mask)))

    def _normalizer(self, batch: list[GRPOSample]) -> float:
        return max(self.masked_trainer.sum_over_processes(self._units(batch)), 1.0)

    def _share(self, batch: Batch, normalizer: float) -> float:
        """This micro-batch's share of its minibatch, in the aggregation's units."""
        if self.config.aggregation == "token-mean":
            return float(batch.loss_mask.sum()) / normalizer
        return float(batch.loss_mask.bool().any(dim=1).sum()) / normalizer

    @property
    def _single_update(self) -> bool:
        """One optimizer step per rollout batch: the old policy *is* the current one."""
        return self.config.ppo_epochs * self.config.minibatches == 1

    def _loss(self, model, batch: Batch, normalizer: float, dilution: float = 1.0
              ) -> tuple[torch.Tensor, dict[str, float]]:
        # Logits only where they predict a sampled token: the prompt's and the observations' would be discarded.
        logprobs, entropy = sequence_logprobs(model, batch.input_ids, batch.attention_mask, start=batch.start,
                                              return_entropy=True, shared_prefix=batch.shared_prefix,
                                              positions=batch.loss_mask, packed=batch.packed)
        samples: list[GRPOSample] = batch.samples  # type: ignore[assignment]
        # With a single update the ratio is exactly 1 at this point (as TRL does): no extra forward.
        old = logprobs.detach() if self._single_update else padded([s.old_logprobs for s in samples], batch)
        ref = padded([s.ref_logprobs for s in samples], batch) if self.reference is not None else None
        advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=logprobs.device)
        weights = self._importance_weights(old, samples, batch) if self.config.importance_sampling_correction else None
        loss, stats = policy_loss(
            logprobs, old, advantages, batch.loss_mask, clip_low=self.config.clip_low,
            clip_high=self.config.clip_high, aggregation=self.config.aggregation, ref_logprobs=ref,
            beta=self.config.beta, entropy=entropy if self.config.entropy_coef > 0 else entropy.detach(),
            entropy_coef=self.config.entropy_coef, normalizer=normalizer, weights=weights,
        )
        stats = {k: float(v) for k, v in stats.items() if k != "tokens"}
        if weights is not None:
            mask = batch.loss_mask.bool()
            stats["is_weight_mean"] = float(weights[mask].mean()) if mask.any() else 1.0
        if self._loss_terms:
            share = self._share(batch, normalizer / dilution)  # a loss term counts once per optimizer step
            for term in list(self._loss_terms):
                value, term_stats = term(model, batch, logprobs)
                if not isinstance(value, torch.Tensor) or value.dim() != 0:
                    raise TypeError(f"loss term {term!r} must return (scalar tensor, stats), got {value!r}")
                loss = loss + share * value
                stats.update({k: float(v) for k, v in term_stats.items()})
        return loss, stats

    def _importance_weights(self, old: torch.Tensor, samples: list[GRPOSample], batch: Batch) -> torch.Tensor:
        """Truncated IS weights ``min(exp(old - sampler), cap)`` per token (TRL's vLLM IS correction).

        ``old`` is the trainer's log-prob before this step's updates; the
        sampler's come from the trajectory. They differ by the engine's
        numerics (bf16, kernels), so the rollout is slightly off-policy.
        """
        sampler = padded([torch.tensor(s.sampler_logprobs, dtype=torch.float32) for s in samples], batch)
        return torch.exp(old.detach().float() - sampler).clamp(max=self.config.importance_sampling_cap)

    @torch.no_grad()
    def _attach_old_and_ref_logprobs(self, samples: list[GRPOSample]) -> None:
        """Log-probs of the sampled tokens under the policy before this step's updates (and the reference).

        Recomputed with the training forward rather than taken from the
        sampler, so the first update's ratio is exactly 1 (as TRL and verl do).
        """
        models = [] if self._single_update else [("old_logprobs", self.masked_trainer.model)]
        if self.reference is not None:
            models.append(("ref_logprobs", self.reference))
        if not models:
            return
        self.masked_trainer.model.eval()
        for group in self.masked_trainer.micro_batches(samples):
            batch = self.masked_trainer.collate([samples[i] for i in group])
            for field, model in models:
                with self.masked_trainer.autocast(), self._reference_context(field):
                    logprobs = sequence_logprobs(model, batch.input_ids, batch.attention_mask, start=batch.start,
                                                 shared_prefix=batch.shared_prefix, positions=batch.loss_mask,
                                                 packed=batch.packed).float().cpu()
                for row, index in enumerate(group):
                    setattr(samples[index], field, logprobs[row, : len(samples[index].ids)].clone())

    def _make_reference(self):
        """The model at the start of training, frozen. With LoRA the base model *is* the reference."""
        if self.config.lora:
            return self.masked_trainer.model
        reference = copy.deepcopy(self.model).eval()
        for parameter in reference.parameters():
            parameter.requires_grad_(False)
        return reference

    def _reference_context(self, field: str):
        if field == "ref_logprobs" and self.config.lora:
            return self.model.disable_adapter()
        return contextlib.nullcontext()

    def _log(self, stats: dict[str, float]) -> None:
        numbers = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
        self.accelerator.log(numbers, step=self.step_count)
        if self.log_path is not None and self.accelerator.is_main_process:
            # JSON has no NaN: a non-finite value (a skipped update's loss) is written as null.
            line = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in stats.items()}
            with open(self.log_path, "a", encoding="utf-8") as sink:
                sink.write(json.dumps(line) + "\n")


def _filler(trajectories: list[Trajectory]) -> GRPOSample:
    """A sample with an empty mask: lets a process take part in a data-parallel update, adding nothing."""
    ids = trajectories[0].ids or [0]
    return GRPOSample(ids=list(ids), mask=[0] * len(ids), advantage=0.0)


def _advantage_stats(advantages: torch.Tensor) -> dict[str, float]:
    if advantages.numel() == 0:
        return {"advantage_mean": 0.0, "advantage_std": 0.0, "advantage_abs_mean": 0.0}
    return {"advantage_mean": float(advantages.mean()),
            "advantage_std": float(advantages.std()) if advantages.numel() > 1 else 0.0,
            "advantage_abs_mean": float(advantages.abs().mean())}


def _rollout_stats(trajectories: list[Trajectory]) -> dict[str, float]:
    return {
        "reward_mean": float(np.mean([t.reward for t in trajectories])),
        "success_rate": float(np.mean([t.success for t in trajectories])),
        "turns_mean": float(np.mean([t.turns for t in trajectories])),
        "generated_tokens": float(sum(t.generated_tokens for t in trajectories)),
        "episode_tokens_mean": float(np.mean([len(t.ids) for t in trajectories])),
        "invalid_rate": per_turn_rate(trajectories, "invalid_actions"),
        "cut_rate": per_turn_rate(trajectories, "cut_turns"),
        "truncated_rate": float(np.mean([t.truncated for t in trajectories])),
    }
