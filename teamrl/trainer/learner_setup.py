"""The learner a run gets (``policy.placement``, ``policy.ranks``): in this process, on Ray actors, or sharded over
ranks (:mod:`teamrl.trainer.sharded_learner`), as :mod:`teamrl.rollout.engine_setup` builds the engine."""

from __future__ import annotations

from typing import Sequence

from teamrl.core.config import Config
from teamrl.policies.router import PolicyRouter
from teamrl.trainer.learner import Learner, LocalLearner, RayLearner, own_copy


def make_learner(cfg: Config, router: PolicyRouter, roles: Sequence[str], separate: bool) -> Learner:
    """The learner ``policy.placement`` asks for. ``separate`` (rollouts run ahead of the learner): a local learner
    trains its own copy of ``router``'s trainable weights, so that an update never writes what a rollout reads."""
    if cfg.policy.placement == "ray" and any(n > 1 for n in cfg.policy.ranks.values()):
        from teamrl.trainer.sharded_learner import ShardedLearner  # torch.distributed's DTensor: only when sharded

        return ShardedLearner(cfg, router, roles)
    if cfg.policy.placement == "ray":
        return RayLearner(cfg, router, roles)
    return LocalLearner(own_copy(router) if separate else router)
