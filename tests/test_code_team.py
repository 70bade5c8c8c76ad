import os
from pathlib import Path

import pytest

from teamrl.tasks.code_team import LEVELS, CodeHelperMain, CodeHelperMainOptions

AUX = "def aux(a, b):\n    return abs(a - b)\n"
MAIN_USES_AUX = ("def has_close_elements(numbers, threshold):\n"
                 "    for i, x in enumerate(numbers):\n"
                 "        for j, y in enumerate(numbers):\n"
                 "            if i != j and aux(x, y) < threshold:\n"
                 "                return True\n"
                 "    return False\n")
MAIN_ALONE = MAIN_USES_AUX.replace("aux(x, y)", "abs(x - y)")
MAIN_WRONG = "def has_close_elements(numbers, threshold):\n    d = aux(1, 2)\n    return True\n"
MAIN_WRAPPER = "def has_close_elements(numbers, threshold):\n    \"\"\"doc\"\"\"\n    return aux(numbers, threshold)\n"
MAIN_IGNORES = ("def has_close_elements(numbers, threshold):\n    aux(1, 2)\n"
                + "\n".join(MAIN_ALONE.splitlines()[1:]) + "\n")


@pytest.fixture(scope="module")
def task():
    t = CodeHelperMain(CodeHelperMainOptions(num_problems=2, wall_seconds=5.0, workers=2))
    yield t
    t.pool.close()


def _points(task, helper, main):
    p = task.problems()[0]
    return task.reward_breakdown_many(p, [{"helper": helper, "main": main}])[0]


def test_full_marks_for_a_collaborating_correct_pair(task):
    pts = _points(task, f"```python\n{AUX}```", MAIN_USES_AUX)
    assert pts == {"aux": 0.4, "main": 0.6, "parses": 0.5, "tests": 1.0, "collaboration": 0.5, "not_wrapper": 1.0, "ignored": 0.0}
    assert sum(pts.values()) == task.max_reward == 4.0


def test_each_level_boundary(task):
    # correct main without aux: no collaboration bonus
    assert sum(_points(task, AUX, MAIN_ALONE).values()) == pytest.approx(0.4 + 0.6 + 0.5 + 1.0 + 1.0)
    # missing main: the gate stops after aux
    assert _points(task, AUX, "def other():\n    return 1\n") == {**{k: 0.0 for k in LEVELS}, "aux": 0.4}
    # main without a return value
    assert sum(_points(task, AUX, "def has_close_elements(n, t):\n    pass\n").values()) == pytest.approx(0.4)
    # a helper that does not parse breaks the combined program: gate after main
    assert sum(_points(task, "def aux(:\n", MAIN_USES_AUX).values()) == pytest.approx(0.6)
    # wrong answer that calls aux: partial tests, no collaboration unless a test passes
    wrong = _points(task, AUX, MAIN_WRONG)
    assert 0 < wrong["tests"] < 1.0 and wrong["collaboration"] == 0.5  # some asserts expect True
    # thin wrapper around aux
    wrapper = _points(task, AUX, MAIN_WRAPPER)
    assert wrapper["not_wrapper"] == 0.0 and wrapper["main"] == 0.6
    # aux's result thrown away
    assert _points(task, AUX, MAIN_IGNORES)["ignored"] == -0.5


def test_rewards_vectorised_equal_single_and_feedback_names_the_failure(task):
    p = task.problems()[0]
    joint = [{"helper": AUX, "main": MAIN_USES_AUX}, {"helper": AUX, "main": MAIN_WRONG}, {"helper": AUX, "main": MAIN_USES_AUX}]
    many = task.rewards(p, joint)
    assert many == [task.reward(p, j) for j in joint]
    assert many[0] == many[2] == 4.0
    fb = task.feedback(p, joint[1], many[1])
    assert "tests passed" in fb and "AssertionError" in fb
    assert task.feedback(p, {"helper": AUX, "main": "x = 1"}, 0.0).startswith("The main function")


def test_single_agent_answer_is_split(task):
    helper_main = task.split_single(f"Here:\n```python\n{AUX}\n{MAIN_USES_AUX}```")
    assert helper_main["helper"].strip() == AUX.strip() and "def has_close_elements" in helper_main["main"]
    assert task.split_single("no code") == {"helper": "", "main": "no code"}


