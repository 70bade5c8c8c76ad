"""The sandbox against the five holes of issue 12: host /dev/shm, /var/tmp and /run/lock,
AF_UNIX sockets on host paths, survivors of a killed caller, a verdict decided inside the
untrusted process, and the host's /proc/*/cmdline. Each test runs through the public API and
also checks that nothing the program made (processes, files) is left on the host."""

from __future__ import annotations

import glob
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from teamrl.sandbox import SandboxLimits, run_program
from tests.sandbox_hostile import processes_with

REPO = Path(__file__).resolve().parents[1]
FAST = SandboxLimits(wall_seconds=5.0, cpu_seconds=3.0, memory_mb=256, max_processes=16, max_output_bytes=20_000)
WRONG_ADD = "def add(a, b):\n    return 0\n"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]


# 1 -------------------------------------------------------------------------------------


def test_shared_memory_and_other_writable_host_places_stay_untouched():
    marker = f"teamrl-escape-{secrets.token_hex(6)}"
    places = ["/tmp", "/dev/shm", "/var/tmp", "/run/lock"]
    code = f"""
import glob
import json
import os
for place in {places!r}:
    try:
        with open(os.path.join(place, {marker!r}), "w") as fh:
            fh.write("x" * 1000)
        print("WROTE", place)
    except OSError as exc:
        print("REFUSED", place, type(exc).__name__)
"""
    try:
        r = run_program(code, [], FAST)
        assert r.status == "ok", r
        left = [p for p in places if os.path.exists(os.path.join(p, marker))]
        assert left == [], f"files the run wrote are still on the host in {left}; stdout: {r.stdout}"
    finally:
        for p in places:
            try:
                os.unlink(os.path.join(p, marker))
            except OSError:
                pass


def test_total_bytes_a_run_can_write_is_bounded():
    limits = SandboxLimits(wall_seconds=10.0, cpu_seconds=8.0, memory_mb=256, max_file_bytes=1 << 20, max_disk_bytes=8 << 20)
    code = """
import glob
import json
import os
total = 0
for place in ("/tmp", "/dev/shm", "/var/tmp", "/run/lock", "."):
    for i in range(64):
        try:
            with open(os.path.join(place, f"fill-{total}"), "wb") as fh:
                fh.write(b"x" * (1 << 20))
            total += 1 << 20
        except OSError:
            break
print("TOTAL", total)
"""
    r = run_program(code, [], limits)
    assert r.status == "ok", r
    total = int(r.stdout.split("TOTAL")[1].split()[0])
    assert total <= 8 << 20, f"the run wrote {total} bytes with max_disk_bytes={8 << 20}"
    assert r.filesystem_isolation == "private-tmpfs"


# 2 -------------------------------------------------------------------------------------


def test_unix_socket_on_a_host_path_is_unreachable():
    path = f"/run/lock/teamrl-escape-{secrets.token_hex(6)}.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen(4)
    server.settimeout(0.2)
    accepted: list[bytes] = []

    def serve() -> None:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            try:
                conn, _ = server.accept()
            except (socket.timeout, OSError):
                continue
            accepted.append(conn.recv(100))
            conn.sendall(b"PONG")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    code = f"""
import socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect({path!r})
    s.sendall(b"PING")
    print("REPLY", s.recv(100))
except OSError as exc:
    print("REFUSED", type(exc).__name__)
"""
    try:
        r = run_program(code, [], FAST)
    finally:
        server.close()
        os.unlink(path)
    assert "PONG" not in r.stdout, r
    assert accepted == []


# 3 -------------------------------------------------------------------------------------


