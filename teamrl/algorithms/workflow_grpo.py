"""The workflow study's GRPO is :mod:`teamrl.algorithms.grpo` (one GRPO per role call); these names stay importable."""

from teamrl.algorithms.grpo import WorkflowGRPO, assign_rewards, group_key, outcome_metrics

__all__ = ["WorkflowGRPO", "assign_rewards", "group_key", "outcome_metrics"]
