"""HumanEval+ input chunks judged outside the untrusted process (issue 12): the candidate's
outputs come back as plain values, the reference solution runs on the same inputs in a second
sandbox run, and the caller compares them with evalplus's rules (exact, else atol for floats).
Uses a small synthetic HumanEval+ file, so it needs no shared data."""

from __future__ import annotations

import gzip
import json

import pytest

from teamrl.sandbox import SandboxLimits, run_program
from teamrl.tasks.code_data import load_humanevalplus

FAST = SandboxLimits(wall_seconds=5.0, cpu_seconds=3.0, memory_mb=256, max_processes=16, max_output_bytes=20_000)

ROWS = [
    {  # no HumanEval `test`: base_input and plus_input are both judged against the reference
        "task_id": "Synthetic/0",
        "prompt": "def add(a, b):\n    \"\"\"a + b\"\"\"\n",
        "canonical_solution": "    return a + b\n",
        "entry_point": "add",
        "base_input": [[1, 2], [3, 4]],
        "plus_input": [[10, -3], [0, 0], [[1], [2]]],
        "atol": 0,
    },
    {  # float outputs: atol from the task
        "task_id": "Synthetic/1",
        "prompt": "def third(x):\n",
        "canonical_solution": "    return x / 3\n",
        "entry_point": "third",
        "base_input": [[1.0], [2.0]],
        "plus_input": [[7.5]],
        "atol": 1e-4,
    },
    {  # float outputs, atol 0: evalplus uses 1e-6; a tuple is not a list
        "task_id": "Synthetic/2",
        "prompt": "def pair(x):\n",
        "canonical_solution": "    return (x / 3, x / 7)\n",
        "entry_point": "pair",
        "base_input": [[1.0]],
        "plus_input": [[2.0]],
        "atol": 0,
    },
    {  # find_zero: any zero of the reference's poly passes, checked in the reference's run
        "task_id": "Synthetic/3",
        "prompt": "import math\n\ndef poly(xs, x):\n    return sum(c * math.pow(x, i) for i, c in enumerate(xs))\n\ndef find_zero(xs):\n",
        "canonical_solution": "    return -xs[0] / xs[1]\n",
        "entry_point": "find_zero",
        "base_input": [[[1.0, 2.0]], [[-3.0, 1.5]]],
        "plus_input": [[[4.0, -8.0]]],
        "atol": 1e-6,
    },
    {  # large outputs: an int over 4300 digits, a list sent as a digest, a set in any order
        "task_id": "Synthetic/4",
        "prompt": "def big(n):\n",
        "canonical_solution": "    return [2 ** n, list(range(n)), set(range(n))]\n",
        "entry_point": "big",
        "base_input": [[3]],
        "plus_input": [[20000], [5]],
        "atol": 0,
    },
]


@pytest.fixture(scope="module")
def problems(tmp_path_factory):
    path = tmp_path_factory.mktemp("heplus") / "Synthetic.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write("".join(json.dumps(row) + "\n" for row in ROWS))
    return {p.entry_point: p for p in load_humanevalplus(path, chunk_size=2)}


def test_reference_and_correct_solutions_pass(problems):
    for p in problems.values():
        r = run_program(p.canonical_solution, p.tests, FAST)
        assert (r.status, r.tests_passed, r.tests_total) == ("ok", len(p.tests), len(p.tests)), r
    r = run_program("def add(x, y):\n    result = x\n    result = result + y\n    return result\n", problems["add"].tests, FAST)
    assert (r.status, r.tests_passed) == ("ok", len(problems["add"].tests)), r


def test_a_wrong_solution_fails_naming_the_input(problems):
    p = problems["add"]
    r = run_program("def add(a, b):\n    return a - b\n", p.tests, FAST)
    assert r.status == "failed" and r.tests_passed < len(p.tests), r
    assert "input #" in r.first_failure and "expected" in r.first_failure, r.first_failure


def test_an_object_equal_to_everything_does_not_pass_humanevalplus(problems):
    code = (
        "class Anything:\n    def __eq__(self, other):\n        return True\n"
        "    def __ne__(self, other):\n        return False\n    __hash__ = None\n\n"
        "def add(a, b):\n    return Anything()\n"
    )
    r = run_program(code, problems["add"].tests, FAST)
    assert r.tests_passed == 0, r
    assert r.status == "failed", r


