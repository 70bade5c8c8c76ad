"""Running untrusted, model-written Python safely.

``run_program(code, tests)`` runs a program and its test snippets in a separate, isolated
process and returns an :class:`ExecutionResult`; :class:`SandboxPool` runs many at once.

Isolation (the result says what was achieved; a step that cannot be set up refuses the run):

- a bubblewrap container (Debian package ``bubblewrap``): its own pid, mount, ipc, uts and
  network namespaces (and a user namespace when the caller is not root); only a read-only
  /usr and the interpreter's prefix are visible, with a private /proc, a minimal /dev and
  size- and file-limited, noexec tmpfs /tmp and /dev/shm (/var/tmp and /run/lock lead there),
  built by a first stage (``_setup.py``) that then execs the harness, so host sockets,
  host command lines and host writable places are out of reach, and every process of the run
  dies with it, or with its caller (parent-death signal, then the pid namespace goes);
- a per-run unprivileged user (when the caller is root): no signals to other runs,
  RLIMIT_NPROC that holds, and every leftover process found by its uid and killed;
- RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE, a wall-clock limit that kills the whole
  run, an output cap, an environment without any of the caller's variables; a seccomp filter
  that kills a process asking for memory no limit counts (memfd_create, shmget);
- no native code in the program's process: it never loaded ctypes, holds no capability, is not
  dumpable (its interpreter is execute-only), the native-call and subinterpreter modules are
  /dev/null in the container, and the audit hook checks every dotted segment of an import and
  the file an extension module is loaded from (the interpreter's own lib-dynload only);
- test results through a private pipe, authenticated by a nonce the program never receives;
  tests of the usual data-set shapes split (``judge.py``) so that only a call goes in and a
  plain value comes back, compared here against an expectation the program never saw;
  builtins and module attributes restored for the other tests; no tracing, gc introspection
  or ctypes; finally kill(-1) as the run's uid.

- a test of any other shape (loops, helpers) runs whole in a second sandbox run, the judge's,
  which never holds the program: the program's names are proxies there, their calls relayed to
  the program's process and their values sent back as plain data, so no test's verdict is the
  program's process's word; a test needing more than such calls is counted unjudgeable
  (``ExecutionResult.tests_unjudgeable``), never passed.

Known limits: ctypes is refused (so ``multiprocessing.Value`` fails); /usr and the
interpreter's files are readable.
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