def test_nothing_survives_a_caller_killed_mid_run(tmp_path):
    marker = f"{secrets.randbelow(10**6)}.{secrets.randbelow(10**6) + 1}"  # a unique sleep length
    program = f"""
import subprocess, sys, time
open("/tmp/teamrl-escape-{marker}", "w").write("left behind?")  # in the run's own /tmp
subprocess.Popen(["sleep", "{marker}"], start_new_session=True)
subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(1000)  # {marker}"])
time.sleep(30)
"""
    caller = (
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from teamrl.sandbox import SandboxLimits, run_program\n"
        f"print(run_program({program!r}, [], SandboxLimits(wall_seconds=60, cpu_seconds=60)))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", caller], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def children() -> list[int]:  # the caller's own command line holds the marker too
        return [pid for pid in processes_with(marker) if pid != proc.pid]

    try:
        deadline = time.monotonic() + 40
        while len(children()) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        if len(children()) < 2:
            proc.kill()
            raise AssertionError(f"the program's children never started: {proc.communicate()[0].decode()[-2000:]}")
        time.sleep(0.2)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10  # generous: the machine may be loaded
        while children() and time.monotonic() < deadline:
            time.sleep(0.05)
        survivors = children()
    finally:
        for pid in processes_with(marker):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    assert survivors == [], f"{len(survivors)} processes of the run outlived its killed caller"
    # and no file of the run is left on the host (the old sandbox left its work dir behind)
    host_tmp = tempfile.gettempdir()
    left = glob.glob(f"{host_tmp}/*{marker}*") + glob.glob(f"{host_tmp}/*/*{marker}*") + glob.glob(f"/dev/shm/*{marker}*")
    for path in left:
        os.unlink(path)
    assert left == []


# 4 -------------------------------------------------------------------------------------


def test_an_object_equal_to_everything_does_not_pass():
    code = "class Anything:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n\ndef add(a, b):\n    return Anything()\n"
    check_style = "def check(candidate):\n    assert candidate(1, 2) == 3\ncheck(add)\n"
    r = run_program(code, [*ADD_TESTS, check_style], FAST)
    assert r.tests_passed == 0, r
    assert r.status == "failed", r


def test_calling_the_harness_reporting_function_does_not_fake_passes():
    exploit = (
        "import os, sys\n"
        "frame = sys._getframe(0)\n"
        "while frame is not None and 'emit' not in frame.f_locals:\n"
        "    frame = frame.f_back\n"
        "emit = frame.f_locals['emit']\n"
        "for i in range(3):\n"
        "    emit('test', i, 'pass')\n"
        "    emit('value', i, 'pass')\n"
        "emit('done')\n"
        "os._exit(0)\n"
    )
    r = run_program(exploit + WRONG_ADD, ADD_TESTS, FAST)
    assert r.tests_passed == 0, r


def test_right_answers_still_pass_when_judged_outside():
    add = "def add(a, b):\n    return a + b\n"
    tests = [
        *ADD_TESTS,
        "def check(candidate):\n    assert candidate([1], [2]) == [1, 2]\n    assert candidate(0.5, 0.25) == 0.75\ncheck(add)\n",
        "assert add((1,), (2,)) == (1, 2), 'tuples'",
        "assert add(1, 2) == 4",
    ]
    r = run_program(add, tests, FAST)
    assert (r.status, r.tests_passed, r.tests_total) == ("failed", 5, 6), r
    assert "test 6" in r.first_failure and "returned 3" in r.first_failure, r.first_failure


# 5 -------------------------------------------------------------------------------------


def test_host_command_lines_are_not_readable():
    marker = f"{secrets.randbelow(10**6)}.{secrets.randbelow(10**6) + 1}"
    witness = subprocess.Popen(["sleep", marker])
    code = f"""
import glob
import json
import os
seen = 0
for entry in os.listdir("/proc"):
    if entry.isdigit():
        try:
            if b"{marker}" in open(f"/proc/{{entry}}/cmdline", "rb").read():
                seen += 1
        except OSError:
            pass
print("SEEN", seen, "PROCS", sum(e.isdigit() for e in os.listdir("/proc")))
"""
    try:
        r = run_program(code, [], FAST)
    finally:
        witness.kill()
        witness.wait()
    assert r.status == "ok", r
    assert "SEEN 0 " in r.stdout, r.stdout


