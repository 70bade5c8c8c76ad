"""The sandbox: normal runs, and a hostile suite where every attack must be contained,
reported with the right status, and leave the calling process healthy."""

from __future__ import annotations

import ast
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from teamrl.sandbox import (
    ExecutionResult,
    SandboxJob,
    SandboxLimits,
    SandboxPool,
    run_program,
)

REPO = Path(__file__).resolve().parents[1]
IS_ROOT = os.geteuid() == 0
FAST = SandboxLimits(wall_seconds=3.0, cpu_seconds=2.0, memory_mb=256, max_processes=16, max_output_bytes=10_000)

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]
WRONG_ADD = "def add(a, b):\n    return 0\n"


def live_tasks_of(uid: int) -> list[int]:
    """Pids of non-zombie processes with real uid ``uid`` (read from /proc directly)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid and fields["State"].strip()[0] not in "ZX":
            pids.append(int(entry))
    return pids


def assert_healthy(result: ExecutionResult | None = None) -> None:
    """The caller survived and a normal program still runs correctly; nothing was left behind."""
    os.kill(os.getpid(), 0)
    if result is not None and result.sandbox_uid is not None:
        assert live_tasks_of(result.sandbox_uid) == [], "processes of the sandbox user survived the run"
    after = run_program(ADD, ADD_TESTS, FAST)
    assert (after.status, after.tests_passed) == ("ok", 3), after


@pytest.fixture
def canary_dir():
    """A world-traversable directory outside every sandbox, holding a root-owned canary."""
    base = REPO / ".pytest_cache"
    base.mkdir(exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="sandbox-canary-", dir=base))
    d.chmod(0o755)
    canary = d / "canary.txt"
    canary.write_text("untouched")
    canary.chmod(0o644)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# normal programs
# ---------------------------------------------------------------------------------------


def test_all_tests_pass_reports_ok_with_counts():
    r = run_program(ADD, ADD_TESTS, FAST)
    assert r.status == "ok" and r.ok
    assert (r.tests_passed, r.tests_total) == (3, 3)
    assert r.pass_fraction == 1.0
    assert r.first_failure is None
    assert r.network_isolation in ("netns", "seccomp", "audit-hook")
    assert r.duration_s < FAST.wall_seconds


def test_one_failing_test_names_the_assertion():
    code = "def add(a, b):\n    return 5 if a == -1 else a + b\n"
    r = run_program(code, ADD_TESTS, FAST)
    assert r.status == "failed"
    assert (r.tests_passed, r.tests_total) == (2, 3)
    assert r.pass_fraction == pytest.approx(2 / 3)
    assert "test 2" in r.first_failure and "assert add(-1, 1) == 0" in r.first_failure
    assert "AssertionError" in r.first_failure


def test_assertion_message_and_check_style_test():
    check = "def check(candidate):\n    assert candidate(2, 2) == 4\n    assert candidate(2, 3) == 6, 'two times three'\n"
    r = run_program("def add(a, b):\n    return a + b\n", [check + "check(add)"], FAST)
    assert r.status == "failed" and r.tests_passed == 0
    assert "line 3: assert candidate(2, 3) == 6, 'two times three'" in r.first_failure
    assert "AssertionError: two times three" in r.first_failure


def test_syntax_error_is_error():
    r = run_program("def add(a, b)\n    return a + b\n", ADD_TESTS, FAST)
    assert r.status == "error"
    assert r.tests_passed == 0 and r.tests_total == 3
    assert "SyntaxError" in r.first_failure


def test_exception_inside_a_test_is_error_and_later_tests_still_run():
    code = "def inv(x):\n    return 1 / x\n"
    r = run_program(code, ["assert inv(0) == 0", "assert inv(2) == 0.5"], FAST)
    assert r.status == "error"
    assert r.tests_passed == 1
    assert "ZeroDivisionError" in r.first_failure and "test 1" in r.first_failure


def test_setup_runs_before_program_and_output_is_captured():
    r = run_program("print('hello'); import sys; print('oops', file=sys.stderr)", ["assert math.sqrt(4) == 2"], FAST, setup="import math")
    assert r.status == "ok" and r.tests_passed == 1
    assert r.stdout == "hello\n" and r.stderr == "oops\n"
    assert not r.output_truncated


def test_invalid_arguments_raise_value_error_naming_them():
    with pytest.raises(ValueError, match="wall_seconds"):
        SandboxLimits(wall_seconds=0)
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=1.5)
    with pytest.raises(ValueError, match="tests"):
        run_program(ADD, "assert add(1, 2) == 3")
    with pytest.raises(ValueError, match="network"):
        run_program(ADD, network="internet")


# ---------------------------------------------------------------------------------------
# hostile programs
# ---------------------------------------------------------------------------------------


def test_infinite_loop_times_out_and_is_killed():
    # It sleeps, so only the wall-clock timer can stop it (RLIMIT_CPU never fires).
    r = run_program("import time\ndef add(a, b):\n    while True:\n        time.sleep(0.05)\n", ADD_TESTS, FAST)
    assert r.status == "timeout"
    assert r.tests_passed == 0
    assert "test 1 did not finish" in r.first_failure and "wall-clock" in r.first_failure
    assert r.duration_s < FAST.wall_seconds + 1.0
    assert_healthy(r)


def test_cpu_limit_stops_a_busy_program_before_the_wall_clock():
    limits = SandboxLimits(wall_seconds=8.0, cpu_seconds=1.0, memory_mb=256)
    r = run_program("while True:\n    pass\n", [], limits)
    assert r.status == "timeout"
    assert "CPU-time" in r.first_failure
    assert r.duration_s < 4.0


def test_fork_bomb_is_contained_by_the_process_limit():
    start = time.monotonic()
    r = run_program("import os\nwhile True:\n    os.fork()\n", ["assert True"], FAST)
    assert r.status in ("error", "crash", "killed")  # fork fails with BlockingIOError
    assert r.tests_passed == 0
    assert time.monotonic() - start < FAST.wall_seconds
    assert_healthy(r)


def test_persistent_fork_bomb_is_killed_with_all_its_processes():
    code = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n"
    r = run_program(code, [], FAST)
    assert r.status == "timeout"
    assert r.duration_s < FAST.wall_seconds + 1.5
    assert_healthy(r)


def test_daemonised_child_does_not_survive_the_run():
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n    os._exit(0)\n"
    r = run_program(code, [], FAST)
    assert r.status == "ok"
    assert r.duration_s < FAST.wall_seconds  # nobody waited for the sleeper
    if r.sandbox_uid is None:
        pytest.skip("not root: leftovers are only found by session, which setsid escapes")
    assert live_tasks_of(r.sandbox_uid) == []


@pytest.mark.skipif(not IS_ROOT, reason="needs root: leftovers are found by the per-run uid")
def test_pid_hopping_processes_do_not_outlive_the_run():
    # A chain that forks and exits in a loop can slip between reads of /proc; the sweep must
    # be atomic (kill(-1) as the run's uid). Repeated, because the escape is a race.
    hopper = (
        "import os\nif os.fork() == 0:\n    os.setsid()\n    while True:\n        try:\n"
        "            if os.fork() != 0:\n                os._exit(0)\n        except OSError:\n            pass\n"
    )
    for code in [hopper] * 20 + [hopper + "import time\ntime.sleep(30)\n"]:
        r = run_program(code, [], SandboxLimits(wall_seconds=1.0, cpu_seconds=1.0, memory_mb=256))
        assert r.status in ("ok", "timeout")
        time.sleep(0.02)
        assert live_tasks_of(r.sandbox_uid) == [], r
    assert_healthy(r)


@pytest.mark.parametrize(
    "code",
    [
        "x = []\nwhile True:\n    x.append(bytearray(10_000_000))\n",
        "x = 'a' * (10 ** 10)\n",
    ],
    ids=["growing", "one-huge"],
)
def test_memory_bomb_reports_memory(code):
    r = run_program(code, ["assert True"], FAST)
    assert r.status == "memory"
    assert "MemoryError" in r.first_failure
    assert r.tests_passed == 0
    assert_healthy(r)


def test_memory_bomb_inside_a_test_reports_memory():
    code = "def grow():\n    x = []\n    while True:\n        x.append(bytearray(10_000_000))\n"
    r = run_program(code, ["grow()", "assert 1 + 1 == 2"], FAST)
    assert r.status == "memory"
    assert r.tests_passed == 1  # the harness recovered and ran the next test


def test_output_flood_is_capped_and_stopped():
    r = run_program("while True:\n    print('x' * 10_000)\n", [], FAST)
    assert r.status == "killed"
    assert "output limit" in r.first_failure
    assert r.output_truncated
    assert len(r.stdout) <= FAST.max_output_bytes
    assert r.duration_s < FAST.wall_seconds
    assert_healthy(r)


def test_large_output_is_truncated_but_tests_still_count():
    r = run_program("print('y' * 200_000)\n" + ADD, ADD_TESTS, FAST)
    assert r.status == "ok" and r.tests_passed == 3
    assert r.output_truncated
    assert len(r.stdout) == FAST.max_output_bytes


@pytest.mark.skipif(not IS_ROOT, reason="needs root: without a user switch the program acts as the caller's user")
def test_writing_outside_its_directory_is_denied(canary_dir, tmp_path):
    canary = canary_dir / "canary.txt"
    host_tmp_canary = tmp_path / "canary.txt"
    host_tmp_canary.write_text("untouched")
    probe = REPO / "sandbox_write_probe.txt"
    code = f"""
