"""Run one untrusted Python program with its tests in an isolated child process.

The child is a fresh interpreter running ``_harness.py`` (see there for the inside view) in a
bubblewrap container. This side allocates a sandbox user, splits the tests it can judge
itself (``judge.py``; the others run whole in a second container, the judge's, see
:class:`_Judge`), starts the container in its own session, feeds it the payload, collects stdout/stderr (capped) and the harness's records
(nonce-authenticated, on a private pipe), enforces the wall-clock limit, kills everything the
run left behind, and turns it all into an :class:`ExecutionResult`.
"""

from __future__ import annotations

import fcntl
import hashlib
import marshal
import os
import re
import secrets
import selectors
import signal
import stat
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from teamrl.sandbox.judge import (
    MAX_VALUE_CHARS,
    CallTest,
    ReferenceTest,
    RefusedValue,
    decode_plain,
    program_names,
    short_repr,
    split_test,
)
from teamrl.sandbox.limits import SandboxLimits
from teamrl.sandbox.result import ExecutionResult

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

# Sandbox users: one uid (and gid) per concurrent run, leased under a lock file, so runs
# cannot signal, ptrace or read each other, RLIMIT_NPROC is per run, and everything a run
# leaves behind can be found by its uid and killed. Chosen far above regular and
# container-mapped ids.
SANDBOX_UID_BASE = 1_900_000_000
SANDBOX_UID_SLOTS = 4096
_LOCK_DIR = Path("/run/teamrl-sandbox")

_OUTPUT_FLOOD_FACTOR = 16
_INODE_BYTES = 4096  # a file or directory of the run's tmpfs costs this much of max_disk_bytes (_setup.py)
_OUTPUT_FLOOD_MIN = 1 << 20
_DRAIN_SECONDS = 1.0
# Reading the values a run returned counts against its wall-clock limit, with this much grace
# (one value, at most MAX_VALUE_CHARS, takes about a second to parse).
_DECODE_GRACE_SECONDS = 0.5
_PROGRAM_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONHASHSEED": "0",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONFAULTHANDLER": "1",
}

_harness_source: str | None = None
_setup_source: str | None = None


def _harness() -> str:
    global _harness_source
    if _harness_source is None:
        _harness_source = (Path(__file__).with_name("_harness.py")).read_text(encoding="utf-8")
    return _harness_source


def _setup() -> str:
    global _setup_source
    if _setup_source is None:
        _setup_source = (Path(__file__).with_name("_setup.py")).read_text(encoding="utf-8")
    return _setup_source


def _interpreter() -> list[str]:
    # -s -S: no site-packages; -B: no .pyc writes; -P (3.11+): no script/cwd on sys.path.
    # The environment is built from scratch (_PROGRAM_ENV), so -E is not needed and
    # PYTHONHASHSEED=0 keeps set/dict iteration reproducible across runs. The first stage
    # (_setup.py) builds the isolation, then execs the harness (its argument) the same way.
    flags = ["-s", "-S", "-B"]
    if sys.version_info >= (3, 11):
        flags.append("-P")
    return [os.path.realpath(sys.executable), *flags, "-c", _setup(), _harness()]


# ---------------------------------------------------------------------------------------
# the container: bubblewrap
# ---------------------------------------------------------------------------------------

# Fixed places only: a PATH lookup would let the caller's environment choose the jailer.
_BWRAP_PATHS = ("/usr/bin/bwrap", "/bin/bwrap", "/usr/local/bin/bwrap")
# Inside the run's own pid namespace bwrap's reaper is pid 1 and the harness pid 2; records
# from any other pid (a forked copy of the harness) are not authoritative.
_HARNESS_PID = 2
_NAMESPACES = ("pid", "mnt", "ipc", "uts")


def bwrap_path() -> str:
    """The bubblewrap executable; RuntimeError (naming the package) when it is missing."""
    for path in _BWRAP_PATHS:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise RuntimeError(
        "bubblewrap is not installed (looked for " + ", ".join(_BWRAP_PATHS) + "), so the run was refused; "
        "install the Debian package bubblewrap (`make setup` does it as root)"
    )


def _bwrap_exit_code(code: int) -> int:
    """bwrap exits with 128 + N when its command was killed by signal N: report -N, as for a
    direct child."""
    return -(code - 128) if 128 < code < 128 + 65 else code


def _host_namespaces(network: str) -> dict[str, int]:
    """Inode numbers of this process's namespaces: the harness checks that its own differ."""
    names = _NAMESPACES + (("net",) if network in ("auto", "netns") else ())
    return {name: os.stat(f"/proc/self/ns/{name}").st_ino for name in names}


