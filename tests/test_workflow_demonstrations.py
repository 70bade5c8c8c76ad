"""The study workflows' warm start: each role's demonstration is in the workflow's own prompt and format, and
right (the generator's answer, the aggregator's pick, the evaluator's verdict); ``teamrl sft`` and the learning
bench use them when ``workflow.name`` is set."""

import pytest

from teamrl.core.config import load_config
from teamrl.tasks import make_task
from teamrl.trainer.sft import run_demonstrations, warm_start
from teamrl.workflows.eval_opt import DEMO_CRITIQUE, parse_verdict
from teamrl.workflows.eval_opt import demonstrations as eval_opt_demonstrations
from teamrl.workflows.outcome import StudyOptions, wrong_reply
from teamrl.workflows.voting import demonstrations as voting_demonstrations
from teamrl.workflows.voting import parse_choice

ARITH = ["task.name=math.solve", "task.source=generated_easy", "task.max_operand=20"]


@pytest.fixture(scope="module")
def task():
    return make_task(load_config(None, ["model=tiny-random", *ARITH]).task)


def test_wrong_reply_moves_only_the_stated_answer():
    assert wrong_reply("3 + 4 = 7\nAnswer: 7", "7", 2) == "3 + 4 = 9\nAnswer: 9"
    assert wrong_reply("17 - 10 = 7\nAnswer: 7", 7, -1) == "17 - 10 = 6\nAnswer: 6"  # the 7 of 17 stays
    assert wrong_reply("Answer: x", "x", 1) is None and wrong_reply("no answer here", "5", 1) is None


@pytest.mark.parametrize("generators", [2, 3, 5])
def test_voting_demonstrations_answer_right_and_pick_the_right_candidate(task, generators):
    picks = set()
    for problem in task.problems()[:12]:
        rows = voting_demonstrations(task, problem, StudyOptions(num_generators=generators))
        assert [r for r, _, _ in rows] == ["generator", "aggregator"]
        (_, gen_prompt, gen_reply), (_, agg_prompt, agg_reply) = rows
        assert gen_prompt == task.prompt(problem) and task.correct_many(problem, [task.extract(gen_reply)]) == [True]
        content = agg_prompt[0]["content"]
        candidates = [content.split(f"Candidate {i + 1}:\n")[1].split("\n\n")[0] for i in range(generators)]
        right = task.correct_many(problem, [task.extract(c) for c in candidates])
        pick = parse_choice(agg_reply, generators)
        assert right.count(True) == 1 and right[pick], (candidates, agg_reply)
        picks.add(pick)
    assert len(picks) > 1  # the right candidate's place varies from problem to problem


def test_eval_opt_demonstrations_judge_right_and_revise(task):
    problem = task.problems()[0]
    rows = eval_opt_demonstrations(task, problem, StudyOptions())
    assert [r for r, _, _ in rows] == ["generator", "evaluator", "evaluator", "generator"]
    for role, messages, reply in rows:
        if role == "generator":
            assert task.correct_many(problem, [task.extract(reply)]) == [True]
        else:
            shown = messages[0]["content"].split("A proposed solution:\n")[1].split("\n\nCheck the solution")[0]
            truth = task.correct_many(problem, [task.extract(shown)])[0]
            assert parse_verdict(reply) is truth
    assert "Your previous answer" in rows[3][1][0]["content"] and DEMO_CRITIQUE in rows[3][1][0]["content"]


def test_a_run_with_a_workflow_warm_starts_its_roles_and_without_one_the_tasks(tmp_path, task):
    problems = task.problems()[:2]
    plain = run_demonstrations(load_config(None, ["model=tiny-random", *ARITH]), task, problems)
    assert {d.role for d in plain} == {"agent"}
    cfg = load_config(None, ["model=tiny-random", "threads=1", "algorithm=grpo", *ARITH, "workflow.name=voting",
                             "policy.mode=lora_per_role", "policy.lora.r=4", f"run.dir={tmp_path}", "name=warm",
                             "run.progress=false"])
    demos = run_demonstrations(cfg, task, problems)
    assert [d.role for d in demos] == ["generator", "aggregator"] * 2
    _, records = warm_start(cfg, demos, epochs=1, batch_size=4, progress=False)
    assert {r["policy"] for r in records} == {"generator", "aggregator"}  # each role's adapter stepped on its own rows