results = []
for path in [{str(canary)!r}, {str(canary_dir / 'new.txt')!r}, {str(probe)!r}, {str(host_tmp_canary)!r}]:
    try:
        with open(path, "w") as fh:
            fh.write("pwned")
        results.append("WROTE " + path)
    except OSError as exc:
        results.append(type(exc).__name__)
print(results)
with open("mine.txt", "w") as fh:  # its own directory stays writable
    fh.write("fine")
print(open("mine.txt").read())
"""
    try:
        r = run_program(code, [], FAST)
        assert r.status == "ok", r
        assert "WROTE" not in r.stdout
        assert "fine" in r.stdout
        assert canary.read_text() == "untouched"
        assert host_tmp_canary.read_text() == "untouched"
        assert not (canary_dir / "new.txt").exists()
        assert not probe.exists()
        # each attempt failed: the host's directories are absent from the run's file system
        # (FileNotFoundError; PermissionError or read-only where a path is visible)
        errors = ast.literal_eval(r.stdout.splitlines()[0])
        assert len(errors) == 4 and all(e in ("PermissionError", "FileNotFoundError", "OSError") for e in errors), errors
    finally:
        probe.unlink(missing_ok=True)
    assert_healthy(r)


@pytest.mark.skipif(not IS_ROOT, reason="needs root: without a user switch the program acts as the caller's user")
def test_deleting_files_outside_its_directory_is_denied(canary_dir, tmp_path):
    canary = canary_dir / "canary.txt"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    code = f"""
