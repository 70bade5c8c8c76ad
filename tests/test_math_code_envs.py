"""The AT-GRPO ``math`` and ``code`` environments. Tool and coder programs run through the real sandbox."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from teamrl.tasks import math_env as me
from teamrl.tasks.code_env import CodeEnv, CodeEnvOptions
from teamrl.tasks.math_env import MathEnv, MathOptions, answers_equal, extract_answer, generate_arithmetic, load_gsm8k, load_math

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def fenced(code: str) -> str:
    return f"Here is my program:\n```python\n{code}\n```"


# --- answers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("a, b", [
    ("1,000", "1000"), ("0.5", "1/2"), ("1/2", r"\frac{1}{2}"), ("0.5", r"\dfrac{1}{2}"), (r"\boxed{3}", "3"),
    ("$18", "18"), ("27.0", "27"), (27.0, "27"), (r"\frac{11}{2}", "5.5"), (r"\sqrt{2}/2", r"\frac{\sqrt2}{2}"),
    ("6 + 9i", "9i+6"), ("x^2+2x+1", "(x+1)^2"), ("-2,1", "1, -2"), ("(15,-29)", "(15, -29)"), ("76^\\circ", "76"),
    ("Yes", "yes"), (r"5\text{ cm}", "5"),
])
def test_equal_answers(a, b):
    assert answers_equal(a, b) and answers_equal(b, a)


@pytest.mark.parametrize("a, b", [
    ("2", "3"), ("garbage", "3"), ("abc", "abd"), ("", ""), (None, "1"), ("(15,-29)", "(-29,15)"), ("1,2", "1,2,3"),
    ("0.333", "1/3"), (r"\frac{1}{0}", "1"), ("{{{", "}}"), (r"\frac{", "1"),
    # model text is never eval'ed, and huge powers are not computed (each returns at once)
    ("__import__('os').system('true')", "0"), ("exec(chr(95)+chr(95))", "1"), ("9^9^9^9", "1"),
    ("((10^1000)^1000)^1000", "1"), ("not 1", "1"), ("1" * 500, "1"),
])
def test_unequal_or_garbage_answers_do_not_raise(a, b):
    assert answers_equal(a, b) is False


def test_extract_answer():
    assert extract_answer("16 - 3 - 4 = 9, times 2.\nAnswer: 18") == "18"
    assert extract_answer("**Answer:** 18.") == "18"
    assert extract_answer(r"so it is \boxed{\frac{1}{2}}, done") == r"\frac{1}{2}"
    assert extract_answer("The answer is 7") == "7"
    assert extract_answer("Answers vary, no final line") is None
    assert extract_answer("Answer: 1\nwait, no.\nAnswer: 2") == "2"


@pytest.mark.parametrize("text", [
    "The final answer is: 42", "answer is: $42", "answer is:42", "The answer is: \\boxed{42}", "answer is 42.",
    "So the **answer is**: 42", "The answer is = 42",
])
def test_answer_is_with_a_colon_reads_and_grades_right(text):
    # a colon after "is" was kept in the answer (": 42"), so a right reply scored 0
    from teamrl.tasks.solve import MathSolve, MathSolveOptions
    from teamrl.tasks.task import Problem

    assert extract_answer(text).lstrip("$") == "42"
    task = MathSolve(MathSolveOptions(num_problems=8, test_size=2, last_number=False))
    assert task.reward(Problem("p", {"question": "6 * 7", "answer": "42"}), text) == 1.0


# What math-verify decides that the old hand-written grader (removed in issue 35) got wrong or
# could not read; the old verdict is in each comment.
@pytest.mark.parametrize("answer, truth, right", [
    (r"\$18", "18", True),  # old: unequal (`\$` was not stripped)
    (r"\frac{14}{3}\text{ cm}", r"\frac{14}{3}", True),  # old: unequal (unit after a fraction)
    (r"\{2, 1\}", r"\{1,2\}", True),  # old: unequal (braces are a set)
    ("[2,5]", "[2,5)", False), ("(1, 2)", "(2, 1)", False),  # intervals and tuples in order (old: same)
    ("x = 3", "3", True), ("5", "x=5", True), ("0.333333", r"\frac13", True), ("0.33", r"\frac13", False),
    ("18 dollars", "18", True), ("50\\%", "50", True), ("E", r"\text{(E)}", True), ("evelyn", r"\text{Evelyn}", True),
])
def test_grade_answer_with_math_verify(answer, truth, right):
    assert me.grade_answer(answer, truth) is right


def _grade_off_main_thread(pairs):
    out: list = []
    t = threading.Thread(target=lambda: out.extend(me.grade_answer(a, b) for a, b in pairs), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "grading hung off the main thread"
    return out


def test_grading_off_the_main_thread_matches_the_main_thread():
    # math-verify's signal.alarm timeouts raise outside the main thread; a swallowed error there
    # would read as "wrong", so the right answers must come out right from a thread too
    pairs = [("0.5", r"\dfrac{1}{2}"), ("x^2+2x+1", "(x+1)^2"), (r"\sqrt{2}/2", r"\frac{\sqrt2}{2}"), ("3", "4"),
             ("(15,-29)", "(-29,15)")]
    on_main = [me.grade_answer(a, b) for a, b in pairs]
    assert on_main == [True, True, True, False, False]
    assert _grade_off_main_thread(pairs) == on_main
    with ThreadPoolExecutor(2) as pool:  # as the sandbox pool and the OpenAI-API episodes run
        assert list(pool.map(lambda ab: me.grade_answer(*ab), pairs)) == on_main


@pytest.mark.parametrize("answer", [
    "10^{10^{10}}", "9^{9^{9}}", "(10^{10})!", "10000000000!", r"\binom{10^{6}}{500000}", r"\gcd(10^{10^{10}}, 2)",
    r"\prod_{i=1}^{10^{9}} i", r"\sum_{i=1}^{10^{9}} i", "2^{2^{2^{2^{2}}}}", r"\sqrt{10^{10^{10}}} - 1",
])
def test_answers_that_would_not_finish_are_refused_quickly_on_every_thread(answer):
    # without the guards each of these runs for minutes (math-verify's own timeout is off in threads)
    start = time.perf_counter()
    assert me.grade_answer(answer, "1") is False and me.answers_equal(answer, "7") is False
    assert _grade_off_main_thread([(answer, "2"), ("1", answer)]) == [False, False]
    assert time.perf_counter() - start < 10
    assert me.grade_answer(answer, answer) is True  # the same text is still the same answer


# A few records of MATH-500 (MIT; HuggingFaceH4/MATH-500, from hendrycks/math) and GSM8K (MIT;
# openai/grade-school-math) for the comparison script; the full files are never in the repository.
MATH500_SAMPLE = [
    {"problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.  Enter your answer in the "
                "form $(r,\\theta),$ where $r > 0$ and $0 \\le \\theta < 2 \\pi.$",
     "answer": "\\left( 3, \\frac{\\pi}{2} \\right)"},
    {"problem": "If $f(x) = \\frac{3x-2}{x-2}$, what is the value of $f(-2) +f(-1)+f(0)$? Express your answer as a "
                "common fraction.", "answer": "\\frac{14}{3}"},
    {"problem": "How many positive whole-number divisors does 196 have?", "answer": "9"},
    {"problem": "Given\n\\[\\mathbf{A} = \\begin{pmatrix} 3 & 7 \\\\ -1 & -2 \\end{pmatrix},\\]compute "
                "$\\mathbf{A}^{27} + \\mathbf{A}^{31} + \\mathbf{A}^{40}.$",
     "answer": "\\begin{pmatrix} -1 & 0 \\\\ 0 & -1 \\end{pmatrix}"},
]
GSM8K_SAMPLE = [
    {"question": "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total does it take?",
     "answer": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total amount of fabric is 2+1=<<2+1=3>>3 bolts of fabric\n#### 3"},
    {"question": "James decides to run 3 sprints 3 times a week.  He runs 60 meters each sprint.  How many total meters "
                 "does he run a week?", "answer": "He sprints 3*3=<<3*3=9>>9 times\nSo he runs 9*60=<<9*60=540>>540 meters\n#### 540"},
]


def test_grader_comparison_script(tmp_path, monkeypatch):
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "bench" / "math_grader_compare.py"
    spec = importlib.util.spec_from_file_location("math_grader_compare", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclass looks its module up there
    spec.loader.exec_module(bench)
    try:
        bench.load_old_grader(bench.OLD_REF)
    except SystemExit as e:
        pytest.skip(f"the old grader is not in this clone's git history: {e}")
    files = {}
    for name, rows in (("math500", MATH500_SAMPLE), ("gsm8k", GSM8K_SAMPLE)):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "table.md"
    assert bench.main(["--math500", str(files["math500"]), "--gsm8k", str(files["gsm8k"]), "--out", str(out)]) == 0
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[4:11]]
            for line in out.read_text().splitlines() if line.startswith("| math500") or line.startswith("| gsm8k")}
    # pairs, old equal, new equal, old only, new only, old right, new right
    assert rows[("gsm8k", "currency sign")] == ["2", "0", "2", "0", "2", "0", "2"]  # \$540: the old grader missed it
    assert rows[("math500", "same text")] == ["4", "3", "4", "0", "1", "3", "4"]  # a matrix unequal to itself (old)
    assert rows[("math500", "pair in the other order")][2] == "0"  # (\frac{\pi}{2}, 3) is not the point (3, \frac{\pi}{2})
    assert bench.main(["--math500", str(tmp_path / "missing.jsonl"), "--gsm8k", str(files["gsm8k"])]) == 2


def test_loaders_keep_the_data_sets_answer_text(tmp_path):
    # math-verify reads the answer as written; the loaders only strip it and write 27.0 as 27
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps({"problem": "p", "answer": a}) for a in (r" \dfrac{1}{2} ", 27.0, "x=5")) + "\n")
    assert [p.data["answer"] for p in load_math(path)] == [r"\dfrac{1}{2}", "27", "x=5"]
    assert me.answer_text(None) == "" and me.answer_text(True) == "" and me.answer_text(2.5) == "2.5"


# --- data ------------------------------------------------------------------------------------------


def test_generator_is_seeded_and_right():
    a, b = generate_arithmetic(40, seed=3), generate_arithmetic(40, seed=3)
    assert [p.data for p in a] == [p.data for p in b]
    assert [p.data["question"] for p in a] != [p.data["question"] for p in generate_arithmetic(40, seed=4)]
    assert generate_arithmetic(5, seed=3)[4].data == a[4].data  # problem i does not depend on n
    for p in a:
        expr = p.data["expression"]
        # every number of the expression is in the question, and the answer is its value
        assert all(n in re.findall(r"\d+", p.data["question"]) for n in re.findall(r"\d+", expr)), p.data
        assert int(p.data["answer"]) == eval(expr, {"__builtins__": {}}) >= 0  # trusted: built from ints here
    assert len({p.data["question"].split()[1] for p in a}) > 3  # several templates are used


def test_loaders_on_shared_files():
    gsm, m500 = DATA / "gsm8k" / "test.jsonl", DATA / "math" / "math500.jsonl"
    if not gsm.is_file() or not m500.is_file():
        pytest.skip(f"GSM8K/MATH-500 not under {DATA}")
    g = load_gsm8k(gsm, limit=3)
    assert g[0].data["answer"] == "18" and "Janet" in g[0].data["question"]
    assert len(load_gsm8k(gsm)) == 1319
    m = load_math(m500)
    assert len(m) == 500 and all(p.data["answer"] and p.data["question"] for p in m)
    assert len({p.id for p in m}) == 500
    amc = DATA / "math" / "amc23.jsonl"
    if amc.is_file():
        assert all(not p.data["answer"].endswith(".0") for p in load_math(amc))  # 27.0 -> "27"
    env = MathEnv(MathOptions(source="math", path=str(m500), num_problems=4))
    assert len(env.problems()) == 4


def test_loader_errors(tmp_path):
    bad = tmp_path / "g.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ValueError, match="####"):
        load_gsm8k(bad)
    with pytest.raises(FileNotFoundError):
        load_math(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="task.path"):
        MathEnv(MathOptions(source="gsm8k"))
    with pytest.raises(ValueError, match="task.source"):
        MathEnv(MathOptions(source="nope"))


def test_reasoning_gym_is_optional():
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="reasoning-gym"):
            MathEnv(MathOptions(source="reasoning_gym:basic_arithmetic", num_problems=2))
    else:
        env = MathEnv(MathOptions(source="reasoning_gym:basic_arithmetic", num_problems=2))
        assert len(env.problems()) == 2


# --- the math environment --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def menv():
    return MathEnv(MathOptions(num_problems=4, wall_seconds=1.0))


def test_apply_never_mutates_and_agreement_ends_the_episode(menv):
    p = menv.problems()[0]
    truth = p.data["answer"]
    s0 = menv.reset(p)
    snap = dataclasses.replace(s0)
    s1, r = menv.apply(s0, "reasoner", f"I add things up.\nAnswer: {truth}")
    assert r == me.REASONER_CORRECT and s0 == snap and s1 is not s0 and not menv.done(s1)
    assert menv.team_reward(s1) == 0.0  # no agreement yet
    before = dataclasses.replace(s1)
    s2, r = menv.apply(s1, "tool", fenced(f"print({truth})"))
    assert r == me.TOOL_SOLVED and s1 == before  # the real sandbox ran it
    assert menv.done(s2) and s2.agreed is not None and menv.team_reward(s2) == 1.0 and menv.success(s2)
    assert s2.turn == 1 < menv.max_turns  # ended by agreement, not by running out of turns
    # a done state is not changed further
    s3, r = menv.apply(s2, "reasoner", "Answer: 0")
    assert r == 0.0 and s3 == s2


def test_wrong_agreement_and_disagreement(menv):
    p = menv.problems()[1]
    wrong = str(int(p.data["answer"]) + 1)
    s, r1 = menv.apply(menv.reset(p), "reasoner", f"Answer: {wrong}")
    s, r2 = menv.apply(s, "tool", fenced(f"print({wrong})"))
    assert (r1, r2) == (me.REASONER_WRONG, me.TOOL_RAN) and menv.done(s) and menv.team_reward(s) == 0.0
    # disagreement runs to max_turns; each side sees the other's previous answer from turn 2 on
    s = menv.reset(p)
    assert "previous answer" not in menv.observe(s, "tool")[0]["content"]
    s, _ = menv.apply(s, "reasoner", f"Reasoning here.\nAnswer: {p.data['answer']}")
    s, _ = menv.apply(s, "tool", fenced(f"print({wrong})"))
    assert not menv.done(s) and s.turn == 1
    assert f"previous answer: {p.data['answer']}" in menv.observe(s, "tool")[0]["content"]
    assert f"previous answer: {wrong}" in menv.observe(s, "reasoner")[0]["content"]
    s, _ = menv.apply(s, "reasoner", "Answer: 5000")
    s, _ = menv.apply(s, "tool", fenced("print(4000)"))
    assert menv.done(s) and s.agreed is None and menv.team_reward(s) == 0.0


def test_reasoner_can_agree_with_the_tools_previous_answer(menv):
    p = menv.problems()[2]
    truth = p.data["answer"]
    s, _ = menv.apply(menv.reset(p), "reasoner", "Answer: 123456")
    s, _ = menv.apply(s, "tool", fenced(f"print('Answer:', {truth})"))
    assert not menv.done(s)
    s, r = menv.apply(s, "reasoner", rf"The tool is right: \boxed{{{truth}}}")
    assert r == 1.0 and menv.done(s) and menv.team_reward(s) == 1.0


def test_failing_tool_programs_score_zero_without_raising(menv):
    s0 = menv.reset(menv.problems()[0])
    for text in (fenced("raise RuntimeError('boom')"), fenced("import os\nos._exit(3)"), fenced("x = 1"), "no code (",
                 fenced("while True:\n    pass")):
        s, r = menv.apply(s0, "tool", text)
        assert r == me.TOOL_FAILED and s.tool_answer is None and s.agreed is None
    assert "failed" in s.tool_output or "timeout" in s.tool_output


def test_final_reasoner_option_scores_a_lone_reasoner():
    env = MathEnv(MathOptions(num_problems=1, final="reasoner"))
    p = env.problems()[0]
    s, _ = env.apply(env.reset(p), "reasoner", f"Answer: {p.data['answer']}")
    assert env.team_reward(s) == 1.0 and s.agreed is None
    assert MathEnv(MathOptions(num_problems=1)).team_reward(s) == 0.0  # default: only agreement counts


def test_math_roles_and_observe(menv):
    s = menv.reset(menv.problems()[0])
    for role in menv.roles:
        msg = menv.observe(s, role)[0]["content"]
        assert s.question in msg
    assert "Answer:" in menv.observe(s, "reasoner")[0]["content"] and "python" in menv.observe(s, "tool")[0]["content"]
    with pytest.raises(ValueError, match="role"):
        menv.observe(s, "planner")


# --- the code environment --------------------------------------------------------------------------

RIGHT = ("def has_close_elements(numbers, threshold):\n"
         "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for j, b in enumerate(numbers) if i != j)\n")
GOOD_TESTS = ("```python\nassert has_close_elements([1.0, 2.0], 1.5) == True\n"
              "assert has_close_elements([1.0, 3.0], 1.5) == False\n```")
WRONG = "def has_close_elements(numbers, threshold):\n    return True\n"


@pytest.fixture(scope="module")
def cenv():
    try:
        env = CodeEnv(CodeEnvOptions(num_problems=1, workers=2, wall_seconds=2.0))
    except FileNotFoundError as e:
        pytest.skip(str(e))
    yield env
    env.close()


def test_correct_coder_and_good_tester_solve_it(cenv):
    p = cenv.problems()[0]
    s0 = cenv.reset(p)
    s1, r = cenv.apply(s0, "coder", fenced(RIGHT))
    assert r == 1.0 and cenv.team_reward(s1) == 1.0 and cenv.done(s1) and cenv.success(s1)
    assert s0.code == "" and not cenv.done(s0)  # unchanged
    # the good tester on the right code: valid asserts that a wrong program fails
    s, r = cenv.apply(dataclasses.replace(s1, passed=0.0), "tester", GOOD_TESTS)
    assert 0.75 <= r <= 1.0 and "2 of 2 passed" in s.test_report


def test_multi_turn_feedback(cenv):
    p = cenv.problems()[0]
    s, r = cenv.apply(cenv.reset(p), "coder", WRONG)
    assert 0 < r < 1 and not cenv.done(s)
    assert WRONG.strip() in cenv.observe(s, "tester")[0]["content"]
    before = dataclasses.replace(s)
    s2, r = cenv.apply(s, "tester", GOOD_TESTS)
    assert s == before and s2.turn == 1 and r > 0
    msg = cenv.observe(s2, "coder")[0]["content"]
    assert "assert has_close_elements([1.0, 3.0], 1.5) == False" in msg and "1 of 2 passed" in msg
    s3, r = cenv.apply(s2, "coder", RIGHT)
    assert r == 1.0 and cenv.done(s3) and cenv.team_reward(s3) == 1.0
    # out of turns without a pass
    s4, _ = cenv.apply(s2, "coder", WRONG)
    s4, _ = cenv.apply(s4, "tester", GOOD_TESTS)
    assert cenv.done(s4) and cenv.team_reward(s4) < 1.0


def test_hostile_coder_is_contained(cenv):
    p = cenv.problems()[0]
    hostile = [
        "raise SystemExit(0)",  # leave before the tests can fail
        "import os\nos._exit(0)",
        "while True:\n    pass",  # killed at the wall-clock limit
        "x = bytearray(1 << 40)",  # over the memory limit
        # patch the assertion machinery, then return garbage: the harness restores builtins
        "import builtins\nbuiltins.AssertionError = type('X', (Exception,), {})\n"
        "def has_close_elements(*a):\n    return None\n",
    ]
    s0 = cenv.reset(p)
    for code in hostile:
        s, r = cenv.apply(s0, "coder", fenced(code))
        assert r == 0.0 and cenv.team_reward(s) == 0.0 and not cenv.done(s)
    s, r = cenv.apply(s, "tester", GOOD_TESTS)  # its asserts run on the hostile code, contained too
    assert "0 of 2 passed" in s.test_report


def test_reasoning_gym_source_loads_seeded_problems_and_scores_them():
    from teamrl.tasks import make_task

    env = make_task({"name": "math", "source": "reasoning_gym:basic_arithmetic", "num_problems": 3, "seed": 0})
    again = make_task({"name": "math", "source": "reasoning_gym:basic_arithmetic", "num_problems": 3, "seed": 0})
    probs = env.problems()
    assert len(probs) == 3 and [p.data["question"] for p in probs] == [p.data["question"] for p in again.problems()]
    state = env.reset(probs[1])
    _, right = env.apply(state, "reasoner", f"Working... Answer: {probs[1].data['answer']}")
    _, wrong = env.apply(state, "reasoner", "Answer: 123456789")
    assert right == 1.0 and wrong == 0.0