# the hostile suite, as root and as an unprivileged user -----------------------------------


def _assert_contained(rows: list[dict]) -> None:
    for row in rows:
        assert row["passed"] == 0, row
        assert row["status"] in row["expected"], row
        assert (row["processes"], row["files"]) == (0, 0), row
        assert (row["network"], row["filesystem"]) == ("netns", "private-tmpfs"), row


@pytest.mark.skipif(os.geteuid() != 0, reason="the caller is not root here: the unprivileged test below covers this mode")
def test_hostile_suite_as_root_leaves_nothing_behind():
    from tests.sandbox_hostile import run_suite

    rows = run_suite()
    _assert_contained(rows)
    assert all(row["uid"] is not None for row in rows)  # each ran as its own leased uid


SYSTEM_PYTHON = "/usr/bin/python3"


def test_hostile_suite_as_an_unprivileged_user_leaves_nothing_behind():
    """The same suite with the caller an ordinary user (bwrap in a user namespace)."""
    if os.geteuid() == 0:
        if not (os.path.exists("/usr/bin/setpriv") and os.path.exists(SYSTEM_PYTHON)):
            pytest.skip("cannot run as an unprivileged user here: needs /usr/bin/setpriv and /usr/bin/python3")
        command = ["/usr/bin/setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", SYSTEM_PYTHON]
    else:
        command = [sys.executable]
    probe = subprocess.run([*command, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); import teamrl.sandbox"],
                           capture_output=True, cwd="/")
    if probe.returncode != 0:  # say so, rather than pass quietly: this mode was not tested
        pytest.skip(f"the unprivileged user cannot import teamrl.sandbox from {REPO} (an unreadable checkout, or "
                    f"no Python >= 3.10 at {command[-1]}): {probe.stderr.decode()[-200:]}")
    done = subprocess.run([*command, str(REPO / "tests" / "sandbox_hostile.py"), "--json"], capture_output=True, text=True,
                          timeout=300, cwd="/")
    assert done.stdout.strip(), done.stderr[-2000:]
    rows = json.loads(done.stdout)
    _assert_contained(rows)
    assert all(row["uid"] is None for row in rows)  # no user switch without root


# a trainer on a coding task, fed hostile solutions -----------------------------------------


