"""Batching generation across everything in flight.

Workflows are coroutines that ``await scheduler.generate(policy, request)``. The scheduler
lets every episode run until it waits on generation, then sends all pending requests of
each policy to the engine in one call: every episode, branch and agent shares the batch.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any, Awaitable, Sequence

from teamrl.core.seeding import derive_seed
from teamrl.rollout.engine import Completion, Engine, GenerationRequest


class GenerationScheduler:
    """Runs coroutines and batches their generation requests per policy.

    ``calls`` records (policy, number of requests) per policy per flush, so tests and benchmarks
    can check that requests were batched. The policies of one flush go to the engine together
    (:meth:`Engine.generate_many`), so policies on a shared base can decode in one batch.
    """

    def __init__(self, engine: Engine, seed: int = 0) -> None:
        self.engine = engine
        self.seed = seed
        self.flushes = 0
        self.calls: list[tuple[str, int]] = []  # (policy, number of requests) per policy per flush
        self._pending: list[tuple[str, GenerationRequest, asyncio.Future]] = []
        # set by generate(): wakes the loop early (requests from other threads)
        self._arrived: asyncio.Event | None = None
        # coroutines about to issue requests (a replayed branch running to its next call): no flush until they are done
        self.holds = 0

    async def generate(self, policy: str, request: GenerationRequest) -> list[Completion]:
        """Queue ``request`` for ``policy``; resolves when the batch it joined is generated."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending.append((policy, request, fut))
        if self._arrived is not None:
            self._arrived.set()
        return await fut

    def run(self, coros: Sequence[Awaitable[Any]]) -> list[Any]:
        """Run the coroutines to completion; return their results in order."""
        return asyncio.run(self._run(list(coros)))

    async def _run(self, coros: list[Awaitable[Any]]) -> list[Any]:
        tasks = [asyncio.ensure_future(c) for c in coros]
        try:
            while True:
                await self._settle(tasks)
                failed = [t for t in tasks if t.done() and t.exception() is not None]
                if failed:
                    raise failed[0].exception()
                if self._pending:
                    self._flush()
                elif all(t.done() for t in tasks):
                    break
                else:  # episodes wait on something else (e.g. a sandbox run, or gateway calls from other threads)
                    self._arrived = asyncio.Event()
                    arrived = asyncio.ensure_future(self._arrived.wait())
                    await asyncio.wait(
                        [*(t for t in tasks if not t.done()), arrived],
                        return_when=asyncio.FIRST_COMPLETED,
                        timeout=0.05,
                    )
                    arrived.cancel()
                    self._arrived = None
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
                elif not t.cancelled():
                    # retrieved here: an interrupt raised inside one episode leaves its task holding it, which asyncio
                    # would log ("never retrieved", with a traceback) when the task is collected, after the run ended
                    t.exception()
            self._pending = []
        return [t.result() for t in tasks]

    async def _settle(self, tasks: list[asyncio.Task]) -> None:
        """Yield until every live episode waits on generation, or nothing moves any more."""
        still = 0
        last = -1
        while still < 3:
            await asyncio.sleep(0)
            state = len(self._pending) + sum(t.done() for t in tasks)
            if self.holds:  # a branch is still replaying towards its next call
                still, last = 0, -1
                continue
            if state == len(tasks):
                return
            still = still + 1 if state == last else 0
            last = state

    def _flush(self) -> None:
        by_policy: dict[str, list[tuple[GenerationRequest, asyncio.Future]]] = defaultdict(list)
        for policy, req, fut in self._pending:
            by_policy[policy].append((req, fut))
        self._pending = []
        calls = []
        for policy, items in by_policy.items():
            calls.append((policy, [r for r, _ in items], derive_seed(self.seed, self.flushes, len(self.calls))))
            self.calls.append((policy, len(items)))
        if isinstance(self.engine, Engine):  # one call: policies on a shared base decode in one batch
            results = self.engine.generate_many(calls)
        else:  # a duck-typed engine with only generate()
            results = [self.engine.generate(policy, reqs, seed=seed) for policy, reqs, seed in calls]
        for items, res in zip(by_policy.values(), results):
            for (_, fut), r in zip(items, res):
                fut.set_result(r)
        self.flushes += 1
