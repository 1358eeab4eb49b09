"""``ewc``: sequential stages plus elastic weight consolidation (Kirkpatrick et al. 2017, eq. 3).

From stage 2 on, every update adds the quadratic penalty::

    λ/2 · Σ_i F_i (θ_i - θ*_i)²

θ* = the trainable weights at the end of the previous stage, F = their
diagonal Fisher information, estimated from the policy's own rollouts on
``fisher_tasks`` tasks of the previous stage (its sampler replayed from the
start): per episode, the squared gradient of the log-likelihood of its sampled
tokens, averaged over episodes. Both are computed in `before_stage` from the
trainer's current weights, which the runner restores before calling it, so a
resumed run computes the same F and θ*. With LoRA only the adapter is
trainable, so only it is anchored. Costs two copies of the trainable weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from contrail.strategies.base import Stage, check_positive
from contrail.strategies.registry import register
from contrail.strategies.sampler import stage_sampler
from contrail.strategies.sequential import Sequential
from contrail.train.config import check_number
from contrail.train.logprobs import sequence_logprobs
from contrail.train.trainer import Sample, collate


@register("ewc")
@dataclass
class EWC(Sequential):
    """Sequential, with weights important to the previous stage held near their values by ``lam``."""

    lam: float = 100.0
    fisher_tasks: int = 4
    _plan: Any = field(default=None, init=False, repr=False, compare=False)
    _terms: Any = field(default=None, init=False, repr=False, compare=False)  # (params, fisher, anchor)
    _remove: Callable[[], None] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("lam", self.lam, low=0.0)
        check_positive("fisher_tasks", self.fisher_tasks)

    def plan(self, stream, *, seed: int, base_success: dict[str, float] | None = None) -> list[Stage]:
        stages = super().plan(stream, seed=seed, base_success=base_success)
        self._plan = (stream, {s.index: s for s in stages})  # before_stage needs the previous stage's tasks
        return stages

    def before_stage(self, stage: Stage, trainer) -> None:
        self._release()
        if stage.index == 1:
            return  # nothing learned yet to protect
        if self._plan is None:
            raise RuntimeError("ewc: plan() must run before before_stage() (the runner calls it first)")
        stream, stages = self._plan
        tasks = stage_sampler(stages[stage.index - 1], stream).sample(self.fisher_tasks)
        episodes = [t for t in trainer.collect(tasks) if t.error is None and sum(t.mask)]
        if not episodes:
            raise RuntimeError(f"ewc: none of the Fisher episodes of stage {stage.index - 1} generated a token")
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        fisher = diagonal_fisher(trainer, episodes, params)
        self._terms = (params, fisher, [p.detach().clone() for p in params])
        self._remove = trainer.add_loss_term(self.loss_term)

    def after_stage(self, stage: Stage, trainer) -> None:
        self._release()

    def loss_term(self, model, batch, logprobs: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The penalty; it depends on the weights only, not on the batch."""
        params, fisher, anchor = self._terms
        penalty = sum((f * (p - a).pow(2)).sum() for p, f, a in zip(params, fisher, anchor))
        penalty = 0.5 * self.lam * penalty
        return penalty, {"ewc_penalty": float(penalty.detach())}

    def _release(self) -> None:
        if self._remove is not None:
            self._remove()
        self._terms, self._remove = None, None


def diagonal_fisher(trainer, episodes, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Mean over ``episodes`` of the squared gradient of each episode's sampled-token log-likelihood."""
    model = trainer.model
    was_training = model.training
    model.eval()
    fisher = [torch.zeros_like(p) for p in params]
    for episode in episodes:
        batch = collate([Sample(episode.ids, episode.mask)], trainer.tokenizer.pad_token_id, trainer.accelerator.device)
        logprobs = sequence_logprobs(model, batch.input_ids, batch.attention_mask, start=batch.start,
                                     positions=batch.loss_mask)
        loglik = (logprobs * batch.loss_mask).sum()
        for f, g in zip(fisher, torch.autograd.grad(loglik, params, allow_unused=True)):
            if g is not None:
                f.add_(g.detach().pow(2), alpha=1.0 / len(episodes))
    model.train(was_training)
    return fisher
