"""The study workflows (Eval-Opt, Voting, Orch-Workers) on scripted model outputs, and their algorithm."""

from __future__ import annotations

from typing import Callable

import pytest

from teamrl.algorithms.grpo import WorkflowGRPO, assign_rewards
from teamrl.policies.models import byte_tokenizer
from teamrl.policies.router import role_type
from teamrl.rollout.engine import Completion, GenerationRequest, SamplingParams
from teamrl.rollout.scheduler import GenerationScheduler
from teamrl.tasks import make_task
from teamrl.tasks.solve import CodeSolve, CodeSolveOptions, MathSolve, MathSolveOptions, split_problems
from teamrl.workflows import WORKFLOWS, StudyOptions, outcome_metrics
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.eval_opt import eval_opt, parse_verdict, redact_critique
from teamrl.workflows.orch_workers import orch_workers, parse_plan
from teamrl.workflows.voting import choose, parse_choice, voting

TOK = byte_tokenizer()
# (policy, prompt text, index of the request within its engine call) -> reply
Script = Callable[[str, str, int], str]


class ScriptedEngine:
    """Replies with scripted text; records every call as (policy, [prompt texts])."""

    def __init__(self, script: Script) -> None:
        self.script, self.calls = script, []

    def generate(self, policy: str, requests: list[GenerationRequest], seed=None) -> list[list[Completion]]:
        prompts = [TOK.decode(r.prompt_ids, skip_special_tokens=True) for r in requests]
        self.calls.append((policy, prompts))
        out = []
        for i, (r, p) in enumerate(zip(requests, prompts)):
            text = self.script(policy, p, i)
            ids = TOK.encode(text, add_special_tokens=False) or [TOK.eos_token_id]
            out.append([Completion(ids, [0.0] * len(ids), text, "eos")] * r.n)
        return out


def run_episode(workflow, task, problem, script: Script, settings=StudyOptions(), route=lambda r: r):
    engine = ScriptedEngine(script)
    sched = GenerationScheduler(engine)
    ctx = EpisodeContext(sched, route, TOK, SamplingParams(max_new_tokens=8), problem.id, 0)
    (outcome,) = sched.run([workflow(ctx, task, problem, settings)])
    return outcome, ctx, engine


@pytest.fixture(scope="module")
def math_task():
    return MathSolve(MathSolveOptions(num_problems=8, test_size=2))


def _truth(problem):
    return problem.data["answer"]


# --- parsing --------------------------------------------------------------------------------------


def test_parse_verdict_and_redaction():
    assert parse_verdict("Verdict: Correct\nLooks fine.") is True
    assert parse_verdict("Verdict: **Incorrect** because step 2 is off") is False
    assert parse_verdict("Incorrect. The second step is wrong.") is False
    assert parse_verdict("verdict: correct ... on reflection, Verdict: incorrect") is False  # the last label wins
    assert parse_verdict("I am not sure.") is None
    critique = redact_critique("Verdict: Incorrect\nYou added instead of multiplying.\nAnswer: 42\nIt is \\boxed{42}.\n```python\nprint(42)\n```")
    assert "42" not in critique and "multiplying" in critique


def test_parse_choice_plan():
    assert parse_choice("I think Choice: 2", 3) == 1
    assert parse_choice("Choice: 7 ... no, Choice: 3", 3) == 2  # out-of-range choices are skipped
    assert parse_choice("the second one", 3) is None
    assert parse_plan("Subtask 1: add 3 and 4\nSubtask 2: double it\n") == ["add 3 and 4", "double it"]
    assert parse_plan("Plan:\n1. add 3 and 4\n2) double it") == ["add 3 and 4", "double it"]
    assert parse_plan("Just solve it.") == []


def test_voting_fallbacks(math_task):
    answers = ["5", "7", "7"]
    assert choose("Choice: 1", answers, math_task) == (0, "parsed")
    assert choose("The answer is clear.\nAnswer: 7", answers, math_task) == (1, "answer")
    assert choose("no idea", answers, math_task) == (1, "majority")
    assert choose("no idea", ["5", "7", None], math_task) == (0, "majority")  # a tie goes to the lowest number
    assert choose("no idea", [None, None, None], math_task) == (0, "first")


# --- Eval-Opt -------------------------------------------------------------------------------------


