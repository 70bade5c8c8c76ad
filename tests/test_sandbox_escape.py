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
    from teamrl.sandbox import sandbox

    monkeypatch.setattr(sandbox, "_BWRAP_PATHS", ("/nonexistent/bwrap",))
    r = run_program("print('ran')", ["assert True"], FAST)
    assert r.status == "crash" and r.tests_passed == 0 and "ran" not in r.stdout
    assert r.first_failure.startswith("sandbox:") and "bubblewrap" in r.first_failure, r.first_failure


@pytest.mark.parametrize("weakened", [("--unshare-ipc",), ("--remount-ro", "/")], ids=["shared-ipc", "writable-root"])
def test_an_isolation_step_that_did_not_happen_refuses_the_run(monkeypatch, weakened):
    from teamrl.sandbox import sandbox

    real = sandbox._bwrap_command

    def weaker(*args, **kwargs):
        command = real(*args, **kwargs)
        for i in range(len(command)):
            if tuple(command[i : i + len(weakened)]) == weakened:
                return command[:i] + command[i + len(weakened) :]
        raise AssertionError(f"{weakened} not in the bwrap command")

    monkeypatch.setattr(sandbox, "_bwrap_command", weaker)
    r = run_program("print('ran')", ["assert True"], FAST)
    assert r.status == "crash" and r.tests_passed == 0 and "ran" not in r.stdout, r
    assert "could not set up isolation" in r.first_failure, r.first_failure


def test_a_bubblewrap_failure_is_reported_with_its_message(monkeypatch):
    from teamrl.sandbox import sandbox

    real = sandbox._bwrap_command
    monkeypatch.setattr(sandbox, "_bwrap_command", lambda *a, **k: real(*a, **k)[:1] + ["--ro-bind", "/nonexistent-src", "/x"] + real(*a, **k)[1:])
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
