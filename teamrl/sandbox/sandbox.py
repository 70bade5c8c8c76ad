"""Run one untrusted Python program with its tests in an isolated child process.

The child is a fresh interpreter running ``_harness.py`` (see there for the inside view) in a
bubblewrap container. This side allocates a sandbox user, splits the tests it can judge
itself (``judge.py``; the others run whole in a second container, the judge's, see
:class:`~teamrl.sandbox.relay.JudgeRun`), starts the container in its own session, feeds it the
payload, collects stdout/stderr (capped) and the harness's records
(nonce-authenticated, on a private pipe), enforces the wall-clock limit, kills everything the
run left behind, and turns it all into an :class:`ExecutionResult`.

The parts it is built from: ``jail.py`` (the bubblewrap command line), ``users.py`` (the
sandbox users a run leases, and killing what a run left behind), ``records.py`` (the
harness's records, parsed) and ``relay.py`` (the judge's run and the relay of its calls).
"""

from __future__ import annotations

import hashlib
import marshal
import os
import re
import secrets
import selectors
import signal
import subprocess
import threading
import time
import warnings
from typing import Sequence

from teamrl.sandbox.jail import DRAIN_SECONDS, PROGRAM_ENV, bwrap_command, bwrap_exit_code, host_namespace_inodes
from teamrl.sandbox.judge import CallTest, ReferenceTest, decode_plain, short_repr, split_test
from teamrl.sandbox.limits import SandboxLimits
from teamrl.sandbox.records import HARNESS_PID, Records, parse_records
from teamrl.sandbox.relay import JudgeRun
from teamrl.sandbox.result import ExecutionResult
from teamrl.sandbox.users import LEASES, kill_session, kill_user, kill_user_atomically

__all__ = ["AUDIT_HOOK_WARNING", "NETWORK_MODES", "run_program"]

#: "auto" and "netns": a private network namespace (the run is refused if bubblewrap cannot
#: make one). "seccomp" and "audit-hook" force that weaker mechanism instead.
NETWORK_MODES = ("auto", "netns", "seccomp", "audit-hook")
#: What the "audit-hook" mode does not contain, said at every run that asks for it.
AUDIT_HOOK_WARNING = (
    "run_program(network='audit-hook'): the network and the starting of programs are refused only by a Python "
    "audit hook in the program's process. Native code is kept out of that process (no ctypes, cffi or "
    "subinterpreters under any name, extension modules only from the interpreter's lib-dynload, /tmp and /dev/shm "
    "noexec, the process not dumpable), but a memory-safety bug of the interpreter itself (crafted bytecode, a "
    "crashing C module) is not contained and would reach the host's network; use network='netns' (the default) "
    "or 'seccomp' wherever the kernel allows them."
)