def test_a_trainer_survives_a_batch_of_escape_attempts(tmp_path, monkeypatch):
    from teamrl.core.config import load_config
    from teamrl.rollout.engine import Completion
    from teamrl.trainer.trainer import Trainer

    marker = f"{secrets.randbelow(10**6) + 1000}.{secrets.randbelow(10**6) + 1}"
    signature = "def has_close_elements(numbers, threshold):\n"
    hostile = [
        # an object equal to everything, and a forged report through the harness's own emit
        "class Anything:\n    def __eq__(self, other):\n        return True\n    def __bool__(self):\n        return True\n"
        + signature + "    return Anything()\n",
        "import os, sys\n" + signature + "    f = sys._getframe(0)\n    while 'emit' not in f.f_locals:\n        f = f.f_back\n"
        "    for i in range(20):\n        f.f_locals['emit']('test', i, 'pass')\n    f.f_locals['emit']('done')\n    os._exit(0)\n"
        "    return True\n",
        # host memory, a daemon meant to outlive the caller, the host's command lines
        "import os\nfor i in range(64):\n    try:\n        open(f'/dev/shm/teamrl-{marker}-{{i}}', 'wb').write(b'x' * (1 << 20))\n"
        "    except OSError:\n        break\n" + signature + "    return 'wrong'\n",
        "import subprocess\nsubprocess.Popen(['sleep', '" + marker + "'], start_new_session=True)\n"
        + signature + "    return open('/proc/1/cmdline').read()  # a str: never == True or False\n",
    ]
    cfg = load_config(None, ["model=tiny-random", "threads=1", "algorithm=magrpo", "task.name=code.helper_main",
                             "task.num_problems=1", "task.wall_seconds=3.0", "rollout.group_size=4", "rollout.batch_size=1",
                             "rollout.max_new_tokens=8", "run.progress=false", "policy.lora.r=4", f"run.dir={tmp_path}",
                             "name=escape", "train.steps=1"])
    trainer = Trainer(cfg)
    tok = trainer.tokenizer

    def fake_generate(policy, requests, seed=None):
        out = []
        for r in requests:
            texts = (hostile * r.n)[: r.n]
            out.append([Completion(tok(x, add_special_tokens=False)["input_ids"][:20], [0.0] * 20, x, "length") for x in texts])
        return out

    from teamrl.sandbox import SandboxPool

    ran: list[tuple[str, object]] = []
    real_submit = SandboxPool.submit

    def recording_submit(self, code, tests=(), *args, **kwargs):
        future = real_submit(self, code, tests, *args, **kwargs)
        ran.append((code, future))
        return future

    monkeypatch.setattr(SandboxPool, "submit", recording_submit)
    monkeypatch.setattr(trainer.engine, "generate", fake_generate)
    # the scheduler hands each flush to the engine as one generate_many call (policies on one base share a batch)
    monkeypatch.setattr(trainer.engine, "generate_many",
                        lambda calls: [fake_generate(policy, requests, seed) for policy, requests, seed in calls])
    record = trainer.train_step()
    results = [(code, future.result()) for code, future in ran]
    # every attack reached the sandbox with the problem's tests, and none passed one (each
    # returns something that is never True or False)
    for attack in ("Anything", "emit", "/dev/shm", "sleep"):
        assert any(attack in code and r.tests_total > 0 for code, r in results), attack
    assert all(r.tests_passed == 0 for code, r in results if "has_close_elements" in code), results
    numbers = {k: v for k, v in record.items() if isinstance(v, float)}
    assert numbers and all(v == v and abs(v) != float("inf") for v in numbers.values()), numbers
    assert record["step"] == 1, record
    assert processes_with(marker) == []
    assert [n for n in os.listdir("/dev/shm") if marker in n] == []


# fail closed ---------------------------------------------------------------------------------


def test_without_bubblewrap_the_run_is_refused_naming_the_package(monkeypatch):
    from teamrl.sandbox import jail

    monkeypatch.setattr(jail, "_BWRAP_PATHS", ("/nonexistent/bwrap",))
    r = run_program("print('ran')", ["assert True"], FAST)
    assert r.status == "crash" and r.tests_passed == 0 and "ran" not in r.stdout
    assert r.first_failure.startswith("sandbox:") and "bubblewrap" in r.first_failure, r.first_failure


@pytest.mark.parametrize("weakened", [("--unshare-ipc",), ("--remount-ro", "/")], ids=["shared-ipc", "writable-root"])
def test_an_isolation_step_that_did_not_happen_refuses_the_run(monkeypatch, weakened):
    from teamrl.sandbox import jail, relay, sandbox

    real = jail.bwrap_command

    def weaker(*args, **kwargs):
        command = real(*args, **kwargs)
        for i in range(len(command)):
            if tuple(command[i : i + len(weakened)]) == weakened:
                return command[:i] + command[i + len(weakened) :]
        raise AssertionError(f"{weakened} not in the bwrap command")

    for module in (sandbox, relay):  # the program's run and the judge's
        monkeypatch.setattr(module, "bwrap_command", weaker)
    r = run_program("print('ran')", ["assert True"], FAST)
    assert r.status == "crash" and r.tests_passed == 0 and "ran" not in r.stdout, r
    assert "could not set up isolation" in r.first_failure, r.first_failure