def _visible_tree() -> list[str]:
    """bwrap arguments exposing, read-only, just what the interpreter needs: /usr (and the
    merged-/usr links) and the interpreter's own prefix. Everything else of the host (/run,
    /home, /work, /etc, its sockets) is absent from the run's file system."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    prefixes = {sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    for prefix in sorted(os.path.realpath(p) for p in prefixes):
        if prefix != "/usr" and not prefix.startswith("/usr/"):
            # Traversable parents (bwrap would copy /root's 0700), then the prefix itself.
            parts = prefix.strip("/").split("/")[:-1]
            for depth in range(1, len(parts) + 1):
                args += ["--perms", "0755", "--dir", "/" + "/".join(parts[:depth])]
            args += ["--ro-bind", prefix, prefix]
    return args


def _bwrap_command(limits: SandboxLimits, network: str, as_root: bool) -> list[str]:
    """The whole command line: bwrap with its own pid, mount, ipc and uts namespaces (and
    network, unless a weaker network mode is forced), a user namespace when the caller is
    not root, the read-only tree of :func:`_visible_tree`, a private /proc, a minimal /dev,
    tmpfs /tmp and /dev/shm (/var/tmp and /run/lock point to /tmp), the rest read-only, and
    death with the caller; then the interpreter with the first stage (``_setup.py``), which
    mounts the run's own size- and file-limited, noexec tmpfs over /tmp and /dev/shm (bwrap's
    /tmp only stages the execute-only interpreter) and needs CAP_SYS_ADMIN in the run's user
    namespace for it when the caller is not root (it clears every capability before the
    harness starts)."""
    tmp_bytes = limits.max_disk_bytes * 3 // 4
    shm_bytes = limits.max_disk_bytes - tmp_bytes
    args = [bwrap_path(), "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if network in ("auto", "netns"):
        args.append("--unshare-net")
    if not as_root:
        args += ["--unshare-user", "--cap-add", "CAP_SYS_ADMIN"]
    args += _visible_tree()
    args += ["--proc", "/proc", "--dev", "/dev"]
    staging = max(tmp_bytes, os.path.getsize(os.path.realpath(sys.executable)) + (1 << 20))
    args += ["--perms", "1777", "--size", str(staging), "--tmpfs", "/tmp"]
    args += ["--perms", "1777", "--size", str(shm_bytes), "--tmpfs", "/dev/shm"]
    args += ["--symlink", "/tmp", "/var/tmp", "--dir", "/run", "--symlink", "/tmp", "/run/lock"]
    args += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--"]
    return args + _interpreter()


# ---------------------------------------------------------------------------------------
# sandbox users
# ---------------------------------------------------------------------------------------


@dataclass
class _Lease:
    uid: int
    gid: int
    slot: int
    fd: int | None


class _UidLeases:
    """Hands out unused sandbox uids; a flock per uid coordinates separate processes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._next = secrets.randbelow(SANDBOX_UID_SLOTS)
        self._dir: Path | None = None
        self._dir_checked = False

    def _lock_dir(self) -> Path | None:
        if not self._dir_checked:
            self._dir_checked = True
            try:
                _LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
                st = os.lstat(_LOCK_DIR)
                # Only trust a real directory that root owns and nobody else can write.
                if stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022:
                    self._dir = _LOCK_DIR
            except OSError:
                self._dir = None
        return self._dir

    def acquire(self) -> _Lease:
        with self._lock:
            lock_dir = self._lock_dir()
            for k in range(SANDBOX_UID_SLOTS):
                slot = (self._next + k) % SANDBOX_UID_SLOTS
                if slot in self._held:
                    continue
                uid = SANDBOX_UID_BASE + slot
                fd = None
                if lock_dir is not None:
                    try:
                        fd = os.open(lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError:
                        if fd is not None:
                            os.close(fd)
                        continue  # another process holds it
                self._held.add(slot)
                self._next = slot + 1
                return _Lease(uid=uid, gid=uid, slot=slot, fd=fd)
        raise RuntimeError(f"all {SANDBOX_UID_SLOTS} sandbox uids are in use")

    def release(self, lease: _Lease) -> None:
        with self._lock:
            if lease.fd is not None:
                os.close(lease.fd)
            self._held.discard(lease.slot)


_LEASES = _UidLeases()


def _tasks_of_user(uid: int) -> list[int]:
    """Pids of live (not zombie) processes whose real or effective uid is ``uid``."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as fh:
                text = fh.read(2048)
        except OSError:
            continue
        state = re.search(rb"^State:\s*(\S)", text, re.M)
        ids = re.search(rb"^Uid:\s*(\d+)\s+(\d+)", text, re.M)
        if ids and uid in (int(ids.group(1)), int(ids.group(2))) and not (state and state.group(1) in b"ZX"):
            pids.append(int(entry.name))
    return pids


def _kill_user(uid: int) -> bool:
    """SIGKILL every process of the sandbox user that /proc shows, until it shows none; True
    if there was any. (Reads of /proc can race with fork: see _kill_user_atomically.)"""
    found = False
    for attempt in range(200):
        pids = _tasks_of_user(uid)
        if not pids:
            return found
        found = True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(min(0.001 * (attempt + 1), 0.02))
    return found


def _kill_user_atomically(uid: int, gid: int) -> None:
    """kill(-1, SIGKILL) as the sandbox user: the kernel signals all of its processes under
    one lock, so a fork in flight is cancelled and a process that forks and exits in a loop
    cannot slip between the /proc reads of :func:`_kill_user`."""
    for shell in ("/bin/sh", "/usr/bin/sh"):
        if os.path.exists(shell):
            try:
                subprocess.run(
                    [shell, "-c", "kill -9 -1"],
                    user=uid, group=gid, extra_groups=[],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    env={}, cwd="/", timeout=5, check=False,
                )
            except (OSError, subprocess.SubprocessError):
                pass
            return


def _kill_session(sid: int) -> None:
    """Without a sandbox user: SIGKILL what is left of the run's session and process group."""
    try:
        os.killpg(sid, signal.SIGKILL)
    except OSError:
        pass
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
            if int(fields[3]) == sid:  # field 6 of stat: the session id
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            continue


# ---------------------------------------------------------------------------------------
# records from the harness
# ---------------------------------------------------------------------------------------

def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


_UNESCAPE = {"\\": "\\", "t": "\t", "n": "\n", "r": "\r"}


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: _UNESCAPE.get(m.group(1), m.group(1)), text)