def test_eval_opt_revises_until_correct(math_task):
    problem = math_task.problems()[0]
    truth = _truth(problem)
    attempts = iter(["Answer: 999999", f"Answer: {truth}"])
    verdicts = iter([f"Verdict: Incorrect\nWrong operation.\nAnswer: {truth}", "Verdict: Correct"])

    def script(policy, prompt, i):
        return next(attempts) if policy == "generator" else next(verdicts)

    outcome, ctx, engine = run_episode(eval_opt, math_task, problem, script)
    assert [(s.role, s.turn) for s in ctx.samples] == [("generator", 0), ("evaluator", 0), ("generator", 1), ("evaluator", 1)]
    assert outcome.correct and outcome.answer == truth and outcome.stats["iterations"] == 2
    assert outcome.stats["first_correct"] is False
    assert outcome.stats["verdicts"] == [(False, False), (True, True)]
    revise_prompt = engine.calls[2][1][0]
    assert "Wrong operation." in revise_prompt and "different method" in revise_prompt
    assert f"Answer: {truth}" not in revise_prompt  # the evaluator's leaked answer was redacted
    assert [s.role_reward for s in ctx.samples if s.role == "evaluator"] == [1.0, 1.0]


def test_eval_opt_stops_at_the_limit_without_judging_the_last_attempt(math_task):
    problem = math_task.problems()[1]

    def script(policy, prompt, i):
        return "Answer: 123456" if policy == "generator" else "hmm, hard to say"  # no verdict: revise

    outcome, ctx, _ = run_episode(eval_opt, math_task, problem, script)
    roles = [s.role for s in ctx.samples]
    assert roles == ["generator", "evaluator", "generator", "evaluator", "generator"]  # 3 attempts for math
    assert outcome.stats["iterations"] == 3 and not outcome.correct
    assert outcome.stats["verdicts"] == [(None, False), (None, False)]
    # an unreadable verdict on a wrong answer is a right "not correct"
    assert [s.role_reward for s in ctx.samples if s.role == "evaluator"] == [1.0, 1.0]
    outcome2, ctx2, _ = run_episode(eval_opt, math_task, problem, script, StudyOptions(max_iterations=2))
    assert [s.role for s in ctx2.samples] == ["generator", "evaluator", "generator"]


def test_eval_opt_false_correct_verdict_is_penalised(math_task):
    problem = math_task.problems()[2]
    outcome, ctx, _ = run_episode(eval_opt, math_task, problem,
                                  lambda p, t, i: "Answer: 999999" if p == "generator" else "Verdict: Correct")
    assert outcome.stats["iterations"] == 1 and not outcome.correct
    (ev,) = [s for s in ctx.samples if s.role == "evaluator"]
    assert ev.role_reward == 0.0
    m = outcome_metrics("eval_opt", [outcome])
    assert m["evaluator/false_correct"] == 1.0 and m["accuracy"] == 0.0


# --- Voting ---------------------------------------------------------------------------------------


def test_voting_generators_share_one_batch_and_aggregator_picks(math_task):
    problem = math_task.problems()[0]
    truth = _truth(problem)
    replies = ["Answer: 999999", f"Answer: {truth}", f"Answer: {truth}"]

    def script(policy, prompt, i):
        return replies[i] if policy == "generator" else "Choice: 2"

    outcome, ctx, engine = run_episode(voting, math_task, problem, script, route=role_type)
    assert [(p, len(ps)) for p, ps in engine.calls] == [("generator", 3), ("aggregator", 1)]
    assert len(set(engine.calls[0][1])) == 1  # identical prompts
    agg_prompt = engine.calls[1][1][0]
    assert all(f"Candidate {k}" in agg_prompt for k in (1, 2, 3))
    assert [s.role for s in ctx.samples] == ["generator0", "generator1", "generator2", "aggregator"]
    assert outcome.correct and outcome.stats["agreement"] == "split" and outcome.stats["oracle"]
    assert not outcome.stats["miss"] and not outcome.stats["recovery"]
    assert [s.role_reward for s in ctx.samples] == [0.0, 1.0, 1.0, 1.0]


def test_voting_miss_and_recovery(math_task):
    problem = math_task.problems()[0]
    truth = _truth(problem)
    replies = ["Answer: 1", "Answer: 2", f"Answer: {truth}"]
    miss, _, _ = run_episode(voting, math_task, problem, lambda p, t, i: replies[i] if p == "generator" else "Choice: 1",
                             route=role_type)
    assert miss.stats["miss"] and not miss.correct and miss.stats["agreement"] == "split"
    rec, ctx, _ = run_episode(voting, math_task, problem, lambda p, t, i: replies[i] if p == "generator" else "Choice: 3",
                              route=role_type)
    assert rec.correct and rec.stats["recovery"]
    junk, ctx, _ = run_episode(voting, math_task, problem, lambda p, t, i: replies[i] if p == "generator" else "???",
                               route=role_type)
    assert junk.stats["choice_source"] == "majority"
    assert ctx.samples[-1].role_reward == 0.0  # a fallback earns the aggregator nothing


# --- Orch-Workers ---------------------------------------------------------------------------------


