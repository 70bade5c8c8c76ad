"""One rollout server per policy: full-weight policies that each need a whole model of their own.

A server holds one model, so a run whose policies are separate full-weight models (``policy.lora: null``,
``policy.mode: separate``: M-GRPO's main and sub agent, AT-GRPO's per-role policies at full scale, two full-weight
MAGRPO agents) serves each from its own server, which reloads that policy's weights after each of its updates.
:class:`PolicyRoutes` is those servers as one :class:`~teamrl.rollout.engine.Engine`: a policy's requests, its weight
sync and its sync check go to its own server only; the policies of one flush are sent at once, each on its own
thread, so the servers decode side by side.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

from teamrl.rollout.engine import Completion, Engine, GenerationRequest


class PolicyRoutes(Engine):
    """``routes``: policy -> the engine (one server, or a pool of servers) that serves it and only it."""

    def __init__(self, routes: Mapping[str, Engine]) -> None:
        if not routes:
            raise ValueError("PolicyRoutes: give at least one policy's engine")
        self.routes = dict(routes)

    def _engine(self, policy: str) -> Engine:
        if policy not in self.routes:
            raise KeyError(f"policy {policy!r} has no rollout server; the servers serve {sorted(self.routes)}")
        return self.routes[policy]

    def generate(self, policy: str, requests: Sequence[GenerationRequest],
                 seed: int | None = None) -> list[list[Completion]]:
        return self._engine(policy).generate(policy, requests, seed)

    def generate_many(
        self, calls: Sequence[tuple[str, Sequence[GenerationRequest], int | None]]
    ) -> list[list[list[Completion]]]:
        """Each call on its policy's server, all at once."""
        if len(calls) < 2:
            return [self.generate(policy, requests, seed) for policy, requests, seed in calls]
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            futures = [pool.submit(self.generate, policy, requests, seed) for policy, requests, seed in calls]
            return [f.result() for f in futures]

    def sync_weights(self, policy: str) -> None:
        """Policy ``policy``'s new weights to its own server (there: written, reloaded and checked)."""
        self._engine(policy).sync_weights(policy)

    @property
    def sync_figures(self) -> dict[str, dict[str, float]]:
        """Each policy's last sync check, as its server measured it."""
        return {p: e.sync_figures[p] for p, e in self.routes.items() if p in getattr(e, "sync_figures", {})}

    def close(self) -> None:
        """Close every policy's server client (the first error raised after all were closed)."""
        errors: list[BaseException] = []
        for engine in {id(e): e for e in self.routes.values()}.values():
            close: Any = getattr(engine, "close", None)
            try:
                if close is not None:
                    close()
            except Exception as e:  # close the others all the same
                errors.append(e)
        if errors:
            raise errors[0]