@dataclass
class _Records:
    hello: list[str] | None = None
    setup_error: str | None = None
    body: list[str] | None = None
    tests: dict[int, list[str]] | None = None
    values: dict[int, dict[int, str]] | None = None  # test -> chunk index -> text (split tests)
    value_chunks: dict[int, int] | None = None  # test -> number of chunks announced
    done: bool = False
    tampered: str | None = None
    unjudgeable: set[int] = field(default_factory=set)  # tests the judge could not decide
    disk: list[str] | None = None  # /tmp or /dev/shm was full at the end: place, files, bytes
    late: str | None = None  # the wall-clock limit passed while the caller read the values


def _parse_records(data: bytes, nonce: str, n_tests: int) -> _Records:
    rec = _Records(tests={}, values={}, value_chunks={})
    lines = data.split(b"\n")
    if lines and lines[-1]:
        rec.tampered = "an unterminated line on the result channel"
    for raw in lines[:-1]:
        parts = raw.decode("utf-8", "replace").split("\t")
        if len(parts) < 3 or parts[0] != nonce:
            rec.tampered = "a line without the harness's nonce on the result channel"
            continue
        if parts[1] != str(_HARNESS_PID):
            continue  # a forked copy of the harness (the program forked): not authoritative
        kind, fields = parts[2], [_unescape(p) for p in parts[3:]]
        if kind == "hello":
            rec.hello = fields
        elif kind == "setup-error":
            rec.setup_error = fields[0] if fields else "unknown"
        elif kind == "body":
            rec.body = fields
        elif kind == "test" and fields and fields[0].isdigit() and int(fields[0]) < n_tests:
            rec.tests[int(fields[0])] = fields[1:]
        elif kind == "value" and len(fields) == 4 and all(f.isdigit() for f in fields[:3]) and int(fields[0]) < n_tests:
            index, chunk, count = int(fields[0]), int(fields[1]), int(fields[2])
            chunks = rec.values.setdefault(index, {})
            if chunk in chunks or rec.value_chunks.setdefault(index, count) != count:
                rec.tests[index] = ["error", f"test {index + 1}: its value was reported twice"]
            chunks[chunk] = fields[3]
        elif kind == "disk":
            rec.disk = fields
        elif kind == "done":
            rec.done = True
    return rec


