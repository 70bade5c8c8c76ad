"""What a newcomer writing their own task hit (issue 55): a single-role task's own ``reward`` (partial credit) is
what the default ``single`` workflow scores, in training and in ``teamrl eval``; eval scores the whole split by
default; a run holding only a warm start has a report; sft and eval show progress."""

from __future__ import annotations

import json
from dataclasses import dataclass
from difflib import SequenceMatcher

from teamrl.cli import main
from teamrl.core.metrics import ProgressLines
from teamrl.rollout.engine import SamplingParams
from teamrl.rollout.scheduler import GenerationScheduler
from teamrl.tasks.solve import MathSolve, MathSolveOptions, SolveTask
from teamrl.tasks.task import Problem
from teamrl.workflows.adapters import single
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.episode import run_episode
from tests.scripted import TOK, ScriptedEngine

TINY = ["model=tiny-random", "rollout.max_new_tokens=8", "policy.device=cpu", "run.tensorboard=false"]
PARTIAL = "task.name=tests.test_newcomer_fixes:PartialCredit"


@dataclass
class PartialCreditOptions:
    name: str = "partial_credit"
    num_problems: int = 6


class PartialCredit(SolveTask):
    """Spell a word back; the reward is the reply's similarity to it (partial credit), 1 only for the word itself."""

    Options = PartialCreditOptions
    name = "partial_credit"
    answer_instruction = "Reply with the word only."
    WORDS = ("teamrl", "policy", "reward", "sample", "branch", "critic")

    def __init__(self, opts: PartialCreditOptions | None = None) -> None:
        self._problems = [Problem(f"w{i}", {"word": self.WORDS[i % len(self.WORDS)]})
                          for i in range((opts or PartialCreditOptions()).num_problems)]

    def problems(self) -> list[Problem]:
        return list(self._problems)

    def question(self, problem: Problem) -> str:
        return f"Spell the word {problem.data['word']}."

    def extract(self, text: str) -> str | None:
        return text.strip() or None

    def correct_many(self, problem: Problem, answers) -> list[bool]:
        return [a == problem.data["word"] for a in answers]

    def reward(self, problem: Problem, text: str) -> float:
        # a floor of 0.25 so that even a random model's reply earns something other than 0 or 1
        return 1.0 if self.correct_many(problem, [self.extract(text)])[0] else 0.25 + 0.5 * SequenceMatcher(
            None, text, problem.data["word"]).ratio()


def _single_episode(task, problem: Problem, reply: str):
    sched = GenerationScheduler(ScriptedEngine(lambda policy, prompt, n: [reply] * n))
    ctx = EpisodeContext(sched, lambda role: role, TOK, SamplingParams(max_new_tokens=8), problem.id, 0)
    (result,) = sched.run([run_episode(lambda c: single(c, task, problem), ctx)])
    return result


def test_single_scores_a_tasks_own_reward_and_keeps_correctness_from_correct_many():
    task = PartialCredit()
    problem = task.problems()[0]  # "teamrl"
    near = _single_episode(task, problem, "teamrI")
    assert near.team_return == task.reward(problem, "teamrI") and 0.25 < near.team_return < 1.0
    assert near.outcome is not None and near.outcome.correct is False and near.outcome.answer == "teamrI"
    exact = _single_episode(task, problem, "teamrl")
    assert exact.team_return == 1.0 and exact.outcome.correct is True


def test_a_shipped_solve_task_without_its_own_reward_is_still_scored_by_correctness():
    task = MathSolve(MathSolveOptions(num_problems=4, test_size=1))
    problem = task.problems()[0]
    truth = problem.data["answer"]
    right = _single_episode(task, problem, f"Answer: {truth}")
    wrong = _single_episode(task, problem, f"Answer: {truth}1")
    assert (right.team_return, right.outcome.correct) == (1.0, True)
    assert (wrong.team_return, wrong.outcome.correct) == (0.0, False)
    assert right.outcome.team_reward is None  # the reward is correctness, not a number of the task's


def test_training_and_eval_score_a_tasks_partial_credit(tmp_path, capsys):
    assert main(["train", PARTIAL, *TINY, "train.steps=1", "rollout.batch_size=2", "rollout.group_size=2",
                 f"run.dir={tmp_path}", "name=partial", "run.progress=false"]) == 0
    (step,) = [json.loads(line) for line in (tmp_path / "partial" / "metrics.jsonl").read_text().splitlines()]
    assert step["reward_mean"] >= 0.25, step  # every reply earns at least the floor; exact match gave 0.000
    out = tmp_path / "eval"
    assert main(["eval", PARTIAL, *TINY, "--method", "untrained", "--out", str(out), "run.progress=false"]) == 0
    task = PartialCredit()
    words = {p.id: p for p in task.problems()}
    episodes = [json.loads(line) for line in (out / "untrained.jsonl").read_text().splitlines()]
    assert len(episodes) == len(words)
    for e in episodes:
        (call,) = e["calls"]
        assert e["score"] == task.reward(words[e["problem_id"]], call["completion"]), e
        assert e["score"] >= 0.25


