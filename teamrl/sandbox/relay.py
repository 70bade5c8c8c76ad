"""The judge: tests that cannot be split run whole in a second sandbox run, beside the
program's, and this side relays the calls they make to the program's process."""

from __future__ import annotations

import marshal
import os
import re
import secrets
import selectors
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Protocol, Sequence

from teamrl.sandbox.jail import DRAIN_SECONDS, PROGRAM_ENV, bwrap_command, bwrap_exit_code, host_namespace_inodes
from teamrl.sandbox.judge import MAX_VALUE_CHARS, CallTest, ReferenceTest, RefusedValue, decode_plain, program_names
from teamrl.sandbox.records import HARNESS_PID, Records, parse_records
from teamrl.sandbox.users import LEASES, Lease, kill_user, kill_user_atomically


class ProgramRunView(Protocol):
    """What the judge reads of the program's run (:class:`teamrl.sandbox.sandbox.ProgramRun`, which imports this
    module: named here by its shape, not imported)."""

    tests: list[str]
    setup: str
    network: str
    limits: Any

    def payload_limits(self) -> dict: ...

    def kill_all(self, proc: Any, lease: Any, swept: bool = False) -> None: ...


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


class JudgeRun:
    """The judge's run beside the program's: the tests :func:`split_test` cannot split run
    there whole (``_judge_runtime.py``), against proxies of the names they take from the
    program; this side relays each proxied call to the program's process and its value back,
    both parsed here as plain data, and tells the program's process when each test has ended
    (the judge's verdict arrived). The program never enters the judge's process, and the
    judge's verdict is the test's (:meth:`merge`)."""

    def __init__(self, run: ProgramRunView, calls: Sequence[CallTest | ReferenceTest | None]):
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
        self.lease: Lease | None = None
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
        self.lease = LEASES.acquire() if os.geteuid() == 0 else None
        lease = self.lease
        if lease is not None and kill_user(lease.uid):
            kill_user_atomically(lease.uid, lease.gid)
            kill_user(lease.uid)
        run = self.run
        code = (_judge_runtime() + f"\nglobals().update(_teamrl_judge_runtime({fds['judge_requests_w']}, "
                f"{fds['judge_replies_r']}, {self.names!r}))\ndel _teamrl_judge_runtime\n")
        payload = marshal.dumps({
            "nonce": self.nonce, "results_fd": fds["results_w"],
            "uid": lease.uid if lease else None, "gid": lease.gid if lease else None,
            "network": run.network, "host_namespaces": host_namespace_inodes(run.network),
            "limits": run.payload_limits(), "setup": run.setup, "code": code, "tests": self.tests,
        })
        self.proc = subprocess.Popen(
            bwrap_command(run.limits, run.network, lease is not None),
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            pass_fds=(fds["results_w"], fds["judge_requests_w"], fds["judge_replies_r"]),
            cwd="/", env=dict(PROGRAM_ENV, HOME="/tmp", TMPDIR="/tmp"), start_new_session=True,
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
        self.run.kill_all(
            self.proc, self.lease, f"{self.nonce}\t{HARNESS_PID}\tdone\tswept\n".encode() in self.results
        )
        if self.proc.returncode is None:
            _, status, _ = os.wait4(self.proc.pid, 0)
            self.proc.returncode = bwrap_exit_code(os.waitstatus_to_exitcode(status))
        fd = self.fds.get("results_r")
        if fd is not None:
            deadline = time.monotonic() + DRAIN_SECONDS
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
                self.run.kill_all(self.proc, self.lease)
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
            LEASES.release(self.lease)
            self.lease = None

    # -- the relay, driven by ProgramRun._pump's selector
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
                self._reply(
                    sel, ("u", f"the test's arguments are larger than the relay takes ({_RELAY_FRAME_MAX} bytes)")
                )
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
        prefix = f"{self.nonce}\t{HARNESS_PID}\ttest\t".encode()
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
    def _failure(self, jrec: Records) -> str:
        if jrec.setup_error is not None:
            return f"sandbox: could not set up the judge's isolation: {jrec.setup_error}"
        if jrec.body and jrec.body[0] != "ok":
            return f"the judge could not start: {jrec.body[-1]}"
        stderr = self.stderr.decode("utf-8", "replace").strip()
        code = self.proc.returncode if self.proc is not None else None
        return f"the judge's process ended without a verdict (exit {code})" + (
            f"; stderr: {stderr[-300:]}" if stderr else ""
        )

    def merge(self, rec: Records) -> None:
        """Put the judge's verdicts into the program's records: a test the program's process
        served takes the judge's verdict; the program's own word on it counts for nothing."""
        jrec = parse_records(bytes(self.results), self.nonce, len(self.tests))
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
