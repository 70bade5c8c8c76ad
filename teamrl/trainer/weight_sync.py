"""The one way a policy's new weights leave the learner for the rollout engine: :class:`WeightSync`.

Every new version of a policy goes through :meth:`WeightSync.publish`, wherever rollouts sample from:

- in process (``policy.placement: local``, synchronous loop): the engine samples from the trained model itself,
  so nothing moves;
- a driver copy (policy workers on Ray, or the asynchronous loop's own copy): the learner's weights (or a snapshot
  of them taken after an update) are loaded into the driver's copy, the one rollouts sample from;
- a server (``rollout.engine: http`` or ``vllm``, one endpoint or a pool): the adapter is uploaded and, with
  ``rollout.server_sync_check``, the server's log-probs are checked against the trainer's
  (:meth:`teamrl.rollout.http_engine.HTTPEngine.sync_weights`, :meth:`teamrl.rollout.pool.EnginePool.sync_weights`).

The last two compose: a Ray worker's update reaches a server through the driver's copy.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from teamrl.rollout.engine import Engine


class DriverCopies(Protocol):
    """Where the learner's weights are copied for rollouts (:class:`teamrl.trainer.workers.PolicyPlacement`)."""

    def to_driver(self, name: str, weights: dict[str, torch.Tensor] | None = None) -> None: ...


class WeightSync:
    """Publish each policy's newest weights to what rollouts sample from: the driver's copy, then the engine."""

    def __init__(self, copies: DriverCopies, engine: Engine) -> None:
        self.copies = copies
        self.engine = engine

    def publish(self, name: str, weights: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        """Make rollouts of policy ``name`` sample from its newest weights (``weights``: a snapshot taken after an
        update, else the learner's weights now). Returns the server's sync figures (``{}`` in process)."""
        self.copies.to_driver(name, weights)
        self.engine.sync_weights(name)
        figures: dict[str, Any] = getattr(self.engine, "sync_figures", {}).get(name) or {}
        return {k: v for k, v in figures.items() if k != "version"}