_OUTPUT_FLOOD_FACTOR = 16
_INODE_BYTES = 4096  # a file or directory of the run's tmpfs costs this much of max_disk_bytes (_setup.py)
_OUTPUT_FLOOD_MIN = 1 << 20
# Reading the values a run returned counts against its wall-clock limit, with this much grace
# (one value, at most MAX_VALUE_CHARS, takes about a second to parse).
_DECODE_GRACE_SECONDS = 0.5


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _judge_calls(rec: Records, calls: Sequence[CallTest | ReferenceTest | None], limits: SandboxLimits, network: str,
                 deadline: float = float("inf")) -> None:
    """Decide, here, the tests that were split into a call: a test passes only when the
    harness sent back one plain value for it and that value meets the expectation, which the
    sandboxed process never saw (for a :class:`ReferenceTest`, the outputs of the reference
    solution, run in a second sandbox run by :func:`_judge_references`). Writes the verdict
    into ``rec.tests`` as the harness would. A value not read by ``deadline`` (monotonic) is
    not read: the test does not pass and ``rec.late`` says why (a run times out)."""
    pending: list[tuple[int, ReferenceTest, list, str]] = []
    for index, call in enumerate(calls):
        if call is None:
            continue
        where = f"test {index + 1}: {_shorten(call.assert_source)} -> {_shorten(call.call_source)}"
        if index in rec.tests and rec.tests[index][:1] != ["pass"]:
            continue  # the call raised, or the value was reported twice: already a failure
        if index in rec.values and time.monotonic() > deadline:  # reading values is the run's time too
            rec.tests[index] = ["timeout", f"{where}: not read"]
            rec.late = rec.late or (f"test {index + 1}: wall-clock limit of {limits.wall_seconds:g}s reached "
                                    "while reading the values the program returned")
            continue
        chunks = rec.values.get(index)
        if not chunks:  # a bare "pass" for a split test counts for nothing
            if index in rec.tests or rec.done:
                rec.tests[index] = ["error", f"{where}: no value came back"]
            continue
        count = rec.value_chunks.get(index, 0)
        if sorted(chunks) != list(range(count)):
            rec.tests[index] = ["error", f"{where} sent back an incomplete value"]
            continue
        try:
            got = decode_plain("".join(chunks[k] for k in range(count)))
        except ValueError as exc:  # a non-plain value (a class of the program's) is a wrong answer
            rec.tests[index] = ["fail", f"{where} -> AssertionError: returned {exc}"]
            continue
        if isinstance(call, ReferenceTest):
            if type(got) is not list or len(got) != len(call.args):
                rec.tests[index] = [
                    "fail",
                    f"{where} -> AssertionError: returned {_short_repr(got)}, not one output per input",
                ]
            else:
                pending.append((index, call, got, where))
            continue
        passed, expected = call.judge(got)
        if passed:
            rec.tests[index] = ["pass"]
        else:
            rec.tests[index] = [
                "fail",
                f"{where} -> AssertionError: returned {_short_repr(got)}, expected {_shorten(expected)}",
            ]
    if pending:
        _judge_references(rec, pending, limits, network)


# Reference outputs by (reference, entry point, inputs): the same for every candidate.
_REFERENCE_CACHE: dict[bytes, list] = {}
_REFERENCE_CACHE_MAX = 4096
_REFERENCE_CACHE_LOCK = threading.Lock()


def _reference_key(test: ReferenceTest) -> bytes:
    return hashlib.sha256(marshal.dumps((test.reference, test.name, test.args))).digest()


def _judge_references(
    rec: Records, pending: list[tuple[int, ReferenceTest, list, str]], limits: SandboxLimits, network: str
) -> None:
    """Judge reference tests against their reference solution's values, run in a second
    sandbox run (one per reference solution) on plain values: the inputs, or for find_zero
    the candidate's decoded outputs. Outputs on the inputs alone are cached."""
    values: dict[int, list] = {}
    to_run: dict[str, list[tuple[int, CallTest]]] = {}
    for index, test, got, _ in pending:
        cached = None
        if not test.find_zero:
            with _REFERENCE_CACHE_LOCK:
                cached = _REFERENCE_CACHE.get(_reference_key(test))
        if cached is not None:
            values[index] = cached
        else:
            to_run.setdefault(test.reference, []).append((index, test.reference_call(got)))
    failures: dict[int, str] = {}
    for reference, jobs in to_run.items():
        run_calls = [call for _, call in jobs]
        records = ProgramRun(reference, [c.call_source for c in run_calls], limits, "", network).records(run_calls)
        for k, (index, call) in enumerate(jobs):
            chunks, count = records.values.get(k), records.value_chunks.get(k, 0)
            outcome = records.tests.get(k) or (records.body if records.body and records.body[0] != "ok" else None)
            try:
                if outcome or not chunks or sorted(chunks) != list(range(count)):
                    raise ValueError(outcome[-1] if outcome else "no value came back")
                output = decode_plain("".join(chunks[j] for j in range(count)))
                if type(output) is not list or len(output) != len(call.args):
                    raise ValueError(f"returned {_short_repr(output)}, not one output per input")
            except ValueError as exc:
                failures[index] = _shorten(str(exc))
                continue
            values[index] = output
    for index, test, got, where in pending:
        if index in failures:
            rec.tests[index] = ["error", f"{where}: the reference solution's run failed: {failures[index]}"]
            continue
        if not test.find_zero and index in values:
            with _REFERENCE_CACHE_LOCK:
                if len(_REFERENCE_CACHE) >= _REFERENCE_CACHE_MAX:
                    _REFERENCE_CACHE.pop(next(iter(_REFERENCE_CACHE)))
                _REFERENCE_CACHE[_reference_key(test)] = values[index]
        passed, why = test.judge(got, values[index])
        rec.tests[index] = (
            ["pass"] if passed else ["fail", f"test {index + 1}: {test.assert_source} -> AssertionError: {why}"]
        )


