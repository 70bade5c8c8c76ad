"""Many sandboxed executions at once.

Each execution is a child process; a thread per slot only feeds it and waits, so threads are
enough to keep every core busy.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Sequence

from teamrl.sandbox.limits import SandboxLimits
from teamrl.sandbox.result import ExecutionResult
from teamrl.sandbox.sandbox import run_program

__all__ = ["SandboxJob", "SandboxPool"]


@dataclass(frozen=True)
class SandboxJob:
    """One program to run: arguments of :func:`run_program` (``limits`` None: the pool's)."""

    code: str
    tests: tuple[str, ...] = ()
    limits: SandboxLimits | None = None
    setup: str = ""
    network: str = "auto"
    private_tmp: bool = True

    def __post_init__(self) -> None:
        # Accept any sequence of snippets, keep an immutable tuple.
        if isinstance(self.tests, str):
            raise ValueError("SandboxJob.tests: a sequence of str snippets, not a single str")
        object.__setattr__(self, "tests", tuple(self.tests))


class SandboxPool:
    """Runs sandboxed programs in parallel, ``workers`` at a time (default: one per CPU).

    ``map`` runs a batch and returns results in input order; ``submit`` returns a
    ``concurrent.futures.Future`` (``await pool.run(...)`` or ``asyncio.wrap_future`` for
    asyncio code). Use as a context manager, or call ``close()``.
    """

    def __init__(self, workers: int | None = None, limits: SandboxLimits | None = None):
        if workers is None:
            workers = os.cpu_count() or 1
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"SandboxPool: workers={workers!r}; expected a positive int or None (one per CPU)")
        if limits is not None and not isinstance(limits, SandboxLimits):
            raise ValueError(f"SandboxPool: limits must be a SandboxLimits or None, got {type(limits).__name__}")
        self.workers = workers
        self.limits = limits or SandboxLimits()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="teamrl-sandbox")

    def submit(
        self,
        code: str,
        tests: Sequence[str] = (),
        limits: SandboxLimits | None = None,
        setup: str = "",
        *,
        network: str = "auto",
        private_tmp: bool = True,
    ) -> Future[ExecutionResult]:
        """Queue one run; the future resolves to its ExecutionResult (never to an exception
        caused by the program; invalid arguments raise ValueError here, at once)."""
        tests = tuple(tests) if not isinstance(tests, str) else tests
        if isinstance(tests, str) or not all(isinstance(t, str) for t in tests):
            raise ValueError("SandboxPool.submit: tests must be a sequence of str snippets")
        if not isinstance(code, str) or not isinstance(setup, str):
            raise ValueError("SandboxPool.submit: code and setup must be str")
        return self._executor.submit(
            run_program, code, tests, limits or self.limits, setup, network=network, private_tmp=private_tmp
        )

    def submit_job(self, job: SandboxJob) -> Future[ExecutionResult]:
        """Queue a :class:`SandboxJob`."""
        if not isinstance(job, SandboxJob):
            raise ValueError(f"SandboxPool: expected a SandboxJob, got {type(job).__name__}")
        return self.submit(job.code, job.tests, job.limits, job.setup, network=job.network, private_tmp=job.private_tmp)

    def map(self, jobs: Iterable[SandboxJob]) -> list[ExecutionResult]:
        """Run every job, in parallel, and return their results in the order given."""
        futures = [self.submit_job(job) for job in jobs]
        return [f.result() for f in futures]

    async def run(
        self, code: str, tests: Sequence[str] = (), limits: SandboxLimits | None = None, setup: str = ""
    ) -> ExecutionResult:
        """``await`` one run from asyncio code without blocking the event loop."""
        return await asyncio.wrap_future(self.submit(code, tests, limits, setup))

    def close(self, wait: bool = True) -> None:
        """Stop accepting work; with ``wait``, finish what is queued first."""
        self._executor.shutdown(wait=wait, cancel_futures=not wait)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
