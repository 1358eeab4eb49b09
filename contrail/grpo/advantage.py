"""Group-relative advantages: the "G" in GRPO.

GRPO (Shao et al. 2024, "DeepSeekMath", eq. 3) replaces PPO's value network
with a baseline computed from the other rollouts of the same prompt. Rollouts
arrive in groups of ``group_size`` consecutive entries, all of one task::

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)

``std_g`` is the sample standard deviation (Bessel-corrected, ddof=1), as TRL
computes it (``trl.trainer.utils.nanstd``); ``eps = 1e-4`` is TRL's constant.
Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", §3.1)
argues the division by ``std_g`` biases the update towards too-easy and
too-hard tasks and keeps only the centring: ``A_i = r_i - mean_g(r)``
(``scale=False``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["group_advantages"]


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_size: int,
    scale: bool = True,
    eps: float = 1e-4,
) -> torch.Tensor:
    """Advantage of each rollout relative to the other rollouts of its task.

    ``A_i = (r_i - mean_g) / (std_g + eps)`` with ``std_g`` the sample std
    (ddof=1) of the group of ``group_size`` consecutive rewards that holds
    ``r_i``; with ``scale=False``, ``A_i = r_i - mean_g`` (Dr. GRPO).

    A group whose rewards are all equal carries no learning signal: its
    advantages are exactly zero (never NaN, never float round-off such as
    ``0.1 - mean([0.1, 0.1, 0.1]) != 0``). A group of one rollout has no
    baseline but itself, so its advantage is zero too.

    Args:
        rewards: 1-D tensor or sequence of floats, length a multiple of
            ``group_size``.
        group_size: rollouts per task (TRL's ``num_generations``).
        scale: divide by the group's std (GRPO) or not (Dr. GRPO).
        eps: added to the std so a near-constant group cannot explode.

    Returns:
        A float tensor shaped like ``rewards`` (float32 unless ``rewards`` was
        already a floating tensor, whose dtype is kept).
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    r = torch.as_tensor(rewards)
    if not torch.is_floating_point(r):
        r = r.to(torch.float32)
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D (one reward per rollout), got shape {tuple(r.shape)}")
    if r.numel() % group_size != 0:
        raise ValueError(
            f"len(rewards)={r.numel()} is not a multiple of group_size={group_size}: "
            "rewards must hold whole groups of consecutive rollouts of one task"
        )
    if r.numel() == 0:
        return r.clone()
    if not torch.isfinite(r).all():
        raise ValueError("rewards contain NaN or inf; score every rollout before computing advantages")

    groups = r.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    # Equal rewards → exactly zero; the mean's round-off would otherwise leak
    # tiny advantages (and then tiny/eps-sized ones after scaling).
    constant = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    centred = torch.where(constant, torch.zeros_like(centred), centred)
    if scale and group_size > 1:
        std = groups.std(dim=1, correction=1, keepdim=True)
        centred = centred / (std + eps)
    # group_size == 1: every group is constant, so centred is already zero
    # (and std with ddof=1 would be NaN, which is why it is skipped).
    return centred.reshape(-1)