import os, shutil
for action in (lambda: os.remove({str(canary)!r}), lambda: shutil.rmtree({str(canary_dir)!r}),
               lambda: os.remove({str(victim)!r}), lambda: os.rename({str(canary)!r}, "stolen.txt")):
    try:
        action()
        print("DELETED")
    except OSError as exc:
        print(type(exc).__name__)
"""
    r = run_program(code, [], FAST)
    assert r.status == "ok", r
    assert "DELETED" not in r.stdout
    assert canary.read_text() == "untouched"
    assert victim.read_text() == "keep me"
    assert_healthy(r)


def test_environment_secrets_do_not_reach_the_program(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-SECRET-4242")
    monkeypatch.setenv("HF_TOKEN", "hf_SECRET_4242")
    # Without root the program is the caller's user and could read /proc/<caller>/environ.
    paths = ["/proc/self/environ"] + ([f"/proc/{os.getpid()}/environ", "/proc/1/environ"] if IS_ROOT else [])
    code = f"""
import os
print(sorted(os.environ))
print(os.environ.get("OPENAI_API_KEY"), os.environ.get("HF_TOKEN"))
for path in {paths!r}:
    try:
        print(open(path, "rb").read())
    except OSError as exc:
        print(path, type(exc).__name__)
"""
    r = run_program(code, [], FAST)
    assert r.status == "ok", r
    everything = r.stdout + r.stderr
    assert "SECRET" not in everything and "4242" not in everything
    assert "None None" in r.stdout
    assert "'OPENAI_API_KEY'" not in r.stdout and "'HF_TOKEN'" not in r.stdout
    if IS_ROOT:
        assert "environ PermissionError" in r.stdout  # the caller's /proc/<pid>/environ is closed


@pytest.mark.parametrize("network", ["auto", "seccomp", "audit-hook"])
def test_socket_to_localhost_cannot_connect(network):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    code = f"""
import socket
for attempt in range(3):
    try:
        s = socket.create_connection(("127.0.0.1", {port}), timeout=1)
        s.sendall(b"exfiltrated")
        print("CONNECTED")
    except Exception as exc:
        print(type(exc).__name__, exc)
