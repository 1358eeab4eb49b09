"""From a step's trajectories to typed training samples.

Trajectories arrive in groups of ``group_size`` consecutive episodes of one
task (`GRPOTrainer.collect` plays them so, and a trajectory editor must keep
it so). A group with an episode whose environment raised is left out whole:
its rewards are not comparable, so none of its advantages would mean
anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from contrail.agent.rollout import Trajectory
from contrail.train.trainer import Batch, Sample

__all__ = ["GRPOSample", "check_groups", "drop_failed_groups", "padded", "to_samples"]


@dataclass(kw_only=True)
class GRPOSample(Sample):
    """One episode to train on: its ids and mask, its advantage, and log-probs filled in by the update.

    ``old_logprobs`` / ``ref_logprobs`` are 1-D float tensors aligned with
    ``ids`` (the sampled tokens' log-probs under the policy before this
    step's updates / under the reference), ``None`` until computed.
    ``sampler_logprobs`` are the log-probs the sampler reported (the
    trajectory's), for the importance-sampling correction.
    """

    advantage: float
    sampler_logprobs: list[float] | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None


def check_groups(trajectories: list[Trajectory], group_size: int) -> None:
    """Raise when ``trajectories`` are not whole groups of ``group_size`` consecutive episodes of one task."""
    if len(trajectories) % group_size:
        raise ValueError(
            f"an update needs whole groups of group_size={group_size} consecutive episodes of one task, "
            f"got {len(trajectories)} trajectories (does a trajectory editor add or drop single episodes?)"
        )
    for begin in range(0, len(trajectories), group_size):
        tasks = {t.task for t in trajectories[begin:begin + group_size]}
        if len(tasks) != 1:
            raise ValueError(
                f"trajectories {begin}..{begin + group_size - 1} should be one group of one task, "
                f"got tasks {sorted((t.env, t.id) for t in tasks)}"
            )


def drop_failed_groups(trajectories: list[Trajectory], group_size: int) -> tuple[list[Trajectory], int]:
    """The trajectories of groups where no environment raised, and how many groups were dropped."""
    kept: list[Trajectory] = []
    dropped = 0
    for begin in range(0, len(trajectories), group_size):
        group = trajectories[begin:begin + group_size]
        if any(t.error is not None for t in group):
            dropped += 1
        else:
            kept.extend(group)
    return kept, dropped


def to_samples(trajectories: list[Trajectory], advantages: torch.Tensor,
               skip_zero_advantage: bool) -> list[GRPOSample]:
    """One sample per trajectory that generated something (and, optionally, has a non-zero advantage)."""
    samples = []
    for trajectory, advantage in zip(trajectories, advantages.tolist()):
        if sum(trajectory.mask) == 0:
            continue  # nothing generated (a prompt over the token limit): nothing to train
        if skip_zero_advantage and advantage == 0.0:
            continue  # its group's rewards were all equal: the gradient would be zero anyway
        samples.append(GRPOSample(ids=trajectory.ids, mask=trajectory.mask, advantage=advantage,
                                  sampler_logprobs=trajectory.logprobs))
    return samples


def padded(rows: list[torch.Tensor], batch: Batch) -> torch.Tensor:
    """Per-sample 1-D tensors as one right-padded ``(batch, length)`` float tensor on the batch's device."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    for row, values in enumerate(rows):
        out[row, : len(values)] = values
    return out.to(batch.input_ids.device)
