"""Tests the judge cannot split into calls (loops, helpers, random inputs) are judged whole in a
second sandbox process that never holds the program (issue 34, item 1): the program's calls come
back as plain data, so an object with a forged ``__eq__`` gets no pass, and a test that needs
more of the program than calls is reported as unjudgeable, never passed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from teamrl.sandbox import SandboxJob, SandboxLimits, SandboxPool, run_program
from teamrl.sandbox.judge import program_names, split_test
from teamrl.tasks.code_data import against_reference, load_humaneval, load_mbpp

REPO = Path(__file__).resolve().parents[1]
LIMITS = SandboxLimits(wall_seconds=15.0, cpu_seconds=10.0, memory_mb=256)
FAST = SandboxLimits(wall_seconds=5.0, cpu_seconds=3.0, memory_mb=256)
ADD = "def add(a, b):\n    return a + b\n"
LOOP = "def check(candidate):\n    for a, b in [(1, 2), (2, 3), (-1, 1)]:\n        assert candidate(a, b) == a + b\ncheck(add)\n"

# The HumanEval problems whose every test is loop- or helper-shaped (nothing split before).
LOOP_ONLY = ("HumanEval/32", "HumanEval/33", "HumanEval/37", "HumanEval/38", "HumanEval/44", "HumanEval/50",
             "HumanEval/53", "HumanEval/129", "HumanEval/151")

# A wrong solution returning an object whose __eq__ is always True, in several shapes.
FORGERIES = {
    "int": ("class T(int):\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n", "T(0)"),
    "float": ("class T(float):\n    __eq__ = lambda s, o: True\n    __lt__ = lambda s, o: True\n", "T(0.0)"),
    "str": ("class T(str):\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n", "T('')"),
    "list": ("class T(list):\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n", "T()"),
    # a plain list of always-equal elements, as long as the input (tuple(x) == tuple(y) compares them)
    "elements": ("class T(int):\n    __eq__ = lambda s, o: True\n", "[T(0) for _ in (a[0] if a else [0])]"),
}


def forged(prompt: str, entry_point: str, kind: str) -> str:
    cls, value = FORGERIES[kind]
    return f"{prompt}    return None\n\n{cls}\ndef {entry_point}(*a, **k):\n    return {value}\n"


@pytest.fixture(scope="module")
def humaneval():
    return {p.task_id: p for p in load_humaneval()}


def test_always_equal_objects_score_zero_on_the_loop_shaped_humaneval_tests(humaneval):
    jobs, labels = [], []
    for task_id in LOOP_ONLY:
        p = humaneval[task_id]
        for kind in FORGERIES:
            jobs.append(SandboxJob(forged(p.prompt, p.entry_point, kind), p.tests, LIMITS))
            labels.append(f"{task_id} {kind}")
    with SandboxPool(limits=LIMITS) as pool:
        results = pool.map(jobs)
    passed = {label: f"{r.tests_passed}/{r.tests_total} ({r.status})" for label, r in zip(labels, results) if r.tests_passed}
    assert passed == {}, f"forged passes: {passed}"
    assert all(r.status in ("failed", "error") for r in results), [(label, r.status) for label, r in zip(labels, results)]


def test_canonical_solutions_pass_every_humaneval_problem_with_a_test_judged_whole(humaneval):
    problems = [p for p in humaneval.values() if any(split_test(t) is None for t in p.tests)]
    assert len(problems) == 17 and set(LOOP_ONLY) <= {p.task_id for p in problems}
    with SandboxPool(limits=LIMITS) as pool:
        results = pool.map([SandboxJob(p.canonical_solution, p.tests, LIMITS) for p in problems])
    bad = {p.task_id: (r.status, r.first_failure) for p, r in zip(problems, results) if not (r.ok and r.tests_passed == r.tests_total)}
    assert bad == {}


def test_humaneval_33_self_comparisons_check_against_the_reference(humaneval):
    # tuple(candidate(x)) == tuple(sort_third(x)) compares the program with itself: any answer passed.
    p = humaneval["HumanEval/33"]
    assert sum(t.startswith("_teamrl_reference_check(") for t in p.tests) == 3
    assert all(split_test(t) is not None for t in p.tests[:3])
    wrong = run_program("def sort_third(l):\n    return l[::-1]\n", p.tests[:3], LIMITS)
    assert (wrong.tests_passed, wrong.status) == (0, "failed"), wrong
    other = "METADATA = {}\ndef check(candidate):\n    assert candidate([1]) == [1]\ncheck(sort_third)\n"
    assert against_reference(other, "sort_third", p.canonical_solution) == other


def test_helpers_a_test_calls_are_the_data_sets_not_the_programs(humaneval):
    # HumanEval/32, 38, 50 call poly / encode_cyclic / encode_shift, which the solution defines too.
    attacks = {
        "HumanEval/32": "def poly(xs, x):\n    return 0.0\ndef find_zero(xs):\n    return 0.0\n",
        "HumanEval/38": "def encode_cyclic(s):\n    return s\ndef decode_cyclic(s):\n    return s\n",
        "HumanEval/50": "def encode_shift(s):\n    return s\ndef decode_shift(s):\n    return s\n",
    }
    with SandboxPool(limits=LIMITS) as pool:
        results = pool.map([SandboxJob(code, humaneval[t].tests, LIMITS) for t, code in attacks.items()])
    assert [(r.tests_passed, r.status) for r in results] == [(0, "failed")] * 3, results
    assert all(humaneval[t].tests[0].startswith(("import math\ndef poly(", "def encode_")) for t in attacks)


def test_the_test_body_runs_outside_the_programs_process():
    # The program looks for the test's own frame on its stack: there in the old in-process run.
    code = ("import sys\ndef add(a, b):\n    f = sys._getframe(1)\n    while f is not None:\n"
            "        if f.f_code.co_name == 'check':\n            return 'beside the test'\n"
            "        f = f.f_back\n    return a + b\n")
    r = run_program(code, [LOOP], FAST)
    assert (r.status, r.tests_passed) == ("ok", 1), r


def test_wrong_answers_exceptions_and_crashes_inside_relayed_calls():
    cases = {
        "def add(a, b):\n    return 0\n": ("failed", "AssertionError"),
        "class A:\n    __eq__ = lambda s, o: True\ndef add(a, b):\n    return A()\n": ("failed", "not plain data"),
        "def add(a, b):\n    raise ValueError('no')\n": ("error", "ValueError: no"),
        "import sys\ndef add(a, b):\n    sys.exit(0)\n": ("error", "SystemExit"),
        "import os\ndef add(a, b):\n    os._exit(0)\n": ("crash", "did not finish"),  # not a wall-clock timeout
        "def plus(a, b):\n    return a + b\n": ("error", "name 'add' is not defined"),
    }
    with SandboxPool(limits=FAST) as pool:
        results = pool.map([SandboxJob(code, (LOOP,), FAST) for code in cases])
    for (code, (status, text)), r in zip(cases.items(), results):
        assert (r.status, r.tests_passed) == (status, 0), (code, r)
        assert text in (r.first_failure or ""), (code, r.first_failure)
    assert max(r.duration_s for r in results) < 4.0  # every one ended before the wall-clock limit


def test_what_a_whole_test_may_use_of_the_program():
    tests = [
        # an exception the test expects, raised by the program: re-raised in the judge as its built-in type
        "def check(candidate):\n    try:\n        candidate('a', 1)\n    except TypeError:\n        pass\n"
        "    else:\n        assert False\ncheck(add)\n",
        # an argument the program changes in place comes back changed
        "def check(candidate):\n    xs = [1]\n    for i in range(2):\n        candidate(xs, i)\n    assert xs == [1, 0, 1]\ncheck(grow)\n",
        # a standard module the test takes from the program's imports: the judge's own
        "for i in range(3):\n    assert math.isclose(add(i, 0.5), i + 0.5)\n",
        # split and whole tests share the program's state, in order
        "assert count() == 1",
        "def check(candidate):\n    for i in range(2):\n        assert candidate() == i + 2\ncheck(count)\n",
        "assert count() == 4",
    ]
    code = ADD + "import math\ndef grow(xs, x):\n    xs.append(x)\nn = [0]\ndef count():\n    n[0] += 1\n    return n[0]\n"
    r = run_program(code, tests, FAST)
    assert (r.status, r.tests_passed, r.tests_unjudgeable) == ("ok", 6, 0), r


@pytest.mark.parametrize(
    "test, why",
    [
        ("def check(candidate):\n    assert candidate.__name__ == 'add'\ncheck(add)\n", "add other than by calling it"),
        ("def check(candidate):\n    for i in range(2):\n        assert candidate(lambda x: x, i) == i\ncheck(add)\n",
         "an argument of type function"),
        ("def check(candidate):\n    assert candidate('y' * 3_000_000, 'z') == 0\ncheck(add)\n", "larger than the relay takes"),
    ],
    ids=["attribute", "function-argument", "oversized-argument"],
)
def test_a_test_needing_more_than_calls_is_reported_unjudgeable(test, why):
    code = "def add(a, b):\n    return a(b) if callable(a) else a + b\n"
    r = run_program(code, [test, "assert add(1, 2) == 3"], FAST)
    assert (r.status, r.tests_passed, r.tests_unjudgeable) == ("error", 1, 1), r
    assert "cannot be judged outside the program's process" in r.first_failure and why in r.first_failure, r.first_failure


def test_program_names_are_the_names_a_test_takes_from_the_program():
    test = ("import math\nMETADATA = {}\ndef check(candidate):\n    rng = range(3)\n    for x in rng:\n"
            "        assert math.fabs(poly([1, x], candidate([x]))) < 1e-4\n        print(str(x), helper)\ncheck(find_zero)\n")
    assert program_names(test) == ("find_zero", "helper", "poly")
    assert program_names(test, setup="def helper():\n    pass\n") == ("find_zero", "poly")
    assert program_names("def broken(:\n") == ()


# ---------------------------------------------------------------------------------------
# issue: a whole test's source (its expected values) must never reach the program's process
# ---------------------------------------------------------------------------------------

# Every string the program can reach: its stack (frames, their locals and globals, closures,
# code constants, modules, classes), gc.get_objects, /proc (cmdline, environ of every process),
# its open files, /tmp and /dev/shm, the environment. Yields (route, text).
FINDER = r'''
import os, sys, types
def _teamrl_strings():
    found, seen, keep = [], set(), []
    def walk(root, route, budget=400_000):
        stack = [root]
        while stack and budget > 0:
            o = stack.pop()
            if id(o) in seen:
                continue
            seen.add(id(o)); keep.append(o); budget -= 1
            t = type(o)
            try:
                if t is str:
                    found.append((route, o))
                elif t in (bytes, bytearray):
                    found.append((route, bytes(o).decode("latin-1")))
                elif t is dict:
                    stack.extend(o.keys()); stack.extend(o.values())
                elif t in (list, tuple, set, frozenset):
                    stack.extend(o)
                elif t is types.FrameType:
                    stack.extend((dict(o.f_locals), o.f_globals, o.f_back, o.f_code))
                elif t is types.FunctionType:
                    stack.extend((o.__closure__, o.__defaults__, o.__kwdefaults__, o.__globals__, o.__code__))
                elif t is types.CellType:
                    stack.append(o.cell_contents)
                elif t is types.CodeType:
                    stack.extend(o.co_consts)
                elif t is types.ModuleType:
                    stack.append(vars(o))
                elif t is types.MethodType:
                    stack.extend((o.__func__, o.__self__))
                elif isinstance(o, type):
                    stack.append(dict(vars(o)))
                elif hasattr(o, "__dict__"):
                    stack.append(object.__getattribute__(o, "__dict__"))
            except Exception:
                pass
    walk(sys._getframe(1), "frames")
    walk(dict(sys.modules), "modules")
    try:
        import gc
        walk(gc.get_objects(), "gc.get_objects")
    except Exception:
        pass
    def read(path, route):
        try:
            with open(path, "rb") as fh:
                found.append((route, fh.read(1 << 22).decode("latin-1")))
        except Exception:
            pass
    for pid in [p for p in os.listdir("/proc") if p.isdigit()] + ["self"]:
        for what in ("cmdline", "environ"):
            read(f"/proc/{pid}/{what}", f"/proc/{pid}/{what}")
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            found.append(("fd links", target))
            if target.startswith("/"):  # a file: read it whole (pipes carry the relay: not drained)
                found.append((f"fd {fd}", os.pread(int(fd), 1 << 22, 0).decode("latin-1")))
        except Exception:
            pass
    for place in ("/tmp", "/dev/shm"):
        for folder, _, files in os.walk(place):
            for name in files:
                read(os.path.join(folder, name), "files")
    found.extend(("environment", f"{k}={v}") for k, v in os.environ.items())
    return found
'''

# A probe: reports every route by which a needle that only the whole test's expected value
# holds reaches the program, at its import and inside a call. The needle is split in the
# program's own source, so the program itself holds no string with it whole.
PROBE = FINDER + r'''
def _teamrl_probe(where):
    hits = set()
    for route, text in _teamrl_strings():
        i = text.find("zq9")
        while i >= 0:
            if text.startswith("leak", i + 3):
                hits.add(route)
                break
            i = text.find("zq9", i + 1)
    print("SCANNED", where, "FOUND" if hits else "nothing", sorted(hits))
_teamrl_probe("import")
def pick(xs):
    _teamrl_probe("call")
    return ["x"]
'''
PROBE_TEST = "assert set(pick([1, 2])) == set(['zq9leak'])\n"


def test_a_program_finds_no_trace_of_a_whole_tests_expected_value():
    assert split_test(PROBE_TEST) is None  # judged whole
    r = run_program(PROBE, [PROBE_TEST], LIMITS)
    lines = [line for line in r.stdout.splitlines() if line.startswith("SCANNED")]
    assert [line.split()[1] for line in lines] == ["import", "call"], r
    assert all(line.split()[2] == "nothing" for line in lines), lines
    assert r.tests_passed == 0, r


def test_the_test_source_lookup_of_the_issue_gets_no_pass():
    test = "assert set(similar_elements((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))\n"
    lookup = ("import sys\nsrc = [t[3] for t in sys._getframe(1).f_locals['test_srcs'] if t[4] == 'serve'][0]\n"
              "def similar_elements(a, b):\n    return eval(src.split('==')[1])\n")
    honest = "def similar_elements(a, b):\n    return set(a) & set(b)\n"
    with SandboxPool(limits=FAST) as pool:
        attack, control = pool.map([SandboxJob(lookup, (test,), FAST), SandboxJob(honest, (test,), FAST)])
    assert (attack.tests_passed, control.tests_passed, control.status) == (0, 1, "ok"), (attack, control)


# The generic lookup: any reachable text with an assert on the entry point (or `candidate`)
# is parsed, and a call whose literal arguments match gets the other side's value.
LOOKUP = FINDER + r'''
import ast, math
_teamrl_asserts = []
def _teamrl_collect():
    for _, text in _teamrl_strings():
        if "assert" in text and ENTRY in text:
            try:
                _teamrl_asserts.append(ast.parse(text))
            except Exception:
                pass
_teamrl_collect()
def _teamrl_lookup(*args, **kwargs):
    if not _teamrl_asserts:
        _teamrl_collect()
    env = {"math": math, "sys": sys}
    for tree in _teamrl_asserts:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assert):
                pairs = [(node.test, None)]
                if isinstance(node.test, ast.Compare) and type(node.test.ops[0]) is ast.Eq:
                    pairs = [(node.test.left, node.test.comparators[0]), (node.test.comparators[0], node.test.left)]
                for side, other in pairs:
                    for call in ast.walk(side):
                        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in (ENTRY, "candidate")):
                            continue
                        try:
                            if [eval(ast.unparse(a), env) for a in call.args] != list(args):
                                continue
                            return True if other is None else eval(ast.unparse(other), env)
                        except Exception:
                            continue
    raise LookupError("no test source found")
'''


def lookup_program(entry_point: str) -> str:
    return LOOKUP.replace("ENTRY", repr(entry_point)) + f"{entry_point} = _teamrl_lookup\n"


def test_the_generic_lookup_passes_nothing_on_the_humaneval_and_mbpp_problems_with_whole_tests(humaneval):
    mbpp_path = Path(os.environ.get("TEAMRL_TEST_DATA") or REPO.parent / "shared" / "data") / "mbpp" / "sanitized-mbpp.json"
    mbpp = load_mbpp(mbpp_path) if mbpp_path.is_file() else []
    problems = [p for p in [*humaneval.values(), *mbpp] if any(split_test(t) is None for t in p.tests)]
    assert len(problems) == (24 if mbpp else 17)
    with SandboxPool(limits=LIMITS) as pool:
        results = pool.map([SandboxJob(lookup_program(p.entry_point), p.tests, LIMITS) for p in problems])
    passed = {p.task_id: f"{r.tests_passed}/{r.tests_total}" for p, r in zip(problems, results) if r.tests_passed}
    assert passed == {}, f"lookup passes: {passed}"
