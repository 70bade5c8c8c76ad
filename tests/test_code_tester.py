import pytest

from teamrl.tasks.code_tester import CoderTester, CoderTesterOptions, assertions, mutate

RIGHT = ("def has_close_elements(numbers, threshold):\n"
         "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for j, b in enumerate(numbers) if i != j)\n")
GOOD_TESTS = ("```python\nassert has_close_elements([1.0, 2.0], 1.5) == True\n"
              "assert has_close_elements([1.0, 3.0], 1.5) == False\n```")
INVALID_TESTS = "assert has_close_elements([1.0, 2.0], 1.5) == False\nassert has_close_elements([1.0, 3.0], 1.5) == True"


@pytest.fixture(scope="module")
def task():
    t = CoderTester(CoderTesterOptions(num_problems=1, workers=2))
    yield t
    t.pool.close()


def test_assertions_and_mutation():
    setup, tests = assertions("import math\nx = 1\nassert f(1) == 2\nassert math.pi > 3")
    assert setup == "import math" and tests == ["assert f(1) == 2", "assert math.pi > 3"]
    assert assertions("not python (") == ("", [])
    assert mutate("def f(a, b):\n    return a < b\n") == "def f(a, b):\n    return a >= b"
    assert mutate("def f():\n    return 1\n") is None


def test_rewards_for_coder_and_tester(task):
    p = task.problems()[0]
    wrong = task.wrong_program(p)
    assert not task.pool.submit(wrong, p.data["code"].tests).result().ok  # it really is wrong
    good = task.role_rewards(p, {"coder": RIGHT, "tester": GOOD_TESTS})
    assert good["coder"] == 1.0
    # both asserts valid; the wrong program fails at least one of them: validity 1, discrimination >= 0.5
    assert 0.75 <= good["tester"] <= 1.0
    bad = task.role_rewards(p, {"coder": "def has_close_elements(n, t):\n    return True\n", "tester": INVALID_TESTS})
    assert bad["tester"] == 0.0 and 0 < bad["coder"] < 1
    assert task.role_rewards(p, {"coder": "", "tester": "no asserts here"}) == {"coder": 0.0, "tester": 0.0}
    # the shared reward is the team term: the coder's hidden-test pass fraction
    joint = [{"coder": RIGHT, "tester": GOOD_TESTS}, {"coder": "x = (", "tester": ""}]
    assert task.rewards(p, joint) == [1.0, 0.0]
    assert task.passed(p, joint[0]) and not task.passed(p, joint[1])


def test_sources_without_reference_solutions_are_refused(tmp_path):
    import json

    f = tmp_path / "che.json"
    f.write_text(json.dumps([{"task_id": "C/0", "prompt": "def f():\n", "test": "def check(candidate):\n    assert candidate() == 1\n", "entry_point": "f"}]))
    from teamrl.core.config import ConfigError
    from teamrl.tasks import make_task

    with pytest.raises(ConfigError, match="task.source"):
        make_task({"name": "code.coder_tester", "source": "coophumaneval", "path": str(f)})