def _shorten(text: str) -> str:
    return text if len(text) <= 200 else text[:200] + "..."


def _short_repr(value: object) -> str:
    return short_repr(value)


# ---------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------


def run_program(
    code: str,
    tests: Sequence[str] = (),
    limits: SandboxLimits | None = None,
    setup: str = "",
    *,
    network: str = "auto",
    private_tmp: bool = True,
) -> ExecutionResult:
    """Run ``setup``, then ``code``, then each of ``tests`` in a fresh, isolated process.

    Each test is a snippet run after the program in its namespace (``assert f(1) == 2``, or a
    ``def check(candidate): ...`` plus ``check(f)``); it passes if it finishes without an
    exception. Tests run in order in one namespace (a copy of the program's, with the
    builtins as they were before the program ran). A test of a usual data-set shape is split
    (see ``judge.py``): only its call runs there, and its verdict is taken here; for a
    HumanEval+ input chunk the expected outputs come from the reference solution, run in a
    second sandbox run (cached per reference and inputs). Any other test runs whole in the
    judge's sandbox run, beside the program's and without the program (:class:`JudgeRun`): the
    names it takes from the program are proxies whose calls are relayed to the program's
    process, only plain values come back, and the judge's verdict is the test's; a test that
    needs more of the program than such calls is counted in ``tests_unjudgeable`` and does
    not pass. The program
    runs in a bubblewrap container (its own pid, mount, ipc, uts and network namespaces; only
    /usr and the interpreter visible, read-only; private size- and file-limited, noexec tmpfs
    /tmp and /dev/shm), as an unprivileged per-run user when the caller is root, with
    RLIMIT_CPU/AS/NPROC/FSIZE, a seccomp filter killing a process that asks for memory no
    limit counts (memfd_create, shmget: status "memory"), no native code in the program's
    process (see ``_setup.py``), an environment holding no caller variables, and a wall-clock
    limit after which the whole run is killed; nothing of it outlives the caller. A run that
    fails a test with its /tmp or /dev/shm full ends with status "disk".

    ``network`` "seccomp" or "audit-hook" forces that weaker mechanism instead of the
    network namespace (see :data:`NETWORK_MODES`); "audit-hook" warns each time what it does
    not contain (:data:`AUDIT_HOOK_WARNING`). ``private_tmp`` is kept for callers of
    the earlier API and changes nothing: every run's writable places are private.

    Never raises because of what the program does; only invalid arguments raise ValueError.
    An internal failure of the sandbox itself is reported as status "crash" with a
    first_failure starting with "sandbox:".
    """
    if not isinstance(code, str):
        raise ValueError(f"run_program: code must be a str, got {type(code).__name__}")
    if isinstance(tests, str) or not all(isinstance(t, str) for t in tests):
        raise ValueError("run_program: tests must be a sequence of str snippets (a single str is not accepted)")
    if not isinstance(setup, str):
        raise ValueError(f"run_program: setup must be a str, got {type(setup).__name__}")
    if limits is None:
        limits = SandboxLimits()
    elif not isinstance(limits, SandboxLimits):
        raise ValueError(f"run_program: limits must be a SandboxLimits, got {type(limits).__name__}")
    if network not in NETWORK_MODES:
        raise ValueError(f"run_program: network={network!r}; choose one of {NETWORK_MODES}")
    if network == "audit-hook":
        warnings.warn(AUDIT_HOOK_WARNING, RuntimeWarning, stacklevel=2)
    # Exact str copies (marshal takes no subclasses, and a subclass could carry behaviour).
    code, setup = str.__str__(code), str.__str__(setup)
    tests = [str.__str__(t) for t in tests]
    start = time.monotonic()
    try:
        return ProgramRun(code, tests, limits, setup, network).execute()
    except Exception as exc:  # noqa: BLE001 - the trainer must never see the sandbox raise
        return ExecutionResult(
            status="crash",
            tests_total=len(tests),
            first_failure=f"sandbox: {type(exc).__name__}: {exc}",
            network_isolation="unknown",
            duration_s=time.monotonic() - start,
        )


