"""The structured outcome of one sandboxed execution."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STATUSES", "ExecutionResult"]

#: ok      every test passed (or there were none and the program ran to the end)
#: failed  a test failed its assertion
#: error   the program raised before the tests, or a test raised something other than
#:         AssertionError, or it tampered with the result channel
#: timeout the wall-clock or CPU-time limit was reached
#: memory  the address-space limit was reached (MemoryError or an allocation failure), or the
#:         program asked for memory no limit counts (memfd_create, shmget) and was killed
#: disk    a test failed or raised and the run's /tmp or /dev/shm was full at the end: every
#:         byte or every file (a 4 KiB share of max_disk_bytes each) it may have was used
#: crash   the process died without reporting (a signal, os._exit, an interpreter abort) or the
#:         sandbox itself could not run it
#: killed  stopped by the sandbox for flooding its output, or killed from outside
STATUSES = ("ok", "failed", "error", "timeout", "memory", "disk", "crash", "killed")


@dataclass
class ExecutionResult:
    """What happened when a program and its tests ran in the sandbox.

    ``tests_passed`` counts only results the harness reported through its private channel,
    so a program cannot raise it by printing, exiting early or patching the checker.
    ``network_isolation`` says how the network was cut: ``"netns"`` (a private, empty
    network namespace), ``"seccomp"`` (a kernel filter refusing non-Unix sockets) or
    ``"audit-hook"`` (Python-level refusal only; the weakest), or ``"unknown"`` when the
    run ended before the harness reported its set-up. ``filesystem_isolation`` is
    ``"private-tmpfs"`` when the harness checked that the only writable places were the
    run's own size-limited tmpfs /tmp and /dev/shm (in a file system showing only /usr and
    the interpreter), else ``"none"`` (the run never started). ``sandbox_uid`` is the unprivileged
    user the program ran as (None when the caller is not root and no user switch was possible).
    ``tests_unjudgeable`` counts tests that could not be judged outside the program's process
    (they need more of the program than calls returning plain data): none of them passed, and
    ``first_failure`` says why when one comes first.
    """

    status: str
    tests_passed: int = 0
    tests_total: int = 0
    first_failure: str | None = None
    stdout: str = ""
    stderr: str = ""
    output_truncated: bool = False
    network_isolation: str = "none"
    filesystem_isolation: str = "none"
    sandbox_uid: int | None = None
    duration_s: float = 0.0
    returncode: int | None = None
    tests_unjudgeable: int = 0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"ExecutionResult.status: {self.status!r} is not one of {STATUSES}")

    @property
    def pass_fraction(self) -> float:
        """Fraction of tests passed; with no tests, 1.0 if the program ran cleanly, else 0.0."""
        if self.tests_total == 0:
            return 1.0 if self.status == "ok" else 0.0
        return self.tests_passed / self.tests_total

    @property
    def ok(self) -> bool:
        """True when every test passed."""
        return self.status == "ok"