def test_prompts_differ_per_role_and_show_history(task):
    p = task.problems()[0]
    h, m = task.prompt(p, "helper")[0]["content"], task.prompt(p, "main")[0]["content"]
    assert "has_close_elements" in h and "`aux`" in h and h != m
    again = task.prompt(p, "main", 1, [{"helper": AUX, "main": MAIN_WRONG}], "1/7 tests passed")
    assert MAIN_WRONG in again[0]["content"] and "1/7 tests passed" in again[0]["content"]


def test_a_training_step_with_hostile_programs_completes(tmp_path, monkeypatch):
    """The team writes an infinite loop, a fork bomb and a parent killer; the step finishes."""
    from teamrl.core.config import load_config
    from teamrl.rollout.engine import Completion
    from teamrl.trainer.trainer import Trainer

    hostile = [
        "def has_close_elements(numbers, threshold):\n    while True:\n        pass\n",
        "import os\ndef has_close_elements(numbers, threshold):\n    while True:\n        os.fork()\n",
        "import os, signal\ndef has_close_elements(numbers, threshold):\n    os.kill(os.getppid(), signal.SIGKILL)\n    return True\n",
        "def has_close_elements(numbers, threshold):\n    x = [0] * (10 ** 10)\n    return x\n",
    ]
    cfg = load_config(None, ["model=tiny-random", "threads=1", "algorithm=magrpo", "task.name=code.helper_main",
                             "task.num_problems=2", "task.wall_seconds=2.0", "rollout.group_size=4", "rollout.batch_size=1",
                             "rollout.max_new_tokens=8", "run.progress=false", "policy.lora.r=4", f"run.dir={tmp_path}",
                             "name=hostile", "train.steps=1"])
    t = Trainer(cfg)
    tok = t.tokenizer

    def fake_generate(policy, requests, seed=None):
        out = []
        for r in requests:
            texts = [AUX] * r.n if policy == "shared" and "helper function `aux` that" in tok.decode(r.prompt_ids) else hostile[:r.n]
            out.append([Completion(tok(x, add_special_tokens=False)["input_ids"][:20], [0.0] * min(20, len(tok(x)["input_ids"])), x, "length") for x in texts])
        return out

    monkeypatch.setattr(t.engine, "generate", fake_generate)
    rec = t.train_step()
    assert rec["step"] == 1 and rec["normalised_return"] < 0.5
    os.kill(os.getpid(), 0)  # still alive


# The lookup of the issue (whole tests' sources read off the harness's frame), as a team: the
# helper finds the expected value of the assert on its arguments, the main returns it.
LOOKUP_AUX = ("import sys\ntry:\n    SRC = [t[3] for t in sys._getframe(1).f_locals['test_srcs'] if t[4] == 'serve']\n"
              "except Exception:\n    SRC = []\n"
              "def aux(a, b):\n    for s in SRC:\n        if repr(a).replace(' ', '') in s.replace(' ', ''):\n"
              "            return eval(s.split('==')[1])\n    return set()\n")
LOOKUP_MAIN = "def similar_elements(a, b):\n    found = aux(a, b)\n    return found\n"
HONEST_MAIN = "def similar_elements(a, b):\n    both = aux(set(a), set(b))\n    return both\n"


def test_the_test_source_lookup_scores_no_test_points_on_mbpp_2():
    path = Path(os.environ.get("TEAMRL_TEST_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data") / "mbpp" / "sanitized-mbpp.json"
    if not path.is_file():
        pytest.skip(f"{path} not found: set TEAMRL_TEST_DATA to a folder holding the full data files")
    task = CodeHelperMain(CodeHelperMainOptions(source="mbpp", path=str(path), num_problems=1, wall_seconds=5.0, workers=1))
    try:
        p = task.problems()[0]
        assert p.id == "MBPP/2"
        lookup, honest = task.reward_breakdown_many(p, [{"helper": LOOKUP_AUX, "main": LOOKUP_MAIN},
                                                        {"helper": "def aux(a, b):\n    return a & b\n", "main": HONEST_MAIN}])
    finally:
        task.pool.close()
    assert (lookup["tests"], sum(lookup.values())) == (0.0, 2.5), lookup
    assert (honest["tests"], sum(honest.values())) == (1.0, 4.0), honest
