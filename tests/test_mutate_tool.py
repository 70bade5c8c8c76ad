"""tools/mutate.py, the project's mutation run: mutants go to a sandbox copy only, stale snippets are
reported, outcomes and scores are counted right, and the mutant list names real files and tests."""

import re
from pathlib import Path

import pytest

from tools.mutate import (ROOT, ForkingRunner, FreshProcessRunner, Mutant, check_snippet, load_mutants, module_scores,
                          run_mutants, summarise)

CALC = "def add(a, b):\n    return a + b\n\n\ndef double(a):\n    return 2 * a\n"
TEST = "from mylib.calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "proj"
    (root / "mylib").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "mylib" / "calc.py").write_text(CALC)
    (root / "tests" / "test_calc.py").write_text(TEST)
    return root


def _mutants():
    f, t = "mylib/calc.py", ("tests/test_calc.py",)
    return [Mutant("minus", f, "return a + b", "return a - b", t, "subtracts"),
            Mutant("double", f, "return 2 * a", "return 3 * a", t, "no test calls double"),
            Mutant("swap", f, "return a + b", "return b + a", t, "commutes", equivalent="a + b == b + a for numbers"),
            Mutant("gone", f, "return a * b", "return a / b", t, "the code no longer has this line"),
            Mutant("twice", f, "return ", "yield ", t, "ambiguous snippet")]


@pytest.mark.parametrize("runner", [FreshProcessRunner(), ForkingRunner(preload=("pytest",))], ids=["fresh", "forking"])
def test_outcomes_scores_and_stale_snippets(project, runner):
    results = run_mutants(_mutants(), project, timeout=60, runner=runner)
    assert [r.outcome for r in results] == ["killed", "survived", "survived", "stale", "stale"]
    assert "not found" in results[3].detail and "occurs 2 times" in results[4].detail
    assert (project / "mylib" / "calc.py").read_text() == CALC  # the tree was never written
    assert module_scores(results) == {"mylib/calc.py": (1, 2)}  # the equivalent and stale ones are not scored
    text, ok = summarise(results, min_score=95.0)
    assert not ok
    assert "mutants: 5 (2 scored, 1 known equivalent, 2 stale, 0 error)" in text
    assert re.search(r"mylib/calc.py\s+1/2\s+50.0%", text)
    assert "double [mylib/calc.py]: no test calls double" in text
    assert "STALE (2)" in text and "gone" in text and "twice" in text
    assert "swap [mylib/calc.py]: commutes. Equivalent: a + b == b + a" in text


def test_a_selector_naming_no_test_is_an_error_not_a_kill(project):
    bad = Mutant("minus", "mylib/calc.py", "return a + b", "return a - b", ("tests/test_nothing.py",), "subtracts")
    (result,) = run_mutants([bad], project, timeout=60, runner=FreshProcessRunner())
    assert result.outcome == "error"
    assert not summarise([result], 95.0)[1]


class InterruptingRunner:
    """Checks that the mutant is in the sandbox and not in the tree, then acts like Ctrl-C."""

    def __init__(self, tree_file: Path):
        self.tree_file = tree_file
        self.sandbox = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def run(self, sandbox, mutant, timeout):
        self.sandbox = sandbox
        assert "return a - b" in (sandbox / mutant.file).read_text()
        assert self.tree_file.read_text() == CALC
        raise KeyboardInterrupt


def test_interrupt_leaves_the_tree_untouched_and_removes_the_sandbox(project):
    runner = InterruptingRunner(project / "mylib" / "calc.py")
    with pytest.raises(KeyboardInterrupt):
        run_mutants(_mutants()[:1], project, runner=runner)
    assert runner.sandbox is not None and not runner.sandbox.exists()
    assert (project / "mylib" / "calc.py").read_text() == CALC


def test_check_snippet():
    m = Mutant("m", "x.py", "a + b", "a - b", (), "")
    assert check_snippet("return a + b", m) == ""
    assert "not found" in check_snippet("return a * b", m)
    assert "occurs 2 times" in check_snippet("a + b; a + b", m)


REQUIRED = ["teamrl/losses/advantages.py", "teamrl/losses/policy_loss.py", "teamrl/trainer/update.py",
            "teamrl/policies/logprobs.py", "teamrl/algorithms/grpo.py", "teamrl/algorithms/magrpo.py",
            "teamrl/algorithms/at_grpo.py", "teamrl/algorithms/m_grpo.py", "teamrl/workflows/adapters.py",
            "teamrl/rollout/hf_engine.py"]


def test_the_project_mutant_list_names_real_files_and_tests():
    mutants = load_mutants(ROOT / "tools" / "mutants.py")
    assert len(mutants) >= 60
    assert set(REQUIRED) <= {m.file for m in mutants}  # every module a training step's numbers depend on
    for m in mutants:
        assert (ROOT / m.file).is_file(), m.id
        assert m.tests and m.description, m.id
        for sel in m.tests:
            path, _, name = sel.partition("::")
            assert (ROOT / path).is_file(), (m.id, sel)
            if name:
                assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), (m.id, sel)


def test_a_packages_init_is_imported_as_the_package():
    """A mutant in ``pkg/__init__.py`` imports ``pkg``: importing ``pkg.__init__`` ran the file a second time as a
    module of its own, where ``from pkg import sub`` found the package's attribute of that name (in
    teamrl.workflows: the function eval_opt, not the module), so the tests of 2 mutants never ran (exit 98)."""
    from tools.mutate import module_name

    assert module_name("teamrl/workflows/__init__.py") == "teamrl.workflows"
    assert module_name("teamrl/losses/advantages.py") == "teamrl.losses.advantages"
    assert module_name("data.txt") == ""
