"""Running untrusted, model-written Python safely.

``run_program(code, tests)`` runs a program and its test snippets in a separate, isolated
process and returns an :class:`ExecutionResult`; :class:`SandboxPool` runs many at once.

Isolation, strongest available first (the result says which was used):

- a per-run unprivileged user (when the caller is root): no signals to the caller or to other
  runs, RLIMIT_NPROC that holds, no access to root's files, and every leftover process found
  by its uid and killed;
- a private network namespace (else a seccomp filter refusing non-Unix sockets, else an
  audit hook), a private mount namespace where /tmp, /var/tmp and /dev/shm are the run's own
  0700 directory, removed afterwards;
- RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE, a wall-clock limit that kills the whole
  run, an output cap, an environment without any of the caller's variables;
- test results through a private pipe, authenticated by a nonce the program never receives;
  builtins and module attributes restored for the tests; no tracing, gc introspection or
  ctypes; finally kill(-1) as the run's uid, so nothing it started outlives it.

Known limits (see ``_harness.py``): the test harness shares the program's interpreter, so a
program written against its internals could walk its own stack frames to the harness and
forge results (a strict-xfail test keeps this visible); objects whose ``__eq__`` always
returns True pass ``==`` asserts; module attributes the program rebinds are restored and
caught, but patched class internals (say ``fractions.Fraction.__eq__``) are not; ctypes is
refused (so ``multiprocessing.Value`` fails); the program can read world-readable host files
(data sets included) and other processes' command lines in /proc; there is no disk quota
beyond RLIMIT_FSIZE per file within the wall-clock limit. Without root there is no user
switch and no private /tmp, and leftover processes are found by session only.
"""

from teamrl.sandbox.limits import SandboxLimits
from teamrl.sandbox.pool import SandboxJob, SandboxPool
from teamrl.sandbox.result import STATUSES, ExecutionResult
from teamrl.sandbox.sandbox import NETWORK_MODES, run_program

__all__ = [
    "NETWORK_MODES",
    "STATUSES",
    "ExecutionResult",
    "SandboxJob",
    "SandboxLimits",
    "SandboxPool",
    "run_program",
]