def test_orch_workers_workers_do_not_see_the_problem(math_task):
    problem = math_task.problems()[0]
    truth = _truth(problem)

    def script(policy, prompt, i):
        if policy == "orchestrator":
            return "Subtask 1: compute 6 times 7\nSubtask 2: add 1 to 41"
        if policy.startswith("worker"):
            return "42"
        return f"Answer: {truth}"

    outcome, ctx, engine = run_episode(orch_workers, math_task, problem, script)
    assert [(s.role, s.turn) for s in ctx.samples] == [("orchestrator", 0), ("worker0", 1), ("worker1", 1), ("synthesizer", 2)]
    worker_prompts = [ps[0] for p, ps in engine.calls if p.startswith("worker")]
    assert len(worker_prompts) == 2 and all(problem.data["question"] not in w for w in worker_prompts)
    assert "compute 6 times 7" in worker_prompts[0]
    synth_prompt = engine.calls[-1][1][0]
    assert problem.data["question"] in synth_prompt and "42" in synth_prompt
    assert outcome.correct and outcome.stats == {"subtasks": 2, "over_limit": False}


def test_orch_workers_over_limit_plan_gets_zero(math_task):
    problem = math_task.problems()[0]
    truth = _truth(problem)
    plan = "\n".join(f"Subtask {k}: part {k}" for k in range(1, 5))
    outcome, ctx, _ = run_episode(orch_workers, math_task, problem,
                                  lambda p, t, i: plan if p == "orchestrator" else f"Answer: {truth}")
    assert [s.role for s in ctx.samples] == ["orchestrator"] and outcome.reward == 0.0 and outcome.stats["over_limit"]
    outcome, ctx, _ = run_episode(orch_workers, math_task, problem,
                                  lambda p, t, i: "no plan" if p == "orchestrator" else f"Answer: {truth}")
    assert [s.role for s in ctx.samples] == ["orchestrator", "synthesizer"] and outcome.correct
    assert outcome_metrics("orch_workers", [outcome])["orch/subtasks_mean"] == 0.0


# --- tasks ----------------------------------------------------------------------------------------


def test_split_holds_out_the_last_problems():
    train = MathSolve(MathSolveOptions(num_problems=10, test_size=3))
    test = MathSolve(MathSolveOptions(num_problems=10, test_size=3, split="test"))
    assert [p.id for p in train.problems()] + [p.id for p in test.problems()] == [f"math/generated/0/{i}" for i in range(10)]
    with pytest.raises(ValueError, match="test_size"):
        split_problems(train.problems(), "train", 7, "x")


def test_code_solve_runs_answers_in_the_sandbox():
    task = CodeSolve(CodeSolveOptions(num_problems=3, test_size=1))
    problem = task.problems()[0]
    code = problem.data["code"]
    good = f"```python\n{code.canonical_solution}\n```"
    assert task.rewards([problem, problem, problem], [good, "```python\ndef nope(): pass\n```", "no code"]) == [1.0, 0.0, 0.0]


def test_eval_opt_on_code(tmp_path):
    task = CodeSolve(CodeSolveOptions(num_problems=2, test_size=1))
    problem = task.problems()[0]
    good = f"```python\n{problem.data['code'].canonical_solution}\n```"
    outcome, ctx, _ = run_episode(eval_opt, task, problem, lambda p, t, i: good if p == "generator" else "Verdict: Correct")
    assert outcome.correct and outcome.stats["iterations"] == 1


def test_a_valid_code_reply_holds_a_program_defining_the_function():
    """code.solve's format: a program that parses and defines the entry point; prose (a critic's) is not one."""
    task = CodeSolve(CodeSolveOptions(num_problems=2, test_size=1))
    problem = task.problems()[0]
    code = problem.data["code"]
    assert task.valid(problem, f"Here:\n```python\n{code.canonical_solution}\n```") is True
    assert task.valid(problem, "The function looks right to me; it handles the empty list.") is False
    assert task.valid(problem, "Correct") is False  # parses as Python, but defines nothing
    assert task.valid(problem, "```python\ndef (broken:\n```") is False
    assert task.valid(problem, "```python\ndef other(): pass\n```") is False  # not the function asked for


def test_eval_validity_is_judged_per_role():
    """teamrl eval's valid replies: a role that gives the task's answer is judged by the task's format, a role
    with its own format by that (Eval-Opt's evaluator: a readable verdict), a free-text role not at all."""
    from teamrl.trainer.evaluate import episode_record
    from teamrl.workflows.episode import EpisodeResult

    task = CodeSolve(CodeSolveOptions(num_problems=2, test_size=1))
    problem = task.problems()[0]
    good = f"```python\n{problem.data['code'].canonical_solution}\n```"

    def valid_by_role(generator: str, evaluator: str) -> dict[str, bool | None]:
        outcome, ctx, _ = run_episode(eval_opt, task, problem, lambda p, t, i: generator if p == "generator" else evaluator,
                                      settings=StudyOptions(max_iterations=2))
        rec = episode_record("team", "eval_opt", problem, ctx, EpisodeResult(outcome, 0.0, 0.0), 1.0, task,
                             formats=WORKFLOWS["eval_opt"].formats)
        return {c["role"]: c["valid"] for c in rec["calls"]}

    assert valid_by_role(good, "Verdict: Correct") == {"generator": True, "evaluator": True}
    assert valid_by_role(good, "I think this is right.") == {"generator": True, "evaluator": False}  # no verdict
    assert valid_by_role("I would loop over the list.", "Verdict: Incorrect") == {"generator": False, "evaluator": True}
    assert WORKFLOWS["orch_workers"].formats["worker"] is None  # a worker's output is free text: not judged