def test_a_bubblewrap_failure_is_reported_with_its_message(monkeypatch):
    from teamrl.sandbox import jail, relay, sandbox

    real = jail.bwrap_command
    for module in (sandbox, relay):  # the program's run and the judge's
        monkeypatch.setattr(module, "bwrap_command", lambda *a, **k: real(*a, **k)[:1] + ["--ro-bind", "/nonexistent-src", "/x"] + real(*a, **k)[1:])
    r = run_program("print('ran')", [], FAST)
    assert r.status == "crash" and "ran" not in r.stdout, r
    assert "could not set up isolation" in r.first_failure and "nonexistent-src" in r.first_failure, r.first_failure


def test_subclasses_of_plain_types_are_judged_by_their_content():
    """collections.Counter or re.Match answers (MBPP) still pass; an int or list subclass
    whose __eq__ or __iter__ lies is judged by what it holds."""
    code = (
        "import collections, re\n"
        "class Liar(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "class Hiding(list):\n    def __iter__(self):\n        return iter([1, 2])\n    def __eq__(self, other):\n        return True\n"
        "def liar():\n    return Liar(7)\n"
        "def hiding():\n    return Hiding([9])\n"
        "def counts():\n    return collections.Counter('aab')\n"
        "def match():\n    return re.match('a', 'abc')\n"
    )
    tests = ["assert liar() == 3", "assert liar() == 7", "assert hiding() == [1, 2]", "assert hiding() == [9]",
             "assert counts() == {'a': 2, 'b': 1}", "assert match()", "assert not match()"]
    r = run_program(code, tests, FAST)
    assert (r.tests_passed, r.tests_total) == (4, 7), r
    assert r.first_failure.startswith("test 1: assert liar() == 3 -> liar() -> AssertionError: returned 7"), r.first_failure


def test_test_sources_are_parsed_one_thread_at_a_time(monkeypatch):
    """CPython 3.11's AST conversion keeps one recursion counter per interpreter: two pool threads
    parsing at once can fail with 'SystemError: AST constructor recursion depth mismatch' (seen as a
    sandbox 'crash' of a correct HumanEval+ solution). The judge parses under one lock."""
    import ast
    import threading

    from teamrl.sandbox import judge

    real_parse = ast.parse
    active, most = [0], [0]
    guard = threading.Lock()

    def watched_parse(*args, **kwargs):
        with guard:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.005)
        try:
            return real_parse(*args, **kwargs)
        finally:
            with guard:
                active[0] -= 1

    monkeypatch.setattr(ast, "parse", watched_parse)
    work = [threading.Thread(target=lambda: [judge.split_test("assert f(1) == 2") or judge.decode_plain("[1, 2]")
                                             for _ in range(20)]) for _ in range(4)]
    for t in work:
        t.start()
    for t in work:
        t.join()
    assert most[0] == 1, f"{most[0]} threads parsed at once"


# issue 34: native code in the program's process; memory and disk outside the limits ------------

# Three routes to native code that the old harness left open, each ending in a TCP connection
# to ``PORT`` on 127.0.0.1 sending b"HELLO-FROM-SANDBOX". In the audit-hook network mode only
# the harness's Python-level hook stands between that and the host's loopback.
_NATIVE_SEND = (
    "def native_send(CFuncPtr, SimpleCData, port):\n"
    "    class I(SimpleCData):\n        _type_ = 'i'\n"
    "    class F(CFuncPtr):\n        _flags_ = 1\n        _restype_ = I\n"
    "    libc = type('D', (), dict(_handle=0))()\n"
    "    fd = F(('socket', libc))(2, 1, 0)\n"
    "    address = (2).to_bytes(2, 'little') + port.to_bytes(2, 'big') + bytes([127, 0, 0, 1]) + bytes(8)\n"
    "    print('connect', F(('connect', libc))(fd, address, 16))\n"
    "    print('sent', F(('send', libc))(fd, b'HELLO-FROM-SANDBOX', 18, 0))\n"
)
NATIVE_ROUTES = {
    # the route: _ctypes loaded under a name whose first segment is not denied
    "ctypes-dotted-name": _NATIVE_SEND + (
        "import glob, sys, importlib.machinery, importlib.util\n"
        "for d in sys.path:\n    for path in glob.glob(d + '/_ctypes.*.so'):\n"
        "        m = importlib.util.module_from_spec(importlib.util.spec_from_file_location(\n"
        "            'zz._ctypes', path, loader=importlib.machinery.ExtensionFileLoader('zz._ctypes', path)))\n"
        "        native_send(m.CFuncPtr, m._SimpleCData, PORT)\n"),
    # ctypes' types that the harness's own use of ctypes left loaded, found from object
    "ctypes-types-left-in-memory": _NATIVE_SEND + (
        "def walk(c, seen):\n    for s in type.__subclasses__(c):\n        if s not in seen:\n"
        "            seen.append(s)\n            walk(s, seen)\n"
        "seen = []\nwalk(object, seen)\nby = dict((c.__name__, c) for c in seen)\n"
        "native_send(by['CFuncPtr'], by['_SimpleCData'], PORT)\n"),
    # a subinterpreter has no audit hook of its own
    "subinterpreter": (
        "import _xxsubinterpreters as s\n"
        "s.run_string(s.create(), \"import socket\\nc = socket.create_connection(('127.0.0.1', PORT), timeout=2)\\n"
        "c.sendall(b'HELLO-FROM-SANDBOX')\\n\")\n"),
}


