"""The one way a policy's new weights leave the learner for the rollout engine: :meth:`WeightSync.publish`.

Three kinds, one class each, composed by :class:`WeightSync`:

- **in process** (:class:`InProcess`; ``policy.placement: local``, rollouts not ahead of the learner): the engine
  samples from the trained model itself, so nothing moves;
- **a driver copy** (:class:`DriverCopy`; policies on Ray workers, or a collector running ahead of the learner): the
  learner's weights (or a copy of them taken after an update) are loaded into the driver's copy, the one rollouts
  sample from;
- **a server upload** (the engine's own ``sync_weights``: :meth:`teamrl.rollout.http_engine.HTTPEngine.sync_weights`,
  one endpoint, or :meth:`teamrl.rollout.pool.EnginePool.sync_weights`, each endpoint of a pool): the adapter is
  uploaded and, with ``rollout.server_sync_check``, the server's log-probs are checked against the trainer's. The
  in-process engine's ``sync_weights`` does nothing; a new engine is one class with its own ``sync_weights``.

A copy and an upload compose: a Ray worker's update reaches a server through the driver's copy.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from teamrl.policies.router import PolicyRouter
from teamrl.rollout.engine import Engine


class WeightSource(Protocol):
    """Where trained weights come from (a :class:`~teamrl.trainer.learner.Learner`)."""

    def version(self, name: str) -> int: ...

    def weights(self, name: str) -> dict[str, torch.Tensor]: ...


class InProcess:
    """Rollouts sample from the very weights the learner trains: a new version is already there."""

    def publish(self, name: str, weights: dict[str, torch.Tensor] | None = None) -> None:
        if weights is not None:
            raise RuntimeError(
                f"policy {name!r}: the rollout engine samples from the trained weights themselves; there "
                "is no separate copy to load a snapshot into"
            )


class DriverCopy:
    """Rollouts sample from the driver's copy (``router``) of each policy the ``source`` trains."""

    def __init__(self, router: PolicyRouter, source: WeightSource) -> None:
        self.router, self.source = router, source
        self._copied = {name: source.version(name) for name in router.policies}  # the version each copy holds

    def publish(self, name: str, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Load ``weights`` (a copy taken after an update) into the driver's copy of ``name``; without them, the
        source's weights now, fetched only when their version changed since the last copy."""
        if weights is None:
            version = self.source.version(name)
            if version == self._copied[name]:
                return
            weights, self._copied[name] = self.source.weights(name), version
        self.router.policies[name].load_named_state(weights)


class WeightSync:
    """Publish each policy's newest weights to what rollouts sample from: the driver's copy (when there is one),
    then the engine (a server's upload and sync check)."""

    def __init__(self, copy: InProcess | DriverCopy, engine: Engine) -> None:
        self.copy = copy
        self.engine = engine

    def publish(self, name: str, weights: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        """Make rollouts of policy ``name`` sample from its newest weights (``weights``: a copy taken after an
        update, else the learner's weights now). Returns the server's sync figures (``{}`` in process)."""
        self.copy.publish(name, weights)
        self.engine.sync_weights(name)
        figures: dict[str, Any] = getattr(self.engine, "sync_figures", {}).get(name) or {}
        return {k: v for k, v in figures.items() if k != "version"}
