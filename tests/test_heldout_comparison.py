"""Untrained vs trained, side by side: paired difference with its standard error, format validity
separate from correctness, and the comparison at the end of ``teamrl train``."""

import pytest

from teamrl.core.config import InputError, load_config
from teamrl.tasks import TASKS
from teamrl.tasks.task import Problem, reply_valid
from teamrl.trainer.evaluate import EvalRow, compare, evaluate, format_comparison, format_table, held_out_config
from teamrl.trainer.trainer import Trainer
from tests.test_magrpo import ToyTeam


def _row(method, scores):
    n = len(scores)
    return EvalRow(method, sum(scores) / n, 0.0, n, 1.0, 1.0, scores=list(scores))


def test_paired_difference_and_its_noise():
    steady = compare([_row("team", [0.6, 0.7, 0.8, 0.5]), _row("untrained", [0.4, 0.5, 0.6, 0.3])])
    assert steady.difference == pytest.approx(0.2) and steady.stderr == pytest.approx(0.0, abs=1e-12)
    assert steady.beyond_noise and "exceeds 2 standard errors" in format_comparison(steady)
    # the same mean gain, but problem by problem it goes either way: within the noise
    noisy = compare([_row("team", [1.0, 0.0, 1.0, 0.0, 1.0]), _row("untrained", [0.0, 1.0, 0.0, 1.0, 0.0])])
    assert noisy.difference == pytest.approx(0.2) and noisy.stderr == pytest.approx(0.4899, abs=1e-3)
    assert not noisy.beyond_noise and "not distinguishable from noise" in format_comparison(noisy)
    assert compare([_row("team", [1.0])]) is None
    with pytest.raises(ValueError, match="same problems"):
        compare([_row("team", [1.0, 0.0]), _row("untrained", [1.0])])


def test_team_task_eval_has_the_untrained_team_and_the_comparison(monkeypatch, tmp_path):
    monkeypatch.setitem(TASKS, "toy_team", ToyTeam)
    cfg = load_config(None, ["model=tiny-random", "threads=1", "algorithm=magrpo", "task.name=toy_team", "name=ev",
                             "rollout.max_new_tokens=6", "rollout.batch_size=2", "rollout.group_size=2", "train.steps=1",
                             "run.progress=false", "policy.mode=lora_per_role", "policy.lora.r=4", f"run.dir={tmp_path}"])
    Trainer(cfg).train()
    rows = evaluate(cfg, ["team", "untrained"], checkpoint=tmp_path / "ev", limit=3, progress=False)
    assert [r.method for r in rows] == ["team", "untrained"] and all(len(r.scores) == 3 for r in rows)
    assert rows[0].valid is None  # the toy task has no valid() hook: validity unknown, not 0
    table = format_table(rows)
    assert "team - untrained:" in table and "paired over the same 3 problems" in table and "valid replies" not in table


def test_validity_is_the_tasks_hook_and_checked():
    from teamrl.tasks.solve import MathSolve

    task = MathSolve()
    p = task.problems()[0]
    assert reply_valid(task, p, "so Answer: 12") is True and reply_valid(task, p, "no idea") is False
    assert reply_valid(task, p, "the sum is 12") is False  # scored by its last number, but not in the asked-for format
    assert reply_valid(object(), p, "anything") is None  # no hook: unknown

    class Bad:
        name = "bad"

        def valid(self, problem, text):
            return "yes"

    with pytest.raises(InputError, match="'bad': valid\\(problem .*returned 'yes'; expected True, False or None"):
        reply_valid(Bad(), Problem("x"), "t")


def test_held_out_config_picks_the_test_split_a_fresh_seed_or_says_there_is_none(monkeypatch):
    cfg = load_config(None, ["task.name=math.solve", "task.test_size=4"])
    held, where = held_out_config(cfg)
    assert held.task["split"] == "test" and "held-out" in where
    generated, where = held_out_config(load_config(None, ["task.name=word_count", "task.seed=3"]))
    assert generated.task["seed"] == 4 and "task.seed=4" in where
    monkeypatch.setitem(TASKS, "toy_team", ToyTeam)
    toy = load_config(None, ["task.name=toy_team"])
    same, where = held_out_config(toy)
    assert same.task == toy.task and "training problems" in where


def test_train_ends_with_untrained_vs_trained_on_held_out_problems(tmp_path, capsys):
    from teamrl.cli import main

    args = ["train", "name=fe", f"run.dir={tmp_path}", "model=tiny-random", "threads=1", "task.name=math.solve",
            "task.source=generated_easy", "task.num_problems=12", "task.test_size=3", "workflow.name=single",
            "rollout.group_size=2", "rollout.batch_size=1", "rollout.max_new_tokens=4", "train.steps=1",
            "run.progress=false", "run.tensorboard=false", "policy.lora.r=4", "train.final_eval_problems=3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| team |" in out and "| untrained |" in out and "valid replies" in out, out
    assert "team - untrained:" in out and "paired over the same 3 problems" in out
    assert "held-out" in out


def test_eval_of_a_single_agent_m_grpo_run_loads_its_one_policy(tmp_path):
    """m_grpo.agents=single trains the main agent alone (lora_per_role: no 'sub' adapter in its checkpoint)."""
    cfg = load_config(None, ["name=solo", f"run.dir={tmp_path}", "model=tiny-random", "threads=1", "algorithm=m_grpo",
                             "task.name=research", "task.num_problems=4", "m_grpo.agents=single", "policy.mode=lora_per_role",
                             "rollout.group_size=2", "rollout.batch_size=1", "rollout.max_new_tokens=4", "train.steps=1",
                             "run.progress=false", "run.tensorboard=false", "policy.lora.r=4"])
    Trainer(cfg).train()
    rows = evaluate(cfg, ["team", "untrained"], checkpoint=tmp_path / "solo", limit=2, progress=False)
    assert [r.method for r in rows] == ["team", "untrained"] and all(r.problems == 2 for r in rows)