def _judge_calls(rec: _Records, calls: Sequence[CallTest | ReferenceTest | None], limits: SandboxLimits, network: str,
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
                rec.tests[index] = ["fail", f"{where} -> AssertionError: returned {_short_repr(got)}, not one output per input"]
            else:
                pending.append((index, call, got, where))
            continue
        passed, expected = call.judge(got)
        if passed:
            rec.tests[index] = ["pass"]
        else:
            rec.tests[index] = ["fail", f"{where} -> AssertionError: returned {_short_repr(got)}, expected {_shorten(expected)}"]
    if pending:
        _judge_references(rec, pending, limits, network)


# Reference outputs by (reference, entry point, inputs): the same for every candidate.
_REFERENCE_CACHE: dict[bytes, list] = {}
_REFERENCE_CACHE_MAX = 4096
_REFERENCE_CACHE_LOCK = threading.Lock()


def _reference_key(test: ReferenceTest) -> bytes:
    return hashlib.sha256(marshal.dumps((test.reference, test.name, test.args))).digest()


def _judge_references(rec: _Records, pending: list[tuple[int, ReferenceTest, list, str]], limits: SandboxLimits, network: str) -> None:
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
        records = _Run(reference, [c.call_source for c in run_calls], limits, "", network).records(run_calls)
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
        rec.tests[index] = ["pass"] if passed else ["fail", f"test {index + 1}: {test.assert_source} -> AssertionError: {why}"]


def _shorten(text: str) -> str:
    return text if len(text) <= 200 else text[:200] + "..."


def _short_repr(value: object) -> str:
    return short_repr(value)


# ---------------------------------------------------------------------------------------
# the judge: tests that cannot be split run whole in a second sandbox run
# ---------------------------------------------------------------------------------------

_judge_runtime_source: str | None = None
# A request (the judge's arguments) or a reply (the program's value) bigger than this is
# refused: the test cannot be judged (decode_plain refuses values over MAX_VALUE_CHARS too).
_RELAY_FRAME_MAX = 2 * MAX_VALUE_CHARS + 4096


def _judge_runtime() -> str:
    global _judge_runtime_source
    if _judge_runtime_source is None:
        _judge_runtime_source = (Path(__file__).with_name("_judge_runtime.py")).read_text(encoding="utf-8")
    return _judge_runtime_source


def _frame(data: bytes) -> bytes:
    return b"%08x" % len(data) + data


def _next_frame(buf: bytearray) -> bytes | None:
    """Pop one length-prefixed frame off ``buf``; None until a whole one is there. ValueError
    for a header that is not 8 hex digits; OverflowError(bytes still to skip) for one that
    announces more than the relay takes (what has arrived of it is dropped)."""
    if len(buf) < 8:
        return None
    header = bytes(buf[:8])
    if not re.fullmatch(rb"[0-9a-f]{8}", header):
        raise ValueError("a malformed message")
    size = int(header, 16)
    if size > _RELAY_FRAME_MAX:
        dropped = min(len(buf) - 8, size)
        del buf[: 8 + dropped]
        raise OverflowError(size - dropped)
    if len(buf) < 8 + size:
        return None
    body = bytes(buf[8 : 8 + size])
    del buf[: 8 + size]
    return body


class _Judge:
    """The judge's run beside the program's: the tests :func:`split_test` cannot split run
    there whole (``_judge_runtime.py``), against proxies of the names they take from the
    program; this side relays each proxied call to the program's process and its value back,
    both parsed here as plain data, and tells the program's process when each test has ended
    (the judge's verdict arrived). The program never enters the judge's process, and the
    judge's verdict is the test's (:meth:`merge`)."""

    def __init__(self, run: "_Run", calls: Sequence[CallTest | ReferenceTest | None]):
        self.run = run
        self.indexes = [i for i, c in enumerate(calls) if c is None]
        names: set[str] = set()
        for i in self.indexes:
            names.update(program_names(run.tests[i], run.setup))
        self.names = sorted(names)
        # The judge runs every test index, the split ones as empty snippets, so numbers agree.
        wanted = set(self.indexes)
        self.tests = [t if i in wanted else "" for i, t in enumerate(run.tests)]
        self.nonce = secrets.token_hex(16)
        self.fds: dict[str, int] = {}
        self.candidate_fds: tuple[int, int] = (-1, -1)
        self.proc: subprocess.Popen | None = None
        self.pidfd: int | None = None
        self.lease: _Lease | None = None
        self.results = bytearray()
        self.stderr = bytearray()
        self.exited = False
        self.candidate_gone = False
        self.broken: str | None = None
        self.pending: str | None = None  # the call awaiting the program's reply
        self.from_judge = bytearray()
        self.from_program = bytearray()
        self.to_judge = bytearray()
        self.to_program = bytearray()
        self.ended: set[int] = set()
        self.skip = {"requests": 0, "replies": 0}  # bytes of an oversized message still to drop
        self.scanned = 0
        self.closing_program = False
        self.registered: set[int] = set()

    # -- start and stop
    def open(self) -> None:
        """The pipes: (program's end, this side's end) for calls in and replies out."""
        for name in ("results", "judge_requests", "judge_replies", "program_requests", "program_replies"):
            r, w = os.pipe()
            self.fds[name + "_r"], self.fds[name + "_w"] = r, w
        self.candidate_fds = (self.fds["program_requests_r"], self.fds["program_replies_w"])

    def _close(self, *names: str) -> None:
        for name in names:
            fd = self.fds.pop(name, None)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def start(self) -> None:
        """Start the judge's container; the program's ends of its pipes are closed here."""
        self._close("program_requests_r", "program_replies_w")
        fds = self.fds
        self.lease = _LEASES.acquire() if os.geteuid() == 0 else None
        lease = self.lease
        if lease is not None and _kill_user(lease.uid):
            _kill_user_atomically(lease.uid, lease.gid)
            _kill_user(lease.uid)
        run = self.run
        code = (_judge_runtime() + f"\nglobals().update(_teamrl_judge_runtime({fds['judge_requests_w']}, "
                f"{fds['judge_replies_r']}, {self.names!r}))\ndel _teamrl_judge_runtime\n")
        payload = marshal.dumps({
            "nonce": self.nonce, "results_fd": fds["results_w"],
            "uid": lease.uid if lease else None, "gid": lease.gid if lease else None,
            "network": run.network, "host_namespaces": _host_namespaces(run.network),
            "limits": run.payload_limits(), "setup": run.setup, "code": code, "tests": self.tests,
        })
        self.proc = subprocess.Popen(
            _bwrap_command(run.limits, run.network, lease is not None),
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            pass_fds=(fds["results_w"], fds["judge_requests_w"], fds["judge_replies_r"]),
            cwd="/", env=dict(_PROGRAM_ENV, HOME="/tmp", TMPDIR="/tmp"), start_new_session=True,
        )
        self._close("results_w", "judge_requests_w", "judge_replies_r")
        try:
            self.pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):
            self.pidfd = None
        assert self.proc.stdin is not None
        self.to_stdin = bytearray(payload)

    def finish(self) -> None:
        """Kill what is left of the judge's run, reap it, and read the rest of its records."""
        if self.proc is None:
            return
        self.run._kill_all(self.proc, self.lease, f"{self.nonce}\t{_HARNESS_PID}\tdone\tswept\n".encode() in self.results)
        if self.proc.returncode is None:
            _, status, _ = os.wait4(self.proc.pid, 0)
            self.proc.returncode = _bwrap_exit_code(os.waitstatus_to_exitcode(status))
        fd = self.fds.get("results_r")
        if fd is not None:
            deadline = time.monotonic() + _DRAIN_SECONDS
            os.set_blocking(fd, False)
            while time.monotonic() < deadline:
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    time.sleep(0.001)
                    continue
                except OSError:
                    break
                if not data:
                    break
                self._take_results(data)

    def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            try:
                self.run._kill_all(self.proc, self.lease)
                _, status, _ = os.wait4(self.proc.pid, 0)
                self.proc.returncode = os.waitstatus_to_exitcode(status)
            except ChildProcessError:
                self.proc.returncode = -signal.SIGKILL
        if self.proc is not None:
            for stream in (self.proc.stdin, self.proc.stderr):
                try:
                    if stream is not None and not stream.closed:
                        stream.close()
                except OSError:
                    pass
        if self.pidfd is not None:
            try:
                os.close(self.pidfd)
            except OSError:
                pass
            self.pidfd = None
        self._close(*list(self.fds))
        if self.lease is not None:
            _LEASES.release(self.lease)
            self.lease = None

    # -- the relay, driven by _Run._pump's selector
    def register(self, sel: selectors.BaseSelector) -> None:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stderr is not None
        watch = {"results_r": "results", "judge_requests_r": "requests", "program_replies_r": "replies"}
        for fd_name, tag in watch.items():
            os.set_blocking(self.fds[fd_name], False)
            self._watch(sel, self.fds[fd_name], selectors.EVENT_READ, tag)
        for fd_name in ("judge_replies_w", "program_requests_w"):
            os.set_blocking(self.fds[fd_name], False)
        os.set_blocking(self.proc.stderr.fileno(), False)
        self._watch(sel, self.proc.stderr.fileno(), selectors.EVENT_READ, "stderr")
        os.set_blocking(self.proc.stdin.fileno(), False)
        self._watch(sel, self.proc.stdin.fileno(), selectors.EVENT_WRITE, "stdin")
        if self.pidfd is not None:
            self._watch(sel, self.pidfd, selectors.EVENT_READ, "exit")

    def _watch(self, sel: selectors.BaseSelector, fd: int, events: int, tag: str) -> None:
        sel.register(fd, events, ("judge", tag))
        self.registered.add(fd)

    def _unwatch(self, sel: selectors.BaseSelector, fd: int) -> None:
        if fd in self.registered:
            self.registered.discard(fd)
            sel.unregister(fd)

    def handle(self, sel: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
        tag = key.data[1]
        if tag == "exit":
            self.exited = True
            self._unwatch(sel, key.fd)
            return
        if tag == "stdin":
            assert self.proc is not None and self.proc.stdin is not None
            try:
                del self.to_stdin[: os.write(key.fd, self.to_stdin[:65536])]
            except BlockingIOError:
                pass
            except OSError:
                self.to_stdin.clear()
            if not self.to_stdin:
                self._unwatch(sel, key.fd)
                self.proc.stdin.close()
            return
        if tag in ("to_judge", "to_program"):
            self._flush(sel, key.fd, self.to_judge if tag == "to_judge" else self.to_program)
            return
        try:
            data = os.read(key.fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._unwatch(sel, key.fd)
            if tag == "replies":  # the program's process is gone: answer what waits for it
                self.candidate_gone = True
                self.relay(sel)
            return
        if tag == "results":
            self._take_results(data)
        elif tag == "stderr":
            if len(self.stderr) < 4096:
                self.stderr += data[: 4096 - len(self.stderr)]
        elif tag in ("requests", "replies"):
            skipped = min(self.skip[tag], len(data))
            self.skip[tag] -= skipped
            data = data[skipped:]
            if tag == "requests":
                self.from_judge += data
            elif not self.broken:  # once broken, the program's data is dropped unread
                self.from_program += data
            # Bounded: one whole message, plus what a program may write unasked (then broken).
            for buf, who in ((self.from_judge, "the judge"), (self.from_program, "the program's process")):
                if len(buf) > _RELAY_FRAME_MAX + (1 << 16):
                    buf.clear()
                    self.broken = self.broken or f"{who} sent more than the relay takes"
        self.relay(sel)

    def _take_results(self, data: bytes) -> None:
        if len(self.results) < 16 << 20:
            self.results += data

    def _send(self, sel: selectors.BaseSelector, to: str, data: bytes) -> None:
        fd_name = "judge_replies_w" if to == "to_judge" else "program_requests_w"
        fd = self.fds.get(fd_name)
        if fd is None:
            return
        buf = self.to_judge if to == "to_judge" else self.to_program
        buf += _frame(data)
        if fd not in self.registered:
            self._watch(sel, fd, selectors.EVENT_WRITE, to)

    def _flush(self, sel: selectors.BaseSelector, fd: int, buf: bytearray) -> None:
        try:
            del buf[: os.write(fd, buf[:65536])]
        except BlockingIOError:
            return
        except OSError:  # the reader is gone
            buf.clear()
        if not buf:
            self._unwatch(sel, fd)
            if buf is self.to_program and self.closing_program:
                self._close("program_requests_w")

    def _reply(self, sel: selectors.BaseSelector, message: tuple) -> None:
        try:
            data = marshal.dumps(message)
        except ValueError:  # a value marshal cannot write (a LargeValue): not judged here
            data = marshal.dumps(("u", "the program's value could not be relayed"))
        self._send(sel, "to_judge", data)
        self.pending = None

    def relay(self, sel: selectors.BaseSelector) -> None:
        """Move every whole message on: a request from the judge to the program's process
        (one at a time), the program's reply back to the judge, and at each verdict of the
        judge an "end" to the program's process."""
        while True:
            if self.pending is not None:
                if self.broken or self.candidate_gone:
                    why = self.broken or "the program's process ended during the call"
                    self._reply(sel, ("u", why))
                    continue
                try:
                    body = _next_frame(self.from_program)
                except OverflowError as exc:
                    self.skip["replies"] += exc.args[0]
                    self._reply(sel, ("u", f"the value {self.pending}(...) returned is larger than the relay takes "
                                           f"({_RELAY_FRAME_MAX} bytes)"))
                    continue
                except ValueError:
                    self.broken = "the program's process sent a malformed reply"
                    self.from_program.clear()
                    continue
                if body is None:
                    break
                self._reply(sel, self._from_program(body.decode("utf-8", "replace")))
                continue
            try:
                body = _next_frame(self.from_judge)
            except OverflowError as exc:
                self.skip["requests"] += exc.args[0]
                self._reply(sel, ("u", f"the test's arguments are larger than the relay takes ({_RELAY_FRAME_MAX} bytes)"))
                continue
            except ValueError:
                self.broken = self.broken or "the judge sent a malformed request"
                self.from_judge.clear()
                break
            if body is None:
                break
            self._request(sel, body)
        self._scan_verdicts(sel)

    def _request(self, sel: selectors.BaseSelector, body: bytes) -> None:
        try:
            request = decode_plain(body.decode("ascii"))
        except (UnicodeDecodeError, ValueError) as exc:
            self._reply(sel, ("u", f"the judge's request could not be read ({exc})"))
            return
        if not (type(request) is tuple and len(request) == 4 and request[0] == "call" and type(request[1]) is str
                and type(request[2]) is tuple and type(request[3]) is dict and all(type(k) is str for k in request[3])):
            self._reply(sel, ("u", "the judge's request was not a call"))
            return
        self.pending = request[1]
        if self.broken or self.candidate_gone:
            self._reply(sel, ("u", self.broken or "the program's process had ended"))
            return
        self._send(sel, "to_program", marshal.dumps(request))

    def _from_program(self, text: str) -> tuple:
        """The message for the judge, from the program's reply ``text`` (untrusted)."""
        name = self.pending
        kind, rest = text[:1], text[1:]
        if kind == "x":
            exc_name, _, message = rest.partition("\t")
            return ("x", exc_name[:100], message[:2000])
        if kind != "v":
            self.broken = "the program's process sent a malformed reply"
            return ("u", self.broken)
        value_text, _, after_text = rest.partition("\t")
        try:
            value = decode_plain(value_text)
        except ValueError as exc:
            # the harness's refusal (a class of the program's), or ours (too costly to rebuild)
            if value_text.startswith("!") or isinstance(exc, RefusedValue):
                return ("n", f"{name}(...) returned {exc}")
            return ("u", f"the value {name}(...) returned could not be read ({exc})")
        after = None
        if after_text:
            try:
                after = decode_plain(after_text)
            except ValueError as exc:
                return ("n", f"{name}(...) left an argument that is not plain data ({exc})")
            if type(after) is not tuple:
                return ("u", "the program's process sent a malformed reply")
        return ("v", value, after)

    def _scan_verdicts(self, sel: selectors.BaseSelector) -> None:
        """For each new verdict of the judge on a test it runs, end that test on the program's side."""
        end = self.results.rfind(b"\n")
        if end < self.scanned:
            return
        lines = bytes(self.results[self.scanned : end]).split(b"\n")
        self.scanned = end + 1
        prefix = f"{self.nonce}\t{_HARNESS_PID}\ttest\t".encode()
        wanted = set(self.indexes)
        for line in lines:
            if not line.startswith(prefix):
                continue
            index = line[len(prefix) :].split(b"\t", 1)[0]
            if index.isdigit() and int(index) in wanted and int(index) not in self.ended:
                self.ended.add(int(index))
                self._send(sel, "to_program", marshal.dumps(("end",)))

    def poll(self, sel: selectors.BaseSelector, candidate_exited: bool) -> None:
        """Called once per turn of the pump: notice exits the selector cannot report."""
        if self.pidfd is None and not self.exited and self.proc is not None:
            info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            self.exited = info is not None and info.si_pid == self.proc.pid
        if candidate_exited and (not self.candidate_gone or self.pending is not None):
            self.candidate_gone = True
            self.relay(sel)
        if self.exited and not self.closing_program:
            # No more verdicts: the program's process gets EOF once what is queued has gone.
            self.closing_program = True
            fd = self.fds.get("program_requests_w")
            if fd is not None and not self.to_program:
                self._unwatch(sel, fd)
                self._close("program_requests_w")

    # -- the verdicts
    def _failure(self, jrec: _Records) -> str:
        if jrec.setup_error is not None:
            return f"sandbox: could not set up the judge's isolation: {jrec.setup_error}"
        if jrec.body and jrec.body[0] != "ok":
            return f"the judge could not start: {jrec.body[-1]}"
        stderr = self.stderr.decode("utf-8", "replace").strip()
        code = self.proc.returncode if self.proc is not None else None
        return f"the judge's process ended without a verdict (exit {code})" + (f"; stderr: {stderr[-300:]}" if stderr else "")

    def merge(self, rec: _Records) -> None:
        """Put the judge's verdicts into the program's records: a test the program's process
        served takes the judge's verdict; the program's own word on it counts for nothing."""
        jrec = _parse_records(bytes(self.results), self.nonce, len(self.tests))
        for i in self.indexes:
            mine = rec.tests.pop(i, None)
            rec.values.pop(i, None)
            if mine != ["served"]:
                continue  # the program's process never got past this test: unfinished
            verdict = jrec.tests.get(i)
            if not verdict or verdict[0] not in ("pass", "fail", "error", "memory"):
                rec.tests[i] = ["error", f"test {i + 1}: {self._failure(jrec)}"]
            elif verdict[0] == "error" and len(verdict) > 1 and "-> Unjudgeable: " in verdict[1]:
                rec.tests[i] = verdict
                rec.unjudgeable.add(i)
            else:
                rec.tests[i] = verdict


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
    judge's sandbox run, beside the program's and without the program (:class:`_Judge`): the
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
        return _Run(code, tests, limits, setup, network).execute()
    except Exception as exc:  # noqa: BLE001 - the trainer must never see the sandbox raise
        return ExecutionResult(
            status="crash",
            tests_total=len(tests),
            first_failure=f"sandbox: {type(exc).__name__}: {exc}",
            network_isolation="unknown",
            duration_s=time.monotonic() - start,
        )


class _Run:
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
        _judge_calls(records, calls, self.limits, self.network, start + self.limits.wall_seconds + _DECODE_GRACE_SECONDS)
        return self._result(records, *self._outcome, time.monotonic() - start)

    def records(self, calls: Sequence[CallTest | ReferenceTest | None]) -> _Records:
        """Run the program and its tests (a test with a call runs only that call) and return
        what the harness reported; how the process ended is kept in ``self._outcome``."""
        start = time.monotonic()
        lease = _LEASES.acquire() if os.geteuid() == 0 else None
        proc: subprocess.Popen | None = None
        pidfd: int | None = None
        read_fd = write_fd = None
        streams: dict[int, str] = {}
        # Tests that cannot be split run whole in the judge's own sandbox run, beside this one.
        judge = _Judge(self, calls) if any(c is None for c in calls) else None
        try:
            if judge is not None:
                judge.open()
            if lease is not None and _kill_user(lease.uid):  # left by a crashed earlier caller
                _kill_user_atomically(lease.uid, lease.gid)
                _kill_user(lease.uid)
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
                    "host_namespaces": _host_namespaces(self.network),
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
            env = dict(_PROGRAM_ENV, HOME="/tmp", TMPDIR="/tmp")
            proc = subprocess.Popen(
                _bwrap_command(self.limits, self.network, lease is not None),
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
            self._kill_all(proc, lease, swept)
            _, wait_status, rusage = os.wait4(proc.pid, 0)
            proc.returncode = _bwrap_exit_code(os.waitstatus_to_exitcode(wait_status))
            self._drain(streams)
            self._outcome = (proc.returncode, rusage, timed_out, flooded, lease)
            rec = _parse_records(bytes(self.results), nonce, len(self.tests))
            if judge is not None:
                judge.finish()
                judge.merge(rec)
            return rec
        finally:
            if proc is not None and proc.returncode is None:
                self._kill_all(proc, lease)
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
                _LEASES.release(lease)
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

    def _pump(self, proc, pidfd, payload, streams, deadline, judge: _Judge | None = None):
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
        return f"{nonce}\t{_HARNESS_PID}\tdone\tswept\n".encode() in self.results

    def _kill_all(self, proc, lease, swept: bool = False) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the session's group (pid not reaped yet: no reuse)
        except OSError:
            pass
        if lease is not None:
            # The harness's own kill(-1) normally leaves nothing; if it did not run, or /proc
            # still shows something, sweep atomically from here (daemons, setsid, pid hoppers).
            if not swept or _kill_user(lease.uid):
                _kill_user_atomically(lease.uid, lease.gid)
                _kill_user(lease.uid)
        else:
            _kill_session(proc.pid)

    def _drain(self, streams) -> None:
        """Read what is left in the pipes; every writer is dead, so EOF comes quickly."""
        deadline = time.monotonic() + _DRAIN_SECONDS
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
    def _result(self, rec: _Records, returncode: int, rusage, timed_out: bool, flooded: bool, lease, duration: float) -> ExecutionResult:
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
            status, failure = "crash", f"sandbox: could not set up isolation: {stderr_text.strip().splitlines()[0][:300]}"
        elif rec.done:
            kind, failure = first_recorded_failure()
            status = {None: "ok", "fail": "failed", "error": "error", "memory": "memory"}.get(kind, "error")
            if status == "ok" and passed < n:
                status, failure = "error", unfinished("the harness reported the end")
            if rec.disk and status in ("failed", "error"):
                place, files = rec.disk[0], rec.disk[1] if len(rec.disk) > 1 else "?"
                status = "disk"
                failure = (f"the run filled its disk ({place} full, {files} files; max_disk_bytes={limits.max_disk_bytes}, "
                           f"each file or directory a {_INODE_BYTES}-byte share): {failure}")
        elif returncode == -signal.SIGSYS:  # the seccomp filter's kill: memfd_create or shmget
            status = "memory"
            failure = unfinished("the process called memfd_create or shmget (memory outside the run's limits) and was killed")
        else:
            kind, recorded = first_recorded_failure()
            memory_hint = kind == "memory" or re.search(r"MemoryError|Cannot allocate memory|out of memory", stderr_text)
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