class ProgramRun:
    def __init__(self, code: str, tests: list[str], limits: SandboxLimits, setup: str, network: str):
        self.code, self.tests, self.limits, self.setup = code, tests, limits, setup
        self.network = network
        cap = limits.max_output_bytes
        self.flood_at = max(_OUTPUT_FLOOD_FACTOR * cap, _OUTPUT_FLOOD_MIN)
        self.out = {"stdout": bytearray(), "stderr": bytearray()}
        self.out_total = 0
        self.truncated = False
        self.results = bytearray()
        self._results_fd = -1

    # -- output collection
    def _take(self, name: str, data: bytes) -> None:
        if name == "results":
            if len(self.results) < 16 << 20:  # a program spamming the channel is tampering anyway
                self.results += data
            return
        buf = self.out[name]
        room = self.limits.max_output_bytes - len(buf)
        if room > 0:
            buf += data[:room]
        if len(data) > max(room, 0):
            self.truncated = True
        self.out_total += len(data)

    def execute(self) -> ExecutionResult:
        start = time.monotonic()
        calls = [split_test(t) for t in self.tests]
        records = self.records(calls)
        # Judged after the run's uid is released: a reference test starts a second run.
        # Reading the values counts against the run's wall-clock limit (a program can make
        # them costly to read: the run must not outlast its limit here, after the fact).
        _judge_calls(
            records, calls, self.limits, self.network, start + self.limits.wall_seconds + _DECODE_GRACE_SECONDS
        )
        return self._result(records, *self._outcome, time.monotonic() - start)

    def records(self, calls: Sequence[CallTest | ReferenceTest | None]) -> Records:
        """Run the program and its tests (a test with a call runs only that call) and return
        what the harness reported; how the process ended is kept in ``self._outcome``."""
        start = time.monotonic()
        lease = LEASES.acquire() if os.geteuid() == 0 else None
        proc: subprocess.Popen | None = None
        pidfd: int | None = None
        read_fd = write_fd = None
        streams: dict[int, str] = {}
        # Tests that cannot be split run whole in the judge's own sandbox run, beside this one.
        judge = JudgeRun(self, calls) if any(c is None for c in calls) else None
        try:
            if judge is not None:
                judge.open()
            if lease is not None and kill_user(lease.uid):  # left by a crashed earlier caller
                kill_user_atomically(lease.uid, lease.gid)
                kill_user(lease.uid)
            read_fd, write_fd = os.pipe()
            self._results_fd = read_fd
            nonce = secrets.token_hex(16)
            payload = marshal.dumps(
                {
                    "nonce": nonce,
                    "results_fd": write_fd,
                    "uid": lease.uid if lease else None,
                    "gid": lease.gid if lease else None,
                    "network": self.network,
                    "host_namespaces": host_namespace_inodes(self.network),
                    "limits": self.payload_limits(),
                    "setup": self.setup,
                    "code": self.code,
                    # A test split into a call is sent as (name, args, kwargs, source of the
                    # call): its expected value stays here and the verdict is taken here. Any
                    # other test runs in the judge's process: here only its calls are served,
                    # and its source (expected values included) is never sent: the program could
                    # read it off the harness's frames and return what the asserts expect.
                    "tests": [(c.name, c.args, c.kwargs, c.call_source, c.wants) if c is not None
                              else ("", (), {}, "", "serve") for c in calls],
                    "serve_fds": judge.candidate_fds if judge is not None else None,
                }
            )
            env = dict(PROGRAM_ENV, HOME="/tmp", TMPDIR="/tmp")
            proc = subprocess.Popen(
                bwrap_command(self.limits, self.network, lease is not None),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(write_fd, *(judge.candidate_fds if judge is not None else ())),
                cwd="/",
                env=env,
                start_new_session=True,  # its own session and process group, killed as one
            )
            os.close(write_fd)
            write_fd = None
            if judge is not None:
                judge.start()
            try:
                pidfd = os.pidfd_open(proc.pid)
            except (AttributeError, OSError):
                pidfd = None  # old kernel: poll instead
            assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
            streams = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", read_fd: "results"}
            deadline = start + self.limits.wall_seconds
            exited, timed_out, flooded = self._pump(proc, pidfd, payload, streams, deadline, judge)

            # Whatever is still running belongs to this run: kill it all, then reap. When the
            # harness finished, it already swept its uid with kill(-1); otherwise do it here.
            swept = exited and self._harness_swept(nonce)
            self.kill_all(proc, lease, swept)
            _, wait_status, rusage = os.wait4(proc.pid, 0)
            proc.returncode = bwrap_exit_code(os.waitstatus_to_exitcode(wait_status))
            self._drain(streams)
            self._outcome = (proc.returncode, rusage, timed_out, flooded, lease)
            rec = parse_records(bytes(self.results), nonce, len(self.tests))
            if judge is not None:
                judge.finish()
                judge.merge(rec)
            return rec
        finally:
            if proc is not None and proc.returncode is None:
                self.kill_all(proc, lease)
                try:
                    _, status, _ = os.wait4(proc.pid, 0)
                    proc.returncode = os.waitstatus_to_exitcode(status)
                except ChildProcessError:
                    proc.returncode = -signal.SIGKILL
            for fd in (read_fd, write_fd, pidfd):
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            if proc is not None:
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    try:
                        if stream is not None and not stream.closed:
                            stream.close()
                    except OSError:
                        pass
            if lease is not None:
                LEASES.release(lease)
            if judge is not None:
                judge.close()

    def payload_limits(self) -> dict:
        """The limits as the harness reads them."""
        return {
            "cpu_seconds": self.limits.cpu_seconds,
            "memory_mb": self.limits.memory_mb,
            "max_processes": self.limits.max_processes,
            "max_file_bytes": self.limits.max_file_bytes,
            "max_disk_bytes": self.limits.max_disk_bytes,
        }

    def _pump(self, proc, pidfd, payload, streams, deadline, judge: JudgeRun | None = None):
        """Feed stdin, collect output until the child exits, floods or runs out of time; with
        a judge, also relay its calls, and wait for it to exit too."""
        sel = selectors.DefaultSelector()
        stdin_fd = proc.stdin.fileno()
        os.set_blocking(stdin_fd, False)
        sel.register(stdin_fd, selectors.EVENT_WRITE, "stdin")
        for fd, name in streams.items():
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ, name)
        if pidfd is not None:
            sel.register(pidfd, selectors.EVENT_READ, "exit")
        if judge is not None:
            judge.register(sel)
        sent = 0
        exited = timed_out = flooded = False
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                polled = pidfd is None or (judge is not None and judge.pidfd is None)
                timeout = min(remaining, 0.01) if polled else remaining
                for key, _ in sel.select(timeout):
                    name = key.data
                    if type(name) is tuple:  # the judge's pipes and process
                        judge.handle(sel, key)
                    elif name == "stdin":
                        try:
                            sent += os.write(stdin_fd, payload[sent : sent + 65536])
                        except BlockingIOError:
                            pass
                        except OSError:  # the child is gone or closed stdin: nothing more to send
                            sent = len(payload)
                        if sent >= len(payload):
                            sel.unregister(stdin_fd)
                            proc.stdin.close()
                    elif name == "exit":
                        exited = True
                        sel.unregister(key.fd)  # readable from now on: the judge may still run
                    else:
                        try:
                            data = os.read(key.fd, 65536)
                        except BlockingIOError:
                            continue
                        if not data:
                            sel.unregister(key.fd)
                        else:
                            self._take(name, data)
                if pidfd is None:
                    # WNOWAIT: notice the exit without reaping, so the pid (and its process
                    # group id) cannot be reused before everything is killed.
                    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                    exited = info is not None and info.si_pid == proc.pid
                if judge is not None:
                    judge.poll(sel, exited)
                if exited and (judge is None or judge.exited):
                    break
                if self.out_total > self.flood_at:
                    flooded = True
                    break
        finally:
            sel.close()
            if not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        return exited, timed_out, flooded

    def _harness_swept(self, nonce: str) -> bool:
        """Did the harness itself report its final kill(-1) sweep? (Read what has arrived.)"""
        try:
            while True:
                data = os.read(self._results_fd, 65536)
                if not data:
                    break
                self._take("results", data)
        except (BlockingIOError, OSError):
            pass
        return f"{nonce}\t{HARNESS_PID}\tdone\tswept\n".encode() in self.results

    def kill_all(self, proc, lease, swept: bool = False) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the session's group (pid not reaped yet: no reuse)
        except OSError:
            pass
        if lease is not None:
            # The harness's own kill(-1) normally leaves nothing; if it did not run, or /proc
            # still shows something, sweep atomically from here (daemons, setsid, pid hoppers).
            if not swept or kill_user(lease.uid):
                kill_user_atomically(lease.uid, lease.gid)
                kill_user(lease.uid)
        else:
            kill_session(proc.pid)

    def _drain(self, streams) -> None:
        """Read what is left in the pipes; every writer is dead, so EOF comes quickly."""
        deadline = time.monotonic() + DRAIN_SECONDS
        open_fds = dict(streams)
        sel = selectors.DefaultSelector()
        for fd, name in open_fds.items():
            try:
                sel.register(fd, selectors.EVENT_READ, name)
            except (ValueError, KeyError, OSError):
                continue
        try:
            while sel.get_map() and time.monotonic() < deadline:
                for key, _ in sel.select(max(0.0, deadline - time.monotonic())):
                    try:
                        data = os.read(key.fd, 65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(key.fd)
                    else:
                        self._take(key.data, data)
        finally:
            sel.close()

    # -- the verdict
    def _result(
        self, rec: Records, returncode: int, rusage, timed_out: bool, flooded: bool, lease, duration: float
    ) -> ExecutionResult:
        n = len(self.tests)
        limits = self.limits
        stderr_text = self.out["stderr"].decode("utf-8", "replace")
        passed = sum(1 for fields in rec.tests.values() if fields and fields[0] == "pass")
        network = rec.hello[0] if rec.hello else "unknown"
        filesystem = rec.hello[1] if rec.hello and len(rec.hello) > 1 else "none"

        def first_recorded_failure() -> tuple[str | None, str | None]:
            if rec.body and rec.body[0] != "ok":
                return rec.body[0], rec.body[1] if len(rec.body) > 1 else None
            for i in range(n):
                fields = rec.tests.get(i)
                if fields and fields[0] != "pass":
                    return fields[0], fields[1] if len(fields) > 1 else None
            return None, None

        def unfinished(what: str) -> str:
            if rec.hello is None:
                return f"the sandbox had not started the program when {what}"
            if rec.body is None:
                return f"the program did not finish: {what}"
            for i in range(n):
                if i not in rec.tests:
                    return f"test {i + 1} did not finish: {what}"
            return f"the harness did not finish: {what}"

        cpu_used = (rusage.ru_utime + rusage.ru_stime) if rusage is not None else 0.0
        cpu_limit = float(int(-(-limits.cpu_seconds // 1)))
        status: str
        failure: str | None
        if rec.tampered:
            status, failure, passed = "error", f"result channel tampered with ({rec.tampered}); no test counted", 0
        elif timed_out:
            status, failure = "timeout", unfinished(f"wall-clock limit of {limits.wall_seconds:g}s reached")
        elif rec.late is not None:
            status, failure = "timeout", rec.late
        elif flooded:
            status, failure = "killed", unfinished(f"output limit exceeded (more than {self.flood_at} bytes)")
        elif returncode == -signal.SIGXCPU or (returncode == -signal.SIGKILL and cpu_used >= cpu_limit - 0.05):
            status, failure = "timeout", unfinished(f"CPU-time limit of {cpu_limit:g}s reached")
        elif rec.setup_error is not None:
            status, failure = "crash", f"sandbox: could not set up isolation: {rec.setup_error}"
        elif rec.hello is None and stderr_text.startswith("bwrap:"):  # bwrap itself gave up
            status, failure = (
                "crash",
                f"sandbox: could not set up isolation: {stderr_text.strip().splitlines()[0][:300]}",
            )
        elif rec.done:
            kind, failure = first_recorded_failure()
            status = {None: "ok", "fail": "failed", "error": "error", "memory": "memory"}.get(kind, "error")
            if status == "ok" and passed < n:
                status, failure = "error", unfinished("the harness reported the end")
            if rec.disk and status in ("failed", "error"):
                place, files = rec.disk[0], rec.disk[1] if len(rec.disk) > 1 else "?"
                status = "disk"
                failure = (
                    f"the run filled its disk ({place} full, {files} files; max_disk_bytes={limits.max_disk_bytes}, "
                    f"each file or directory a {_INODE_BYTES}-byte share): {failure}"
                )
        elif returncode == -signal.SIGSYS:  # the seccomp filter's kill: memfd_create or shmget
            status = "memory"
            failure = unfinished(
                "the process called memfd_create or shmget (memory outside the run's limits) and was killed"
            )
        else:
            kind, recorded = first_recorded_failure()
            memory_hint = kind == "memory" or re.search(
                r"MemoryError|Cannot allocate memory|out of memory", stderr_text
            )
            if returncode == -signal.SIGKILL:
                status = "memory" if memory_hint else "killed"
                how = "was killed by SIGKILL"
            elif returncode < 0:
                status = "memory" if memory_hint else "crash"
                how = f"was killed by signal {_signal_name(-returncode)}"
            else:
                status = "memory" if memory_hint else "crash"
                how = f"exited with code {returncode}"
            failure = recorded if recorded and kind == "memory" else unfinished(f"the process {how} before reporting")
            lines = [line.strip() for line in stderr_text.splitlines() if line.strip()]
            if status == "crash" and returncode < 0 and lines:
                fatal = [line for line in lines if line.startswith("Fatal Python error")]
                failure = f"{failure}; stderr: {(fatal or lines)[0 if fatal else -1][:300]}"
        return ExecutionResult(
            status=status,
            tests_passed=passed,
            tests_total=n,
            first_failure=failure,
            stdout=self.out["stdout"].decode("utf-8", "replace"),
            stderr=stderr_text,
            output_truncated=self.truncated,
            network_isolation=network,
            filesystem_isolation=filesystem,
            sandbox_uid=lease.uid if lease is not None else None,
            duration_s=duration,
            returncode=returncode,
            tests_unjudgeable=len(rec.unjudgeable),
        )
