"""The GRPO policy loss: PPO's clipped surrogate over masked tokens, plus KL.

Per token t of sequence i (Shao et al. 2024, "DeepSeekMath", eq. 3; the clip
is PPO's, Schulman et al. 2017, eq. 7; asymmetric ``clip_high`` is DAPO's
"clip-higher", Yu et al. 2025, eq. 10)::

    ρ_it  = exp(logπ_θ(o_it) - logπ_old(o_it))
    ℓ_it  = -min(ρ_it·A_i, clip(ρ_it, 1 - clip_low, 1 + clip_high)·A_i)
            + β·k3_it - entropy_coef·H_it
    k3_it = exp(ref_it - logπ_θ_it) - (ref_it - logπ_θ_it) - 1

k3 is Schulman's unbiased, always-positive estimator of KL(π_θ ‖ π_ref)
("Approximating KL Divergence", 2020), the one DeepSeekMath eq. 4 uses.

Aggregation over the masked tokens M (only generated tokens are trained):

- ``"token-mean"``: Σ_{i,t∈M} ℓ_it / |M|. Every token weighs the same, so long
  answers are not diluted (DAPO's "token-level policy gradient loss"; TRL's
  ``bnpo``, and ``dapo`` when the batch is the whole minibatch).
- ``"seq-mean-token-mean"``: mean over sequences of each sequence's own masked
  mean (the original GRPO objective; TRL's ``grpo``). Sequences with no
  masked token are skipped rather than counted as zero.

The same formulas are in TRL's ``GRPOTrainer._compute_loss``
(trl/trainer/grpo_trainer.py); tests/test_trl_parity.py checks the numbers.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["AGGREGATIONS", "loss_normalizer", "policy_loss"]

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: str = "token-mean",
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    normalizer: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Clipped GRPO loss of one batch; see the module docstring for the equation.

    Args:
        logprobs: ``(batch, tokens)`` log-probs of the sampled tokens under the
            current policy; the only input gradients flow into.
        old_logprobs: ``(batch, tokens)`` the same under the policy that sampled
            them (detached: it is a constant of the update).
        advantages: ``(batch,)`` one advantage per sequence.
        mask: ``(batch, tokens)`` bool or 0/1; 1 exactly on trained tokens.
            Masked-out positions may hold anything (even -inf or NaN): they are
            replaced before any arithmetic, so they add nothing to the loss and
            no NaN to its gradient.
        clip_low, clip_high: the ratio is clipped to
            ``[1 - clip_low, 1 + clip_high]``.
        aggregation: ``"token-mean"`` or ``"seq-mean-token-mean"``.
        ref_logprobs: ``(batch, tokens)`` under the reference policy; needed
            when ``beta > 0``, reported as ``kl_mean`` whenever given.
        beta: weight of the k3 KL penalty.
        entropy: ``(batch, tokens)`` per-token entropy of the current policy;
            needed when ``entropy_coef != 0``.
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        normalizer: for gradient accumulation over micro-batches of one
            minibatch. ``token-mean``: the loss is Σ ℓ / normalizer, with
            normalizer = the minibatch's masked-token count. ``seq-mean-token-mean``:
            Σ_i mean_t ℓ_it / normalizer, with normalizer = the minibatch's
            number of sequences that have a masked token. Summing the
            micro-batches' losses then gives the full minibatch's loss
            (:func:`loss_normalizer` computes the number). ``None``: this batch
            is the whole minibatch.
        weights: ``(batch, tokens)`` per-token weights multiplying each
            token's whole loss (detached): the truncated importance-sampling
            correction ``min(exp(old - sampler), cap)``. ``None``: all 1.

    Returns:
        ``(loss, stats)``: a scalar tensor, and python floats over the masked
        tokens: ``clip_fraction`` (share of tokens whose clipped term won the
        min), ``ratio_mean``, ``kl_mean`` (0 without ``ref_logprobs``),
        ``entropy_mean`` (only when ``entropy`` is given) and ``tokens``. With
        no masked token the means are 0 and the loss is 0.
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask, ref_logprobs, entropy, aggregation)
    _check_coefficients(clip_low, clip_high, beta, entropy_coef, normalizer)
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError(f"beta={beta} needs ref_logprobs (the reference policy's log-probs); pass them or set beta=0")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError(
            f"entropy_coef={entropy_coef} needs the per-token entropy; pass entropy= or set entropy_coef=0"
        )

    m = mask.bool()
    dtype = torch.promote_types(logprobs.dtype, torch.float32)  # ratios in bf16 are too coarse
    # Replace masked positions *before* any arithmetic: torch.where after the
    # fact would still back-propagate 0 * inf = NaN from garbage positions.
    lp = _masked(logprobs.to(dtype), m)
    old = _masked(old_logprobs.detach().to(dtype), m)
    adv = _masked(advantages.detach().to(dtype).unsqueeze(1).expand_as(lp), m)

    ratio = torch.exp(lp - old)
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.min(ratio * adv, clipped_ratio * adv)
    # The clipped term wins the min exactly when the ratio left the trust
    # region in the direction the advantage pushes it (TRL's is_region_clipped).
    clipped = ((ratio > 1.0 + clip_high) & (adv > 0)) | ((ratio < 1.0 - clip_low) & (adv < 0))

    kl = None
    if ref_logprobs is not None:
        ref = _masked(ref_logprobs.detach().to(dtype), m)
        delta = ref - lp
        kl = torch.exp(delta) - delta - 1.0
        if beta != 0.0:
            per_token = per_token + beta * kl

    ent = None
    if entropy is not None:
        ent = _masked(entropy.to(dtype), m)
        if entropy_coef != 0.0:
            per_token = per_token - entropy_coef * ent

    if weights is not None:
        if tuple(weights.shape) != tuple(logprobs.shape):
            raise ValueError(f"weights has shape {tuple(weights.shape)} but logprobs has {tuple(logprobs.shape)}")
        per_token = per_token * _masked(weights.detach().to(dtype), m)
    per_token = _masked(per_token, m)
    loss = _aggregate(per_token, m, aggregation, normalizer)
    stats = _stats(m, ratio, clipped, kl, ent)
    return loss, stats


def loss_normalizer(masks: torch.Tensor | list[torch.Tensor], aggregation: str = "token-mean") -> float:
    """The ``normalizer`` that makes micro-batch losses add up to the minibatch loss.

    ``token-mean``: the minibatch's masked-token count. ``seq-mean-token-mean``:
    its number of sequences with at least one masked token. ``masks`` is the
    minibatch mask or the list of its micro-batches' masks.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")
    parts = [masks] if isinstance(masks, torch.Tensor) else list(masks)
    total = 0
    for part in parts:
        if part.dim() != 2:
            raise ValueError(f"each mask must be (batch, tokens), got shape {tuple(part.shape)}")
        b = part.bool()
        total += int(b.sum()) if aggregation == "token-mean" else int(b.any(dim=1).sum())
    return float(total)


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str, normalizer: float | None) -> torch.Tensor:
    if aggregation == "token-mean":
        total = per_token.sum()
        denominator = normalizer if normalizer is not None else max(int(mask.sum()), 1)
        return total / denominator
    # seq-mean-token-mean
    counts = mask.sum(dim=1)
    seq_means = per_token.sum(dim=1) / counts.clamp(min=1)
    has_tokens = counts > 0
    # Empty sequences contribute 0 to the sum (their per-token terms are 0) and
    # are left out of the count, i.e. skipped.
    denominator = normalizer if normalizer is not None else max(int(has_tokens.sum()), 1)
    return seq_means.sum() / denominator