@pytest.mark.parametrize("route", sorted(NATIVE_ROUTES))
def test_native_code_cannot_reach_the_host_in_the_audit_hook_mode(route):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.1)
    port = server.getsockname()[1]
    received: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (socket.timeout, OSError):
                continue
            conn.settimeout(1)
            try:
                received.append(conn.recv(100))
            except OSError:
                pass
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with pytest.warns(RuntimeWarning, match="audit-hook"):  # the weaker mode says what it does not contain
            r = run_program(NATIVE_ROUTES[route].replace("PORT", str(port)), [], FAST, network="audit-hook")
    finally:
        time.sleep(0.2)
        stop.set()
        thread.join()
        server.close()
    assert received == [], (received, r)
    assert r.status == "error" and r.network_isolation == "audit-hook", r


def test_memfd_memory_outside_the_limits_is_refused_and_reported_as_memory():
    """The issue's numbers: 24 memfd files of 8 MB under memory_mb=128, max_disk_bytes=1MB
    raised host Shmem by 192 MB (neither RLIMIT_AS nor the tmpfs counts them) and ended as a
    plain 'failed'. Now the first memfd_create kills the process: not one file is made."""
    limits = SandboxLimits(wall_seconds=10.0, cpu_seconds=8.0, memory_mb=128, max_disk_bytes=1 << 20)
    code = ("import os\nfds = []\nfor i in range(24):\n    fd = os.memfd_create('m%d' % i)\n"
            "    os.write(fd, b'x' * (8 << 20))\n    fds.append(fd)\n    print('CREATED', i, flush=True)\n" + WRONG_ADD)
    r = run_program(code, ADD_TESTS, limits)
    assert "CREATED" not in r.stdout, r.stdout
    assert r.status == "memory", r
    assert "memfd_create" in r.first_failure, r.first_failure


def test_empty_files_count_against_the_disk_limit():
    """The issue: empty files in a loop made 320k files in 3 s under max_disk_bytes=1MB (host
    Slab +330 MB). Each file now costs a 4 KiB share of max_disk_bytes."""
    limits = SandboxLimits(wall_seconds=20.0, cpu_seconds=15.0, max_disk_bytes=1 << 20)
    code = ("import os\ncounts = []\nfor place in ('/tmp', '/dev/shm'):\n    n = 0\n    try:\n"
            "        while n < 50000:\n            open(os.path.join(place, 'f%d' % n), 'w').close()\n            n += 1\n"
            "    except OSError as exc:\n        print(place, type(exc).__name__, exc)\n    counts.append(n)\n"
            "print('FILES', sum(counts))\n" + WRONG_ADD)
    r = run_program(code, ADD_TESTS, limits)
    files = int(r.stdout.split("FILES")[1].split()[0])
    assert files <= (1 << 20) // 4096 + 8, f"the run made {files} files with max_disk_bytes=1MiB"
    assert r.status == "disk", r
    assert "disk" in r.first_failure, r.first_failure


