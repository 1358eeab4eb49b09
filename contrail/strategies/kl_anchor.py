"""``kl_anchor``: sequential stages plus β·KL(π_θ ‖ π_prev) on every update's sampled tokens.

π_prev is the policy as it was at the end of the previous stage (for stage 1,
the start model), a frozen copy taken in `before_stage`: distillation against
forgetting, as LwF (Li & Hoiem 2016) does for supervised learning, here on the
policy's own samples. Per sampled token the k3 estimator of the KL
(Schulman 2020), the one GRPO's KL to the reference uses::

    d = log π_prev(o_t) - log π_θ(o_t);    k3 = exp(d) - d - 1  (>= 0, 0 iff equal)

averaged over the batch's sampled tokens. Resume-safe: the runner loads the
last finished stage's weights before it calls `before_stage`, so the copy
taken there is that stage's policy. ``beta = 0`` only measures the KL
(``anchor_kl`` in the step stats), which makes it the control run.
Costs one frozen copy of the model and one extra no-grad forward per micro-batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from contrail.strategies.base import Stage
from contrail.strategies.registry import register
from contrail.strategies.sequential import Sequential
from contrail.train.config import check_number
from contrail.train.logprobs import sequence_logprobs


@register("kl_anchor")
@dataclass
class KLAnchor(Sequential):
    """Sequential, with each update pulled towards the previous stage's policy by ``beta``·KL."""

    beta: float = 0.1
    _anchor: Any = field(default=None, init=False, repr=False, compare=False)
    _remove: Callable[[], None] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("beta", self.beta, low=0.0)

    @property
    def anchor(self) -> torch.nn.Module | None:
        """The frozen policy of the previous stage while a stage trains; ``None`` between stages."""
        return self._anchor

    def before_stage(self, stage: Stage, trainer) -> None:
        self._release()
        self._anchor = frozen_copy(trainer.model)
        self._remove = trainer.add_loss_term(self.loss_term)

    def after_stage(self, stage: Stage, trainer) -> None:
        self._release()  # the copy's memory is free during evaluation

    def loss_term(self, model, batch, logprobs: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """``beta`` times the mean k3 KL to the anchor over the batch's sampled tokens."""
        with torch.no_grad():
            anchor = sequence_logprobs(self._anchor, batch.input_ids, batch.attention_mask, start=batch.start,
                                       shared_prefix=batch.shared_prefix, positions=batch.loss_mask)
        mask = batch.loss_mask.bool()
        # Masked positions are zeroed before exp: their values are padding, maybe -inf.
        delta = torch.where(mask, anchor.float() - logprobs.float(), torch.zeros((), device=logprobs.device))
        kl = (delta.exp() - delta - 1.0).sum() / mask.sum().clamp(min=1)
        return self.beta * kl, {"anchor_kl": float(kl.detach())}

    def _release(self) -> None:
        if self._remove is not None:
            self._remove()
        self._anchor, self._remove = None, None


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` in eval mode with no parameter requiring gradients."""
    anchor = copy.deepcopy(model).eval()
    for parameter in anchor.parameters():
        parameter.requires_grad_(False)
    return anchor