def _stats(
    mask: torch.Tensor,
    ratio: torch.Tensor,
    clipped: torch.Tensor,
    kl: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> dict[str, Any]:
    tokens = int(mask.sum())

    def mean(x: torch.Tensor) -> float:
        if tokens == 0:
            return 0.0
        return float(torch.where(mask, x.detach().to(torch.float64), 0.0).sum() / tokens)

    stats: dict[str, Any] = {
        "clip_fraction": mean(clipped),
        "ratio_mean": mean(ratio),
        "kl_mean": mean(kl) if kl is not None else 0.0,
        "tokens": float(tokens),
    }
    if entropy is not None:
        stats["entropy_mean"] = mean(entropy)
    return stats


def _check_inputs(logprobs, old_logprobs, advantages, mask, ref_logprobs, entropy, aggregation) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")
    if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 2:
        shape = tuple(logprobs.shape) if isinstance(logprobs, torch.Tensor) else type(logprobs).__name__
        raise ValueError(f"logprobs must be a (batch, tokens) tensor, got {shape}")
    if not torch.is_floating_point(logprobs):
        raise ValueError(f"logprobs must be a floating tensor, got {logprobs.dtype}")
    shape = tuple(logprobs.shape)
    others = {"old_logprobs": old_logprobs, "mask": mask, "ref_logprobs": ref_logprobs, "entropy": entropy}
    for name, x in others.items():
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)} but logprobs has {shape}; they must match")
    if tuple(advantages.shape) != shape[:1]:
        raise ValueError(
            f"advantages must be (batch,) = {shape[:1]}, one per sequence, got {tuple(advantages.shape)}"
        )
    if mask.dtype != torch.bool and not ((mask == 0) | (mask == 1)).all():
        raise ValueError("mask must be bool or hold only 0 and 1")


def _check_coefficients(clip_low, clip_high, beta, entropy_coef, normalizer) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if beta < 0.0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if normalizer is not None and not (math.isfinite(normalizer) and normalizer > 0):
        raise ValueError(f"normalizer must be a positive finite number, got {normalizer}")
    if not math.isfinite(entropy_coef):
        raise ValueError(f"entropy_coef must be finite, got {entropy_coef}")
