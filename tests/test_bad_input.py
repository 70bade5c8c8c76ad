"""Bad input, tried as a new user would: each case ends in one line on stderr that names the input
and what would be accepted, with exit code 2, before any model loads where it can.

The tests drive the real command line (``teamrl.cli.main`` with argv, a subprocess for two).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pytest

from teamrl.core.config import option
from teamrl.tasks.task import Problem, Task, TeamTask


def run_cli(capsys, *argv: str) -> tuple[object, str]:
    """(exit code, stderr) of ``teamrl argv``; an exception that escapes becomes ("raised", its type and message)."""
    from teamrl.cli import main

    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    except Exception as e:  # what a user would have seen as a traceback
        capsys.readouterr()
        return "raised", f"{type(e).__name__}: {e}"
    return rc, capsys.readouterr().err


def assert_one_line_error(rc: object, err: str, *names: str) -> None:
    """Exit code 2 and exactly one stderr line that contains every one of ``names``."""
    assert rc == 2, f"exit code {rc!r}, stderr: {err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"{len(lines)} lines on stderr: {err}"
    for name in names:
        assert name in lines[0], f"{name!r} not in {lines[0]!r}"


def tiny_train(tmp_path: Path, *overrides: str) -> list[str]:
    """argv of a one-step training run on tiny-random (seconds)."""
    return ["train", "model=tiny-random", f"run.dir={tmp_path}", "train.steps=1", "rollout.group_size=2",
            "rollout.batch_size=1", "rollout.max_new_tokens=4", "run.progress=false", "run.tensorboard=false",
            *overrides]


# ---- data files, model folders, model aliases ------------------------------------------------------

def test_missing_data_file_is_one_line(capsys, tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "algorithm=magrpo", "task.name=writing.tldr",
                                          f"task.source={missing}", "task.split="))
    assert_one_line_error(rc, err, missing)
    missing_mbpp = str(tmp_path / "sanitized-mbpp.json")
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "algorithm=magrpo", "task.name=code.helper_main",
                                          "task.source=mbpp", f"task.path={missing_mbpp}"))
    assert_one_line_error(rc, err, missing_mbpp)


def test_mbpp_without_a_path_is_one_line(capsys, tmp_path):
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "algorithm=magrpo", "task.name=code.helper_main", "task.source=mbpp"))
    assert_one_line_error(rc, err, "task.path", "mbpp")


def test_missing_model_folder_is_one_line(tmp_path):
    # a subprocess: what a user sees, interpreter and all
    folder = str(tmp_path / "my-model")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "teamrl.cli", "train", f"model={folder}", f"run.dir={tmp_path}"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert_one_line_error(r.returncode, r.stderr, folder, "does not exist")


@pytest.fixture
def hub_calls(monkeypatch):
    """Record (and refuse) every attempt to load from the hub, so a test can assert there was none."""
    from teamrl.policies import models

    calls: list[str] = []

    def refuse(name, *args, **kwargs):
        calls.append(str(name))
        raise OSError(f"hub refused in tests: {name}")

    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", refuse)
    return calls


def test_mistyped_alias_fails_fast_without_the_hub_and_lists_the_aliases(capsys, tmp_path, hub_calls):
    t0 = time.perf_counter()
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "model=smollm2-135"))
    assert_one_line_error(rc, err, "'smollm2-135'", "did you mean 'smollm2-135m'", "tiny-random", "random:qwen3-1.7b")
    assert hub_calls == []
    assert time.perf_counter() - t0 < 10


def test_hub_id_offline_fails_fast_and_lists_the_aliases(capsys, tmp_path, hub_calls, monkeypatch):
    from teamrl.policies import models

    # hub unreachable (no HF_HUB_OFFLINE set): no retries, one line
    monkeypatch.setattr(models, "hub_is_offline", lambda: True, raising=False)
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "model=SomeOrg/some-model"))
    assert_one_line_error(rc, err, "'SomeOrg/some-model'", "smollm2-135m", "tiny-random", "offline")
    assert hub_calls == []


def test_hub_is_offline_asks_the_endpoint_once(monkeypatch):
    import socket

    from huggingface_hub import constants

    from teamrl.policies.models import hub_is_offline

    for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{listening.getsockname()[1]}")
        assert hub_is_offline() is False
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")  # nothing listens there now
    t0 = time.perf_counter()
    assert hub_is_offline() is True
    assert time.perf_counter() - t0 < 5
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub_is_offline() is True


# ---- YAML ---------------------------------------------------------------------------------------

def test_yaml_syntax_error_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntask: {name: word_count\ntrain:\n  steps: 2\n")
    r = subprocess.run([sys.executable, "-m", "teamrl.cli", "config", str(bad)], capture_output=True, text=True, timeout=120)
    assert_one_line_error(r.returncode, r.stderr, str(bad), "line ")


def test_duplicate_yaml_key_is_an_error(capsys, tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("name: first\ntrain:\n  steps: 2\n  lr: 0.001\n  steps: 3\n")
    rc, err = run_cli(capsys, "config", str(dup))
    assert_one_line_error(rc, err, str(dup), "duplicate key 'steps'", "line 5")


def test_empty_yaml_is_an_error(capsys, tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    rc, err = run_cli(capsys, "config", str(empty))
    assert_one_line_error(rc, err, str(empty), "empty")


# ---- keys and values ----------------------------------------------------------------------------

def test_config_command_validates_task_options(capsys):
    rc, err = run_cli(capsys, "config", "task.name=word_count", "task.num_problem=3")
    assert_one_line_error(rc, err, "task.num_problem", "num_problems")
    rc, err = run_cli(capsys, "config", "task.name=word_count", "task.min_words=9", "task.max_words=3")
    assert_one_line_error(rc, err, "task.min_words=9", "task.max_words=3")


def test_task_option_min_above_max_is_one_line(capsys, tmp_path):
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "task.name=word_count", "task.min_words=9", "task.max_words=3"))
    assert_one_line_error(rc, err, "task.min_words=9", "task.max_words=3")
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "algorithm=at_grpo", "task.name=plan_path",
                                          "task.min_size=7", "task.max_size=4"))
    assert_one_line_error(rc, err, "task.min_size=7", "task.max_size=4")


@pytest.mark.parametrize("name", ["../x", "/tmp/x", "a/../../x", ""])
def test_run_name_must_stay_inside_run_dir(capsys, tmp_path, name):
    rc, err = run_cli(capsys, "config", f"name={name}", f"run.dir={tmp_path}")
    assert_one_line_error(rc, err, "name", repr(name))


def test_a_run_name_is_accepted():
    from teamrl.core.config import load_config

    assert load_config(None, ["name=lr1e-4_g4.v2"]).name == "lr1e-4_g4.v2"


# ---- what a task's reward returns ---------------------------------------------------------------

@dataclass
class BadRewardOptions:
    name: str = "bad_reward"
    returns: str = option("none", choices=("none", "string", "ok"))


class BadRewardTask(Task):
    """One problem; ``reward`` returns None, a string or a float as told."""

    name = "bad_reward"
    Options = BadRewardOptions

    def __init__(self, opts: BadRewardOptions) -> None:
        self.opts = opts

    def problems(self) -> list[Problem]:
        return [Problem("p0")]

    def prompt(self, problem: Problem) -> list[dict[str, str]]:
        return [{"role": "user", "content": "Say hi."}]

    def reward(self, problem: Problem, text: str):
        return {"none": None, "string": "0.5", "ok": 0.5}[self.opts.returns]


@dataclass
class BadTeamRewardOptions:
    name: str = "bad_team_reward"
    extra: int = option(1, doc="how many rewards more (or, negative, fewer) than joint actions rewards() returns")


class BadTeamRewardTask(TeamTask):
    """Two roles; ``rewards`` returns ``extra`` values too many (or too few)."""

    name = "bad_team_reward"
    roles = ("a", "b")
    Options = BadTeamRewardOptions

    def __init__(self, opts: BadTeamRewardOptions) -> None:
        self.opts = opts

    def problems(self) -> list[Problem]:
        return [Problem("p0")]

    def prompt(self, problem, role, turn=0, history=(), feedback=""):
        return [{"role": "user", "content": f"You are {role}. Say hi."}]

    def reward(self, problem: Problem, outputs: dict[str, str]) -> float:
        return 1.0

    def rewards(self, problem: Problem, joint: Sequence[dict[str, str]]) -> list[float]:
        return [1.0] * (len(joint) + self.opts.extra)


@pytest.fixture
def bad_tasks(monkeypatch):
    from teamrl import tasks

    monkeypatch.setitem(tasks.TASKS, BadRewardTask.name, BadRewardTask)
    monkeypatch.setitem(tasks.TASKS, BadTeamRewardTask.name, BadTeamRewardTask)


@pytest.mark.parametrize("returns, shown", [("none", "None"), ("string", "'0.5'")])
def test_reward_of_the_wrong_type_is_one_line(capsys, tmp_path, bad_tasks, returns, shown):
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "task.name=bad_reward", f"task.returns={returns}"))
    assert_one_line_error(rc, err, "bad_reward", shown, "a number")


@pytest.mark.parametrize("extra", [1, -1])
def test_rewards_of_the_wrong_count_is_one_line(capsys, tmp_path, bad_tasks, extra):
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "algorithm=magrpo", "task.name=bad_team_reward", f"task.extra={extra}"))
    # over the episode protocol the team adapter scores one joint action per call of rewards()
    assert_one_line_error(rc, err, "bad_team_reward", f"returned {1 + extra} values", "expected 1")


def test_a_well_formed_reward_trains(capsys, tmp_path, bad_tasks):
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "task.name=bad_reward", "task.returns=ok"))
    assert rc == 0, err


# ---- what is not bad input still shows its traceback ---------------------------------------------

def test_an_unexpected_error_still_raises(capsys, tmp_path, monkeypatch):
    from teamrl.trainer import trainer

    def broken(*args, **kwargs):
        raise RuntimeError("a bug, not bad input")

    monkeypatch.setattr(trainer, "make_trainer", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        from teamrl.cli import main

        main(tiny_train(tmp_path))


def test_eval_checks_the_reward_too(capsys, bad_tasks):
    rc, err = run_cli(capsys, "eval", "model=tiny-random", "task.name=bad_reward", "task.returns=string",
                      "rollout.max_new_tokens=4", "--method", "single", "--limit", "1")
    err = "".join(line for line in err.splitlines(keepends=True) if not line.startswith("[teamrl eval]"))  # progress
    assert_one_line_error(rc, err, "bad_reward", "'0.5'", "a number")