# --- the algorithm --------------------------------------------------------------------------------


def test_workflow_grpo_groups_and_rewards(math_task):
    problems = math_task.problems()[:2]
    truths = {p.id: _truth(p) for p in problems}

    def script(policy, prompt, i):
        if policy == "generator":
            # candidate 1 right, others wrong in every episode
            pid = next(k for k, p in enumerate(problems) if p.data["question"] in prompt)
            return f"Answer: {truths[problems[pid].id]}" if i % 3 == 0 else "Answer: 999999"
        return "Choice: 1" if "Choice" in prompt and i % 2 == 0 else "Choice: 2"

    engine = ScriptedEngine(script)
    sched = GenerationScheduler(engine)
    algo = WorkflowGRPO("voting", group_size=2, options=StudyOptions(), reward="per_role")

    def make_ctx(problem, episode, tags):
        return EpisodeContext(sched, role_type, TOK, SamplingParams(max_new_tokens=8), problem.id, episode, tags)

    samples = algo.rollout(problems, math_task, make_ctx, sched.run)
    assert len(samples) == 2 * 2 * 4
    assert [p for p, _ in engine.calls] == ["generator", "aggregator"]  # every episode in one call per policy
    keys = {s.group for s in samples}
    assert keys == {(p.id, t, turn) for p in problems for t, turn in (("generator", 0), ("aggregator", 1))}
    gen_group = [s for s in samples if s.group == (problems[0].id, "generator", 0)]
    assert len(gen_group) == 6  # 3 generators x 2 episodes compared together
    # per_role: a generator's reward is its own correctness, not the episode's
    assert sorted(s.reward for s in gen_group) == [0.0] * 4 + [1.0] * 2
    m = algo.metrics(samples)
    assert 0.0 < m["accuracy"] < 1.0 and m["voting/oracle_accuracy"] == 1.0
    # outcome mode: every sample of an episode gets the episode's reward
    for s in samples:
        s.role_reward = None
    assign_rewards(gen_group, algo.outcomes[0], "outcome")
    assert len({s.reward for s in gen_group}) == 1


def test_workflow_config_is_checked():
    from teamrl.algorithms import make_algorithm
    from teamrl.core.config import ConfigError, load_config

    cfg = load_config(None, ["workflow.name=panel"])  # names are checked against the registry, by the algorithms layer
    with pytest.raises(ConfigError, match=r"workflow.name: 'panel' is not a registered workflow; registered: \[.*'env', 'eval_opt'"):
        make_algorithm(cfg, make_task(cfg.task))
    # any algorithm trains a study workflow now (issue 14): the config no longer forbids the pair
    cfg = load_config(None, ["workflow.name=voting", "algorithm=magrpo", "task.name=math.solve"])
    assert make_algorithm(cfg, make_task(cfg.task)).name == "magrpo"
    cfg = load_config(None, ["workflow.name=voting", "task.name=word_count"])
    with pytest.raises(ConfigError, match="verifiable answer"):
        make_algorithm(cfg, make_task(cfg.task))
    cfg = load_config(None, ["workflow.name=orch_workers", "task.name=math.solve", "task.num_problems=8", "task.test_size=2"])
    assert make_algorithm(cfg, make_task(cfg.task)).roles == WORKFLOWS["orch_workers"].role_types


def test_math_solve_reads_the_last_number_unless_told_not_to():
    from teamrl.tasks.solve import last_number

    assert last_number("7 + 5 = 12") == "12" and last_number("It costs 1,200.") == "1200" and last_number("none") is None
    easy = MathSolve(MathSolveOptions(source="generated_easy", num_problems=6, test_size=2))
    p = easy.problems()[0]
    assert p.id.startswith("math/generated_easy/") and int(p.data["answer"]) <= 400
    assert easy.reward(p, f"so it is {p.data['answer']}") == 1.0
    strict = MathSolve(MathSolveOptions(source="generated_easy", num_problems=6, test_size=2, last_number=False))
    assert strict.reward(p, f"so it is {p.data['answer']}") == 0.0
    assert strict.reward(p, f"Answer: {p.data['answer']}") == 1.0