"""
    try:
        if network == "audit-hook":  # the weaker mode says at every call what it does not contain
            with pytest.warns(RuntimeWarning, match="not contained"):
                r = run_program(code, [], FAST, network=network)
        else:
            r = run_program(code, [], FAST, network=network)
        if r.status == "crash" and "could not set up isolation" in (r.first_failure or ""):
            pytest.skip(f"network={network} is not available on this kernel: {r.first_failure}")
        expected = ("netns", "seccomp", "audit-hook") if network == "auto" else (network,)
        assert r.network_isolation in expected
        assert "CONNECTED" not in r.stdout
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing ever reached the listener
    finally:
        listener.close()
    assert_healthy(r)


@pytest.mark.skipif(not IS_ROOT, reason="needs root: without a user switch the program could really kill its parent")
def test_killing_the_parent_process_fails():
    me = os.getpid()
    code = f"""
import os, signal
for target in (os.getppid(), {me}, 1):
    try:
        os.kill(target, signal.SIGKILL)
        print("KILLED", target)
    except OSError as exc:
        print(type(exc).__name__)
try:
    os.killpg(os.getpgid({me}), signal.SIGKILL)
    print("KILLED group")
except OSError as exc:
    print(type(exc).__name__)
"""
    r = run_program(code, [], FAST)
    assert r.status == "ok", r
    assert "KILLED" not in r.stdout
    # refused, or the target does not exist in the run's own pid namespace
    assert r.stdout.count("PermissionError") + r.stdout.count("ProcessLookupError") == 4
    assert_healthy(r)


@pytest.mark.parametrize(
    "code",
    [
        "import sys\nsys.exit(0)\n",
        "import os\nos._exit(0)\n",
        "raise SystemExit(0)\n",
        "import os\ndef add(a, b):\n    os._exit(0)\n",
        "import sys\ndef add(a, b):\n    sys.exit(0)\n",
        "import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGTERM)\n",
        "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    raise KeyboardInterrupt\n",
    ],
    ids=["sys.exit-body", "os._exit-body", "SystemExit-body", "os._exit-in-test", "sys.exit-in-test", "self-SIGTERM", "atexit"],
)
def test_exit_tricks_never_count_as_passes(code):
    r = run_program(code, ADD_TESTS, FAST)
    assert r.status != "ok"
    assert r.tests_passed == 0
    assert r.pass_fraction == 0.0


@pytest.mark.parametrize(
    "trick",
    [
        # fake result markers on stdout and on every descriptor the program can find
        "import os\nprint('3/3 tests passed\\nPASS PASS PASS')\n"
        "for fd in range(3, 64):\n    try:\n        os.write(fd, b'pass\\tdone\\n')\n    except OSError:\n        pass\n",
        # redefine the checker that check-style tests call
        "def check(candidate):\n    return True\n",
        # patch builtins the harness or the tests might use
        "import builtins\nbuiltins.AssertionError = type('Fake', (Exception,), {})\nbuiltins.print = lambda *a, **k: None\n"
        "builtins.abs = lambda x: 0\nbuiltins.isinstance = lambda *a: True\nbuiltins.__import__ = None\n",
        # replace the tests' builtins through the shared module namespace
        "__builtins__ = {'abs': lambda x: 0, '__import__': __import__}\n",
        # a tracer that jumps over the failing assert to the harmless last line of check()
        "import sys\n"
        "def tracer(frame, event, arg):\n"
        "    if frame.f_code.co_name != 'check':\n"
        "        return None\n"
        "    def local(frame, event, arg):\n"
        "        if event == 'line' and frame.f_lineno == frame.f_code.co_firstlineno + 1:\n"
        "            frame.f_lineno = frame.f_code.co_firstlineno + 2\n"
        "        return local\n"
        "    return local\n"
        "sys.settrace(tracer)\n",
        # monkeypatch a stdlib function the tests use
        "import math\nmath.isclose = lambda *a, **k: True\n",
        # replace sys.modules' entry for a module the tests import
        "import sys, types\nfake = types.ModuleType('math')\nfake.isclose = lambda *a, **k: True\nsys.modules['math'] = fake\n",
        # find the harness's reporting function through gc and forge its records
        "import gc, os\n"
        "for obj in gc.get_objects():\n"
        "    if type(obj).__name__ == 'function' and obj.__name__ == 'emit':\n"
        "        for i in range(3):\n"
        "            obj('test', i, 'pass')\n"
        "        obj('done')\n"
        "        os._exit(0)\n",
        # or through ctypes (raw memory, raw syscalls)
        "import ctypes\n",
    ],
    ids=["fake-markers", "checker", "builtins", "__builtins__", "settrace", "math.isclose", "sys.modules", "gc", "ctypes"],
)
def test_tampering_with_the_harness_does_not_fake_passes(trick):
    tests = [
        "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert True, 'HumanEval checks often end like this'\ncheck(add)",
        "assert abs(add(1, 2) - 3) < 1e-9",
        "import math\nassert math.isclose(add(1, 2), 3)",
    ]
    honest = run_program(ADD, tests, FAST)
    assert (honest.status, honest.tests_passed) == ("ok", 3), honest  # the tests can pass
    r = run_program(trick + WRONG_ADD, tests, FAST)
    assert r.tests_passed == 0, r
    assert r.status in ("failed", "error")


def test_walking_the_stack_to_the_harness_does_not_fake_passes():
    exploit = (
        "import os, sys\n"
        "emit = sys._getframe(1).f_locals['emit']\n"
        "for i in range(3):\n"
        "    emit('test', i, 'pass')\n"
        "emit('done')\n"
        "os._exit(0)\n"
    )
    r = run_program(exploit + WRONG_ADD, ADD_TESTS, FAST)
    assert r.tests_passed == 0


def test_deep_recursion_is_reported_without_hanging():
    r = run_program("def f(n):\n    return f(n + 1)\n", ["f(0)"], FAST)
    assert r.status == "error"
    assert "RecursionError" in r.first_failure
    # Lifting the limit and recursing through C (map) overflows the C stack: a crash, reported.
    r2 = run_program("import sys\nsys.setrecursionlimit(10 ** 8)\ndef f(n):\n    return list(map(f, [n + 1]))\nf(0)\n", [], FAST)
    assert r2.status in ("crash", "error", "memory")
    assert r2.tests_passed == 0
    assert r2.duration_s < FAST.wall_seconds + 1.0
    assert_healthy(r2)


@pytest.mark.skipif(not IS_ROOT, reason="needs root: without a user switch the program acts as the caller's user")
def test_a_run_cannot_read_another_runs_directory():
    host_tmp = tempfile.gettempdir()
    writer = "import os, time\nopen('secret.txt', 'w').write('TOP-SECRET-' + 'VALUE')\nprint(os.getcwd())\ntime.sleep(1.5)\n"
    reader = f"""