def test_eval_scores_the_whole_split_by_default_and_says_when_limit_cuts_it(tmp_path, capsys):
    many = [PARTIAL, "task.num_problems=24", *TINY, "--method", "untrained", "run.progress=false"]
    assert main(["eval", *many, "--out", str(tmp_path / "all")]) == 0
    assert "scoring" not in capsys.readouterr().err
    results = json.loads((tmp_path / "all" / "results.json").read_text())
    assert results["methods"]["untrained"]["problems"] == 24 and len(results["problems"]["ids"]) == 24
    assert main(["eval", *many, "--limit", "5", "--out", str(tmp_path / "five")]) == 0
    assert "scoring 5 of 24 problems (--limit 5)" in capsys.readouterr().err
    assert json.loads((tmp_path / "five" / "results.json").read_text())["methods"]["untrained"]["problems"] == 5


SFT = ["sft", "model=tiny-random", "task.name=math.solve", "task.num_problems=12", "task.test_size=4", "policy.device=cpu",
       "--problems", "4", "--epochs", "2", "--batch-size", "2"]


def test_report_of_a_run_that_holds_only_a_warm_start_says_so_and_shows_its_eval(tmp_path, capsys):
    run = tmp_path / "warm"
    assert main([*SFT, f"run.dir={tmp_path}", "name=warm", "run.progress=false"]) == 0
    assert main(["report", str(run)]) == 0, capsys.readouterr().err
    page = (run / "report" / "index.html").read_text()
    markdown = (run / "report" / "report.md").read_text()
    for text in (page, markdown):
        assert "warm start" in text and "no RL step yet" in text and "--resume" in text
    assert "No eval yet" in page
    assert main(["eval", "--checkpoint", str(run), "--method", "team", "--limit", "2", "task.split=test",
                 "rollout.max_new_tokens=4", "run.progress=false"]) == 0
    (evaluated,) = (run / "eval").iterdir()
    assert main(["report", str(run)]) == 0
    page = (run / "report" / "index.html").read_text()
    assert "no RL step yet" in page and "No eval yet" not in page and evaluated.name in page
    assert f"Latest eval ({evaluated.name})" in (run / "report" / "report.md").read_text()


def test_report_of_a_folder_with_neither_a_step_nor_a_warm_start_is_still_refused(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").touch()
    assert main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl is empty" in capsys.readouterr().err


def test_sft_and_eval_show_progress_on_stderr_and_are_quiet_with_progress_off(tmp_path, capsys):
    assert main([*SFT, f"run.dir={tmp_path}", "name=loud"]) == 0  # 4 demonstrations, 2 a step, 2 epochs: 4 steps
    err = capsys.readouterr().err
    for line in ("[teamrl sft] 0/4 steps", "[teamrl sft] 4/4 steps, loss "):
        assert line in err, err
    assert main(["eval", "--checkpoint", str(tmp_path / "loud"), "--method", "team,untrained", "--limit", "3",
                 "task.split=test", "rollout.max_new_tokens=4"]) == 0
    err = capsys.readouterr().err
    for method in ("team", "untrained"):
        assert f"[teamrl eval] {method}: 0/3 problems" in err and f"[teamrl eval] {method}: 3/3 problems, " in err, err
    assert main([*SFT, f"run.dir={tmp_path}", "name=quiet", "run.progress=false"]) == 0
    assert main(["eval", "--checkpoint", str(tmp_path / "quiet"), "--method", "team", "--limit", "3",
                 "task.split=test", "rollout.max_new_tokens=4", "run.progress=false"]) == 0
    assert "[teamrl" not in capsys.readouterr().err


def test_progress_lines_show_count_figures_elapsed_and_eta_at_most_every_few_seconds(capsys):
    every = ProgressLines("[x]", 4, "steps", every_s=0.0)
    for done in range(5):
        every.update(done, loss=f"{done / 10:.3f}")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(",")[0] for line in lines] == [f"[x] {k}/4 steps" for k in range(5)]
    assert all(f"loss {k / 10:.3f}" in lines[k] and "elapsed" in lines[k] for k in range(5))
    assert ["eta" in line for line in lines] == [False, True, True, True, False]  # none before a step, none at the end
    throttled = ProgressLines("[x]", 4, "steps", every_s=3600.0)
    for done in range(5):
        throttled.update(done)
    assert [line.split(",")[0] for line in capsys.readouterr().err.splitlines()] == ["[x] 0/4 steps", "[x] 4/4 steps"]
    quiet = ProgressLines("[x]", 4, "steps", enabled=False)
    for done in range(5):
        quiet.update(done)
    assert capsys.readouterr().err == ""
