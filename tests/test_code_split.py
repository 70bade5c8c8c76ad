"""The held-out split of the team coding tasks (``code.helper_main``, ``code.coder_tester``, ``code``).

Before: they had no ``split`` option, so ``held_out_config`` scored a MAGRPO run on code.helper_main on its own
training problems. Now the last ``task.test_size`` problems of the data set are held out; ``task.num_problems``
takes the first N of the training part (the held-out part never depends on it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from teamrl.cli import main
from teamrl.core.config import ConfigError, load_config
from teamrl.tasks import make_task
from teamrl.tasks.code_data import load_code_problems
from teamrl.trainer.evaluate import held_out_config

ROOT = Path(__file__).resolve().parents[1]
TEAM_TASKS = ["code.helper_main", "code.coder_tester", "code"]
HUMANEVAL = [c.task_id for c in load_code_problems("humaneval")]


def _ids(spec: dict) -> list[str]:
    return [p.id for p in make_task(spec).problems()]


@pytest.mark.parametrize("name", TEAM_TASKS)
def test_train_and_test_are_disjoint_and_together_the_whole_data_set(name):
    train, test = _ids({"name": name}), _ids({"name": name, "split": "test"})
    assert len(HUMANEVAL) == 164 and (len(train), len(test)) == (148, 16)  # the default test_size is 16
    assert not set(train) & set(test)
    assert train + test == HUMANEVAL  # train first, the held-out problems are the last ones


@pytest.mark.parametrize("name", TEAM_TASKS)
def test_a_test_size_of_48_gives_116_training_and_48_test_problems(name):
    train, test = _ids({"name": name, "test_size": 48}), _ids({"name": name, "test_size": 48, "split": "test"})
    assert (len(train), len(test)) == (116, 48)
    assert train == HUMANEVAL[:116] and test == HUMANEVAL[116:]


@pytest.mark.parametrize("name", TEAM_TASKS)
def test_num_problems_takes_the_first_training_problems_and_leaves_the_held_out_ones_alone(name):
    assert _ids({"name": name, "num_problems": 2}) == HUMANEVAL[:2]  # as before the split
    assert _ids({"name": name, "num_problems": 2, "split": "test"}) == HUMANEVAL[-16:]
    assert _ids({"name": name, "num_problems": 148}) == HUMANEVAL[:148]


@pytest.mark.parametrize("name", TEAM_TASKS)
def test_options_that_leave_no_training_problem_or_ask_for_held_out_ones_are_one_line(name):
    with pytest.raises(ConfigError) as e:
        make_task({"name": name, "test_size": 164})
    assert "\n" not in str(e.value) and "task.test_size=164" in str(e.value) and "164" in str(e.value)
    with pytest.raises(ConfigError) as e:
        make_task({"name": name, "num_problems": 120, "test_size": 48})
    message = str(e.value)
    assert "\n" not in message and "task.num_problems=120" in message and "task.test_size=48" in message, message


@pytest.mark.parametrize("name", TEAM_TASKS)
def test_a_bad_split_is_one_line(name, capsys):
    assert main(["config", f"task.name={name}", "task.split=dev"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "task.split" in err and "'dev'" in err and "'train', 'test'" in err, err


def test_a_bad_split_given_to_the_class_is_one_line_too():
    from teamrl.tasks.code_team import CodeHelperMain, CodeHelperMainOptions

    with pytest.raises(ConfigError) as e:
        CodeHelperMain(CodeHelperMainOptions(split="dev"))
    assert "\n" not in str(e.value) and "task.split='dev'" in str(e.value) and "'train', 'test'" in str(e.value)


@pytest.mark.parametrize("config", ["magrpo_code_helper_main", "at_grpo_code_shared"])
def test_held_out_config_of_a_coding_run_is_the_test_split(config):
    cfg = load_config(str(ROOT / "configs" / f"{config}.yaml"), [])
    held, what = held_out_config(cfg)
    assert held.task["split"] == "test" and what == "held-out problems (task.split=test)"
    trained = set(_ids(dict(cfg.task)))
    scored = _ids(dict(held.task))
    assert len(scored) == 16 and not trained & set(scored)


def test_split_problems_is_shared_and_still_importable_from_solve():
    from teamrl.tasks import solve, task

    assert solve.split_problems is task.split_problems and solve.SPLITS == task.SPLITS == ("train", "test")


def test_eval_says_a_coding_run_scored_on_its_training_split_and_nothing_on_the_test_split(tmp_path):
    """Before: `no held-out split: scored on the training problems (the task holds none out)`, whatever was given."""
    from teamrl.trainer.evaluate import training_problems_note

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("task:\n  name: code.helper_main\n")
    assert training_problems_note(load_config(None, ["task.name=code.helper_main"]), run) == (
        "not held out: scored on the training problems (task.split=train, as in training)")
    assert training_problems_note(load_config(None, ["task.name=code.helper_main", "task.split=test"]), run) == ""