def test_stdlib_extension_modules_still_import():
    """Extension modules load only from the interpreter's own lib-dynload; the usual ones work."""
    code = ("import array, bisect, collections, datetime, decimal, fractions, hashlib, heapq, itertools, json, math\n"
            "import random, re, statistics, string, struct, unicodedata, zlib\n"
            "def f():\n    return json.dumps([decimal.Decimal('1.5').quantize(decimal.Decimal('1')).to_integral_value().__int__(),"
            " heapq.nsmallest(1, [3, 1])[0], bisect.bisect([1, 2], 2), hashlib.sha256(b'').hexdigest()[:4]])\n")
    r = run_program(code, ["assert f() == '[2, 1, 2, \"e3b0\"]'"], FAST)
    assert (r.status, r.tests_passed) == ("ok", 1), r


def test_shmget_kills_the_process_that_asks_for_it():
    """SysV shared memory (a private IPC namespace, but no rlimit counts it) is refused like
    memfd_create: the kernel kills the caller. perl has shmget built in; the program's own
    process stays, so the run reports the child's death."""
    if not os.path.exists("/usr/bin/perl"):
        pytest.skip("no /usr/bin/perl to call shmget without native code of the test's own")
    code = ("import subprocess\nr = subprocess.run(['/usr/bin/perl', '-e', 'print defined(shmget(0, 1 << 24, 0600 | 01000)) ? \"GOT\" : \"NO\"'],"
            " capture_output=True, text=True)\nprint('RC', r.returncode, r.stdout)\n")
    r = run_program(code, [], FAST)
    assert r.status == "ok", r
    assert "RC -31 " in r.stdout and "GOT" not in r.stdout, r.stdout  # -31: SIGSYS


def test_both_stages_name_the_same_native_modules():
    """_setup.py hides the files of the modules the harness's audit hook (_harness_guards.py) refuses."""
    import ast

    def constant(name: str) -> frozenset:
        tree = ast.parse((REPO / "teamrl" / "sandbox" / name).read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "NATIVE_MODULES":
                return frozenset(ast.literal_eval(node.value.args[0]))
        raise AssertionError(f"no NATIVE_MODULES in {name}")

    assert constant("_setup.py") == constant("_harness_guards.py")
    assert {"_ctypes", "ctypes", "_cffi_backend", "_xxsubinterpreters", "_testcapi"} <= constant("_harness_guards.py")


@pytest.mark.parametrize(
    "step, undo, why",
    [
        ("execute-only interpreter", ("    bind_read_only(staged, interpreter, 0)\n", ""), "dumpable"),
        ("file limit", (",nr_inodes={max(16, size // INODE_BYTES)}", ""), "files"),
        ("noexec", ("MS_NOSUID | MS_NODEV | MS_NOEXEC, options", "MS_NOSUID | MS_NODEV, options"), "noexec"),
        ("seccomp", ("        _install_seccomp(libc, check, PR_SET_SECCOMP, filter_)\n", "        pass\n"), "seccomp"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_first_stage_step_that_did_not_happen_refuses_the_run(monkeypatch, step, undo, why):
    """The harness checks what the first stage (_setup.py) built, and runs nothing without it."""
    from teamrl.sandbox import jail

    text = jail._setup()
    assert text.count(undo[0]) == 1, f"{step}: {undo[0]!r} is not in _setup.py"
    monkeypatch.setattr(jail, "_setup_source", text.replace(undo[0], undo[1]))
    r = run_program("print('ran')", ["assert True"], FAST)
    assert r.status == "crash" and r.tests_passed == 0 and "ran" not in r.stdout, r
    assert "could not set up isolation" in r.first_failure and why in r.first_failure, r.first_failure
