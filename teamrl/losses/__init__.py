"""Losses: group-relative advantages and the clipped token-level policy loss."""

from teamrl.losses.advantages import (ADVANTAGE_MODES, group_advantages, group_ids_from_keys, trajectory_advantages,
                                     trajectory_ids)
from teamrl.losses.policy_loss import AGGREGATIONS, TRL_LOSS_TYPES, LossConfig, completion_mask, policy_loss

__all__ = [
    "ADVANTAGE_MODES",
    "AGGREGATIONS",
    "LossConfig",
    "TRL_LOSS_TYPES",
    "completion_mask",
    "group_advantages",
    "group_ids_from_keys",
    "policy_loss",
    "trajectory_advantages",
    "trajectory_ids",
]
