"""GRPO core: pure tensor functions (advantages, loss); the trainer builds on them."""

from contrail.grpo.advantage import group_advantages
from contrail.grpo.loss import AGGREGATIONS, loss_normalizer, policy_loss

__all__ = ["AGGREGATIONS", "group_advantages", "loss_normalizer", "policy_loss"]
