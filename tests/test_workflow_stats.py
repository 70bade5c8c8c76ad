"""Workflows own their statistics: each registers the function that summarises its episodes' outcomes
(``Workflow.summary``), so no algorithm names a workflow; plus the API a reward reads (a Sample has
fixed fields: a misspelt one is an error, not a silent 0) and the one warning every command printed."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from teamrl.algorithms.grpo import GRPO
from teamrl.core.config import InputError
from teamrl.sandbox import SandboxPool, run_program
from teamrl.tasks.solve import MathSolve, MathSolveOptions
from teamrl.trainer.evaluate import workflow_stats
from teamrl.workflows import REWARDS, WORKFLOWS, EpisodeOutcome, Workflow, outcome_metrics, register_workflow
from teamrl.workflows.outcome import stat_means
from tests.scripted import scripted_rollout

ROOT = Path(__file__).resolve().parents[1]
Out = EpisodeOutcome

EVAL_OPT = [Out("a", "1", True, stats={"first_correct": False, "iterations": 2, "verdicts": [(False, False), (True, True)]}),
            Out("b", "2", False, stats={"first_correct": False, "iterations": 3, "verdicts": [(True, False), (None, False)]}),
            Out("c", "3", True, stats={"first_correct": True, "iterations": 1, "verdicts": [(False, True)]})]
VOTING = [Out("a", "1", True, stats={"agreement": "all_right", "oracle": True, "miss": False, "recovery": False, "choice_source": "parsed"}),
          Out("a", "1", False, stats={"agreement": "split", "oracle": True, "miss": True, "recovery": False, "choice_source": "majority"}),
          Out("a", "1", True, stats={"agreement": "split", "oracle": True, "miss": False, "recovery": True, "choice_source": "parsed"}),
          Out("a", "1", False, stats={"agreement": "all_wrong", "oracle": False, "miss": False, "recovery": False, "choice_source": "parsed"})]
ORCH = [Out("a", "1", True, stats={"subtasks": 2, "over_limit": False}), Out("a", None, False, stats={"subtasks": 4, "over_limit": True})]

# What algorithms/grpo.py's outcome_metrics (which branched on the workflow's name) gave for these outcomes.
BEFORE = {
    "eval_opt": {"accuracy": 2 / 3, "first_attempt_accuracy": 1 / 3, "iterations_mean": 2.0, "evaluator/true_correct": 0.2,
                 "evaluator/false_correct": 0.2, "evaluator/true_incorrect": 0.4, "evaluator/false_incorrect": 0.2,
                 "evaluator/unparsed": 0.2},
    "voting": {"accuracy": 0.5, "voting/all_right": 0.25, "voting/all_wrong": 0.25, "voting/split": 0.5,
               "voting/oracle_accuracy": 0.75, "voting/aggregator_miss": 0.25, "voting/aggregator_recovery": 0.25,
               "voting/choice_parsed": 0.75},
    "orch_workers": {"accuracy": 0.5, "orch/subtasks_mean": 3.0, "orch/over_limit": 0.5},
}
OUTCOMES = {"eval_opt": EVAL_OPT, "voting": VOTING, "orch_workers": ORCH}


def test_no_algorithm_module_names_a_workflow():
    names = [n for n in WORKFLOWS if n in ("eval_opt", "voting", "orch_workers")]
    assert len(names) == 3  # the study workflows are registered, so the check below means something
    for path in sorted((ROOT / "teamrl" / "algorithms").glob("*.py")):
        text = path.read_text()
        found = [n for n in names if re.search(rf"\b{n}\b", text)]
        assert not found, f"{path.relative_to(ROOT)} names the workflow(s) {found}"


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_each_study_workflow_registers_the_summary_that_gives_the_same_metrics_as_before(name):
    spec = WORKFLOWS[name]
    assert spec.summary is not None
    for got in (outcome_metrics(name, OUTCOMES[name]), outcome_metrics(spec, OUTCOMES[name]),
                workflow_stats(spec, OUTCOMES[name])):
        assert list(got) == list(BEFORE[name])  # the same keys in the same order (the eval table's rows)
        assert got == pytest.approx(BEFORE[name])


def test_a_workflow_without_a_summary_gets_accuracy_in_training_and_stat_means_in_eval():
    spec = Workflow(lambda *a: None, ("agent",))
    outcomes = [Out("a", "1", True, stats={"x": 1, "y": "text", "dropped": False}),
                Out("b", "1", False, stats={"x": 2, "y": "more", "dropped": True})]
    assert outcome_metrics(spec, outcomes) == {"accuracy": 0.5, "episodes_dropped": 1}
    assert workflow_stats(spec, outcomes) == {"accuracy": 0.5, "episodes_dropped": 1, "x": 1.5, "dropped": 0.5}
    assert stat_means(outcomes) == {"x": 1.5, "dropped": 0.5}  # text entries cannot be averaged
    assert outcome_metrics(spec, []) == {}


def test_a_users_registered_summary_is_what_grpo_and_eval_report(monkeypatch):
    monkeypatch.setattr(WORKFLOWS, "_items", dict(WORKFLOWS._items))  # registering here leaves the library's registry alone

    def summary(outcomes):
        return {"debate/rounds_mean": sum(o.stats["rounds"] for o in outcomes) / len(outcomes)}

    @register_workflow("debate_for_stats", roles=("solver", "judge"), summary=summary)
    async def debate(ctx, task, problem, settings):
        answer = task.extract(await ctx.generate("solver", task.prompt(problem)))
        await ctx.generate("judge", task.prompt(problem))
        (correct,) = task.correct_many(problem, [answer])
        return EpisodeOutcome("", answer, correct, stats={"rounds": 2, "note": "x"})

    task = MathSolve(MathSolveOptions(num_problems=4, test_size=2))
    algo = GRPO(2, workflow="debate_for_stats")
    truth = {p.data["question"]: p.data["answer"] for p in task.problems()}
    solver_calls = []

    def script(policy, prompt, n):  # the solver is right on every other call: half the episodes are correct
        if policy != "solver":
            return ["fine"] * n
        q = next(q for q in truth if q in prompt)
        solver_calls.append(q)
        return [f"Answer: {truth[q]}" if len(solver_calls) % 2 else "Answer: -12345"] * n

    scripted_rollout(algo, task.problems(), task, script)
    m = algo.metrics([])
    assert m == {"accuracy": 0.5, "debate/rounds_mean": 2.0}  # the registered summary, no stat means
    assert workflow_stats(WORKFLOWS["debate_for_stats"], algo.outcomes) == m


def test_a_summary_must_return_numbers_by_name():
    bad = Workflow(lambda *a: None, ("agent",), summary=lambda outcomes: [1.0])
    with pytest.raises(InputError, match=r"summary .*returned \[1\.0\].*expected a dict of name -> number"):
        outcome_metrics(bad, EVAL_OPT)
    with pytest.raises(InputError, match=r"summary.*callable"):
        register_workflow("x_not_registered", roles=("a",), summary="eval_opt")(lambda *a: None)


def test_a_reward_reading_a_field_a_sample_does_not_have_stops_the_run(monkeypatch):
    """The episode logs name a sample's reply ``completion``; on the Sample it is ``text``. A reward that
    reads ``sample.completion`` raises (a Sample has fixed fields), it does not score 0."""
    monkeypatch.setitem(REWARDS, "reads_completion", lambda sample, outcome: float(len(sample.completion)))
    monkeypatch.setitem(REWARDS, "reads_text", lambda sample, outcome: float(len(sample.text)))
    task = MathSolve(MathSolveOptions(num_problems=3, test_size=2))
    with pytest.raises(AttributeError, match="completion"):
        scripted_rollout(GRPO(2, workflow="eval_opt", reward="reads_completion"), task.problems(), task,
                         lambda policy, prompt, n: ["Answer: 1"] * n)
    samples = scripted_rollout(GRPO(2, workflow="eval_opt", reward="reads_text"), task.problems(), task,
                               lambda policy, prompt, n: ["Answer: 1"] * n)
    assert samples and all(s.reward == len("Answer: 1") for s in samples if s.role == "generator")


# ---- the sandbox from an async workflow (docs/write_your_own_team.md) ---------------------------------

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]
CODES = {"right": "def add(a, b):\n    return a + b", "half": "def add(a, b):\n    return 3"}


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="the sandbox needs bubblewrap (make setup installs it)")
@pytest.mark.parametrize("call", ["to_thread", "pool"])
def test_a_workflow_awaits_the_sandbox_off_the_event_loop(monkeypatch, call):
    """The documented recipe: ``await asyncio.to_thread(run_program, ...)`` or ``await pool.run(...)``
    inside a workflow trained by GRPO; each episode's reward is its program's pass fraction."""
    monkeypatch.setattr(WORKFLOWS, "_items", dict(WORKFLOWS._items))
    with SandboxPool(workers=2) as pool:
        @register_workflow("coder_judged", roles=("coder",))
        async def coder_judged(ctx, task, problem, settings):
            code = await ctx.generate("coder", task.prompt(problem))
            if call == "to_thread":
                result = await asyncio.to_thread(run_program, code, ADD_TESTS)
            else:
                result = await pool.run(code, ADD_TESTS)
            return result.pass_fraction

        task = MathSolve(MathSolveOptions(num_problems=4, test_size=2))
        replies = iter(["right", "half", "half", "right"])
        samples = scripted_rollout(GRPO(2, workflow="coder_judged"), task.problems(), task,
                                   lambda policy, prompt, n: [CODES[next(replies)] for _ in range(n)])
    assert sorted((s.text == CODES["right"], s.reward) for s in samples) == [(False, 0.5), (False, 0.5), (True, 1.0), (True, 1.0)]


# ---- the transformers FutureWarning every command printed -------------------------------------------

DEPRECATION = "is_gradient_checkpointing"


def test_training_prints_no_gradient_checkpointing_deprecation(tmp_path):
    """Old: every command that built a LoRA policy printed transformers' FutureWarning (PEFT reads the
    deprecated ``model.is_gradient_checkpointing``)."""
    teamrl = Path(sys.executable).parent / "teamrl"
    proc = subprocess.run([str(teamrl), "train", "model=tiny-random", f"run.dir={tmp_path}", "train.steps=1",
                           "rollout.group_size=2", "rollout.batch_size=1", "rollout.max_new_tokens=4", "threads=1",
                           "run.progress=false", "run.tensorboard=false"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "default"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert DEPRECATION not in proc.stderr, proc.stderr[-2000:]


def test_building_and_loading_an_adapter_warns_nothing(tmp_path):
    """Both places PEFT builds a model (a LoRA policy; ``teamrl serve``'s adapter loading) are quiet."""
    from teamrl.core.config import LoraConfig
    from teamrl.policies.router import PolicyRouter
    from teamrl.rollout.server import ModelServer

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # over pytest's filterwarnings, which hides this warning in tests only
        router = PolicyRouter("shared", ["agent"], "tiny-random", LoraConfig(r=2, alpha=4, target_modules=["q_proj"]), lr=1e-4)
        router.policies["shared"].save_adapter(tmp_path / "adapter")
        ModelServer("tiny-random").load_adapter("a", str(tmp_path / "adapter"))
    assert not [w for w in caught if DEPRECATION in str(w.message)]
