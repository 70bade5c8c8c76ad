"""``reverse_text`` and ``reverse_text.team``: the LCS-ratio reward, the held-out split, the demonstrations, and
one training step of each (GRPO and MAGRPO) on the tiny model."""

import pytest

from teamrl.cli import main
from teamrl.core.config import ConfigError
from teamrl.tasks import make_task
from teamrl.tasks.reverse_text import extract_reversed, halves, lcs_ratio


def test_the_reward_is_the_ratio_of_the_tagged_answer_and_zero_without_tags():
    task = make_task({"name": "reverse_text"})
    p = task.problems()[0]
    truth = p.data["text"][::-1]
    assert p.data["reversed"] == truth
    assert task.reward(p, f"ok <reversed_text> {truth} </reversed_text> bye") == 1.0
    assert task.reward(p, truth) == 0.0 and not task.valid(p, truth)  # the format is part of the task
    half = truth[: len(truth) // 2]
    assert task.reward(p, f"<reversed_text>{half}</reversed_text>") == pytest.approx(
        2 * len(half) / (len(half) + len(truth)))
    assert lcs_ratio("abc", "xyz") == 0.0 and extract_reversed("<reversed_text>a") is None


def test_held_out_texts_are_the_last_test_size_and_the_generator_is_seeded():
    train = make_task({"name": "reverse_text", "num_problems": 60, "test_size": 10})
    test = make_task({"name": "reverse_text", "num_problems": 60, "test_size": 10, "split": "test"})
    assert len(train.problems()) == 50 and len(test.problems()) == 10
    assert not {p.id for p in train.problems()} & {p.id for p in test.problems()}
    again = make_task({"name": "reverse_text", "num_problems": 60, "test_size": 10})
    assert [p.data for p in again.problems()] == [p.data for p in train.problems()]
    other = make_task({"name": "reverse_text", "num_problems": 60, "test_size": 10, "seed": 1})
    assert [p.data for p in other.problems()] != [p.data for p in train.problems()]
    with pytest.raises(ConfigError, match="min_words"):
        make_task({"name": "reverse_text", "min_words": 5, "max_words": 2})


def test_every_demonstration_scores_one_alone_and_as_a_team():
    task = make_task({"name": "reverse_text"})
    team = make_task({"name": "reverse_text.team"})
    for p in task.problems()[:20]:
        ((role, messages, reply),) = task.demonstrations(p)
        assert role == "agent" and messages == task.prompt(p) and task.reward(p, reply) == 1.0
    for p in team.problems()[:20]:
        outputs = {role: reply for role, _, reply in team.demonstrations(p)}
        assert team.reward(p, outputs) == 1.0 and team.role_rewards(p, outputs) == {"head": 1.0, "tail": 1.0}
        parts = halves(p.data["text"])
        assert f"{parts['head']} {parts['tail']}" == p.data["text"]
        # a role without its tags loses its half of the team's reward, not all of it
        assert 0.0 < team.reward(p, {**outputs, "head": "no tags"}) < 1.0


def test_one_grpo_step_and_one_magrpo_step_train_on_the_tiny_model(tmp_path, capsys):
    common = ["model=tiny-random", f"run.dir={tmp_path}", "task.num_problems=8", "task.test_size=2",
              "rollout.group_size=2", "rollout.batch_size=1", "rollout.max_new_tokens=8", "train.steps=1",
              "run.progress=false", "threads=1"]
    assert main(["train", "configs/grpo_reverse_text.yaml", "name=rt", *common]) == 0
    assert main(["train", "configs/magrpo_reverse_text.yaml", "name=rtt", *common]) == 0
    assert (tmp_path / "rt" / "checkpoints" / "step_000001").is_dir()
    assert (tmp_path / "rtt" / "checkpoints" / "step_000001").is_dir()


def test_held_out_evaluation_during_training_scores_a_task_of_partial_credit_by_its_mean_return(tmp_path):
    """train.eval_every on a task whose workflow returns rewards, not outcomes (reverse_text): the held-out figure
    is the mean normalised return over the held-out problems, what teamrl eval scores for the same weights."""
    import json

    from teamrl.core.config import load_config
    from teamrl.trainer.evaluate import evaluate
    from teamrl.trainer.trainer import Trainer

    args = ["model=tiny-random", f"run.dir={tmp_path}", "name=ev", "task.name=reverse_text", "task.num_problems=8",
            "task.test_size=3", "rollout.group_size=2", "rollout.batch_size=1", "rollout.max_new_tokens=6",
            "train.steps=1", "train.eval_every=1", "train.eval_problems=3", "run.progress=false", "threads=1",
            "policy.lora.r=4"]
    Trainer(load_config(None, args)).train()
    evals = [json.loads(line) for line in (tmp_path / "ev" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in evals if "eval/accuracy" in r][-1]
    assert last["step"] == 1
    (row,) = evaluate(load_config(None, [*args, "task.split=test"]), ["team"], checkpoint=tmp_path / "ev",
                      progress=False)
    assert row.problems == 3 and last["eval/accuracy"] == pytest.approx(row.mean, abs=1e-6)


def test_held_out_evaluation_of_a_task_without_a_split_is_one_line(tmp_path):
    from teamrl.core.config import load_config
    from teamrl.trainer.trainer import Trainer

    with pytest.raises(ConfigError, match="no held-out split"):
        Trainer(load_config(None, ["model=tiny-random", f"run.dir={tmp_path}", "task.name=word_count",
                                   "train.eval_every=1", "run.progress=false"]))