import glob, os, time
time.sleep(0.5)
for d in sorted(set(glob.glob({host_tmp!r} + '/teamrl-sandbox-*') + glob.glob('/tmp/teamrl-sandbox-*'))):
    if os.path.realpath(d) == os.path.realpath(os.getcwd()):
        continue
    try:
        for name in os.listdir(d):
            print("FOUND", name, open(os.path.join(d, name)).read())
    except OSError as exc:
        print("DENIED", d, type(exc).__name__)
"""
    with SandboxPool(workers=2) as pool:
        first = pool.submit(writer, [], FAST)
        second = pool.submit(reader, [], FAST)
        a, b = first.result(), second.result()
    assert a.status == "ok" and b.status == "ok", (a, b)
    assert "TOP-SECRET" not in b.stdout and "FOUND" not in b.stdout
    assert a.stdout.strip() == "/tmp"  # its own private tmpfs: nothing of it is on the host



# ---------------------------------------------------------------------------------------
# the pool
# ---------------------------------------------------------------------------------------


def test_pool_matches_one_at_a_time_and_keeps_order():
    jobs = [
        SandboxJob(code=f"print({i})\ndef f(x):\n    return x * {i}\n", tests=(f"assert f(2) == {2 * i}", f"assert f(1) == {i % 3}"))
        for i in range(16)
    ]
    sequential = [run_program(job.code, job.tests, FAST) for job in jobs]
    with SandboxPool(limits=FAST) as pool:
        assert pool.workers == (os.cpu_count() or 1)
        parallel = pool.map(jobs)
    assert [r.stdout for r in parallel] == [f"{i}\n" for i in range(16)]
    summary = lambda rs: [(r.status, r.tests_passed, r.tests_total, r.first_failure, r.stdout) for r in rs]  # noqa: E731
    assert summary(parallel) == summary(sequential)
    assert sum(r.status == "ok" for r in parallel) == len([i for i in range(16) if i % 3 == i])


def test_pool_submit_returns_futures_and_works_from_asyncio():
    import asyncio

    with SandboxPool(workers=2, limits=FAST) as pool:
        fut = pool.submit(ADD, ADD_TESTS)
        assert fut.result().tests_passed == 3

        async def main():
            return await asyncio.gather(pool.run(ADD, ADD_TESTS[:1]), pool.run(WRONG_ADD, ADD_TESTS[:1]))

        ok, bad = asyncio.run(main())
    assert (ok.status, bad.status) == ("ok", "failed")
    with pytest.raises(ValueError, match="workers"):
        SandboxPool(workers=0)


def test_signals_to_the_sandbox_from_outside_are_reported_as_killed():
    # A run killed by someone else (the OOM killer, an operator) is "killed", not a pass.
    code = "import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(5)\n"
    box: dict = {}

    def run():
        # A test of a split shape: no judge's process runs beside the program's, so the one
        # harness process found below is the program's.
        box["r"] = run_program(code, ["assert abs(-1) == 1"], FAST)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 2
    pid = None
    while time.monotonic() < deadline and pid is None:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
                    parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                if b"def _harness():" in cmd and parent == os.getpid():
                    pid = int(entry)
        time.sleep(0.05)
    assert pid is not None, "could not find the sandbox process"
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    t.join(10)
    r = box["r"]
    assert r.status == "killed" and r.tests_passed == 0


# ---------------------------------------------------------------------------------------
# the caller's decoding of returned values counts against the run (issue: H2)
# ---------------------------------------------------------------------------------------

# 33,000 ints that all hash alike once plain (k * (2**61 - 1)); in the program an int subclass
# hashes them apart, so building the set there is cheap and rebuilding it here is quadratic.
COLLIDING = ("class I(int):\n    def __hash__(self):\n        return id(self)\n"
             "S = {I(k * (2**61 - 1)) for k in range(33_000)}\n"
             "def f():\n    return S\n")
# 800,000 characters to parse, each time. Read as JSON this takes about 1 s for all 16 on an idle machine (a wrong
# answer, 'failed'), and past the limit on a loaded one ('timeout'): either way within the limit, never passing. The
# deadline itself is tested on its own, machine-free (test_a_value_not_read_by_the_runs_deadline_does_not_pass).
BIG = "L = [None] * 100_000\ndef f():\n    return L\n"
WRONG_OR_LATE = {"failed": "AssertionError: returned [None, None", "timeout": "wall-clock limit"}


@pytest.mark.parametrize(
    "code, tests, outcomes",
    [
        (COLLIDING, ["assert f() == {1}"] * 3, {"failed": "hash alike"}),
        # judged whole: relayed
        (COLLIDING, ["for _ in range(3):\n    assert f() == {1}\n"], {"failed": "hash alike"}),
        (BIG, ["assert f() == [1]"] * 16, WRONG_OR_LATE),
    ],
    ids=["colliding-set-split", "colliding-set-relayed", "16-large-values"],
)
def test_decoding_what_the_program_returned_is_bounded_by_the_wall_clock_limit(code, tests, outcomes):
    """``outcomes``: each status the run may end with, and what its first failure then says."""
    limits = SandboxLimits(wall_seconds=5.0, cpu_seconds=5.0, memory_mb=512)
    start, cpu = time.monotonic(), time.process_time()
    r = run_program(code, tests, limits)
    wall, cpu = time.monotonic() - start, time.process_time() - cpu
    assert wall < limits.wall_seconds + 2.5, f"run_program took {wall:.1f}s at a {limits.wall_seconds:g}s limit ({cpu:.1f}s of the caller's CPU): {r}"
    assert r.status in outcomes and r.tests_passed == 0, r
    assert outcomes[r.status] in (r.first_failure or ""), r.first_failure


def test_a_value_not_read_by_the_runs_deadline_does_not_pass():
    from teamrl.sandbox.judge import split_test
    from teamrl.sandbox.records import Records
    from teamrl.sandbox.sandbox import _judge_calls

    def judged(deadline: float) -> Records:
        rec = Records(tests={}, values={0: {0: '["i", 3]'}}, value_chunks={0: 1}, done=True)
        _judge_calls(rec, [split_test("assert add(1, 2) == 3")], FAST, "auto", deadline)
        return rec

    in_time, late = judged(time.monotonic() + 60), judged(time.monotonic() - 1)
    assert (in_time.tests[0], in_time.late) == (["pass"], None)
    assert late.tests[0][0] == "timeout" and "wall-clock limit of 3s reached while reading" in late.late, late