def test_calling_the_harness_reporting_function_does_not_pass_humanevalplus(problems):
    p = problems["add"]
    exploit = (
        "import os, sys\n"
        "frame = sys._getframe(0)\n"
        "while frame is not None and 'emit' not in frame.f_locals:\n"
        "    frame = frame.f_back\n"
        "emit = frame.f_locals['emit']\n"
        f"for i in range({len(p.tests)}):\n"
        "    emit('test', i, 'pass')\n"
        "emit('done')\n"
        "os._exit(0)\n"
        "def add(a, b):\n    return 0\n"
    )
    r = run_program(exploit, p.tests, FAST)
    assert r.tests_passed == 0, r


def test_the_reference_solution_never_enters_the_candidate_process(problems):
    # A program that reads its own harness's tests sees the inputs only: no reference
    # solution (and no expected value) that it could replay.
    spy = (
        "import sys\n"
        "frame = sys._getframe(0)\n"
        "while frame is not None and 'test_srcs' not in frame.f_locals:\n"
        "    frame = frame.f_back\n"
        "print(repr(frame.f_locals['test_srcs']))\n"
        "def third(x):\n    return 0.0\n"
    )
    r = run_program(spy, problems["third"].tests, FAST)
    assert "7.5" in r.stdout, r  # the spy did read the tests
    assert "x / 3" not in r.stdout and "2.5" not in r.stdout, r.stdout
    assert r.tests_passed == 0, r


def test_float_outputs_are_compared_with_atol(problems):
    third = problems["third"].tests
    close = run_program("def third(x):\n    return x / 3 + 5e-5\n", third, FAST)
    assert (close.status, close.tests_passed) == ("ok", len(third)), close
    far = run_program("def third(x):\n    return x / 3 + 1e-3\n", third, FAST)
    assert far.status == "failed" and far.tests_passed == 0, far
    pair = problems["pair"].tests
    within_default = run_program("def pair(x):\n    return (x / 3 + 1e-7, x / 7)\n", pair, FAST)
    assert (within_default.status, within_default.tests_passed) == ("ok", len(pair)), within_default
    beyond_default = run_program("def pair(x):\n    return (x / 3 + 1e-5, x / 7)\n", pair, FAST)
    assert beyond_default.tests_passed == 0, beyond_default
    as_list = run_program("def pair(x):\n    return [x / 3 + 1e-7, x / 7]\n", pair, FAST)
    assert as_list.tests_passed == 0, as_list  # evalplus: a list within atol of a tuple is not equal


def test_find_zero_is_checked_through_the_reference_poly(problems):
    tests = problems["find_zero"].tests
    nearly = run_program("def find_zero(xs):\n    return -xs[0] / xs[1] + 1e-9\n", tests, FAST)
    assert (nearly.status, nearly.tests_passed) == ("ok", len(tests)), nearly
    # The program's own poly (always 0) is not the one that judges it.
    cheat = run_program("def poly(xs, x):\n    return 0.0\n\ndef find_zero(xs):\n    return 0.0\n", tests, FAST)
    assert cheat.status == "failed" and cheat.tests_passed == 0, cheat
    assert "a zero of poly" in cheat.first_failure, cheat.first_failure


def test_large_outputs_are_compared_exactly(problems):
    tests = problems["big"].tests
    same = run_program("def big(n):\n    return [1 << n, [*range(n)], set(range(n - 1, -1, -1))]\n", tests, FAST)
    assert (same.status, same.tests_passed) == ("ok", len(tests)), same
    off_int = run_program("def big(n):\n    return [(1 << n) + (n > 100), [*range(n)], set(range(n))]\n", tests, FAST)
    assert off_int.status == "failed" and "plus input #0" in off_int.first_failure, off_int
    off_list = run_program("def big(n):\n    return [1 << n, [*range(n - 1)] + [n + (n > 100) - 1], set(range(n))]\n", tests, FAST)
    assert off_list.status == "failed" and "plus input #0" in off_list.first_failure, off_list
