"""A checkpoint file cannot make ``teamrl eval`` or ``teamrl train --resume`` hang, exhaust memory or overflow the
stack: a list of a few hundred bytes that unfolds to 2^60 items (shared references) or a list nested 5000 deep,
in ``optimizer_*.pt`` or ``trainer_state.pt``, is one line naming the file and the field, exit code 2, at once.

Each command runs in a subprocess with 4 GiB of address space and a time limit (tests/test_bad_input_bounds.py):
a bomb that is not refused fails the test there instead of stalling it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from teamrl.trainer.checkpoint import (MAX_CHECKPOINT_DEPTH, MAX_CHECKPOINT_VALUES, CheckpointMismatch, CheckpointUnreadable,
                                      check_pickle_bounds, load_checkpoint)
from tests.test_bad_input import tiny_train
from tests.test_bad_input_bounds import run_capped


def unfolding_list(levels: int = 60) -> list:
    """``[x, x]`` ``levels`` times over: a few hundred bytes pickled (shared references), 2^levels items walked."""
    x: list = [0.0]
    for _ in range(levels):
        x = [x, x]
    return x


def nested_list(depth: int = 5000) -> list:
    x: list = []
    for _ in range(depth):
        x = [x]
    return x


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A run directory with one checkpoint (tiny-random), trained once for the module."""
    from teamrl.cli import main

    base = tmp_path_factory.mktemp("trained")
    assert main(tiny_train(base, "name=run", "run.log_episodes=false")) == 0
    return base


def plant(run_dir: Path, file: str, bomb: list) -> Path:
    """Put ``bomb`` into the last checkpoint's ``file`` where a value of another shape belongs; the file's path."""
    f = sorted((run_dir / "run" / "checkpoints").glob("step_*"))[-1] / file
    obj = torch.load(f, weights_only=True)
    if file.startswith("optimizer_"):
        obj["state"][0]["bomb"] = bomb
    else:
        obj["step"] = bomb
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # the pickler recurses once per level of a nested list
    try:
        torch.save(obj, f)
    finally:
        sys.setrecursionlimit(limit)
    return f


@pytest.mark.parametrize("bomb, file, command, field", [
    (unfolding_list, "optimizer_shared.pt", "eval", "state.0.bomb"),       # old: eval hung > 240 s
    (unfolding_list, "trainer_state.pt", "resume", "step"),                 # old: hung > 150 s (repr of the value)
    (nested_list, "optimizer_shared.pt", "resume", "state.0.bomb"),         # old: RecursionError traceback
    (nested_list, "trainer_state.pt", "eval", "step"),
], ids=["2^60-optimizer-eval", "2^60-trainer_state-resume", "deep-optimizer-resume", "deep-trainer_state-eval"])
def test_a_checkpoint_bomb_is_one_line_naming_the_file_and_field(trained_run, tmp_path, bomb, file, command, field):
    shutil.copytree(trained_run, tmp_path, dirs_exist_ok=True)
    f = plant(tmp_path, file, bomb())
    argv = (["eval", "--checkpoint", str(tmp_path / "run"), "--method", "team", "--limit", "1"] if command == "eval"
            else [*tiny_train(tmp_path, "name=run", "train.steps=2", "run.log_episodes=false"), "--resume"])
    r = run_capped(*argv, timeout=90)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, f"exit code {r.returncode}, stderr: {r.stderr[-2000:]}"
    assert str(f) in lines[0] and field in lines[0] and len(lines[0]) < 600, lines[0]


def test_the_bounds_name_the_file_and_the_field_and_fitting_files_pass(tmp_path):
    f = tmp_path / "f.pt"
    torch.save({"a": [1, 2.0, "x", None, torch.zeros(3)], "b": ([1] * 100, {"c": True})}, f)
    check_pickle_bounds(f)
    torch.save({"state": {3: {"x": unfolding_list(25)}}}, f)  # 2^25 values, 26 deep
    with pytest.raises(CheckpointMismatch) as e:
        check_pickle_bounds(f)
    assert str(e.value).startswith(f"checkpoint file {f}: state.3.x.0.0")
    assert f"unfolds to more than {MAX_CHECKPOINT_VALUES} values" in str(e.value)
    torch.save({"algorithm": {"y": nested_list(MAX_CHECKPOINT_DEPTH)}}, f)  # 34 deep
    with pytest.raises(CheckpointMismatch) as e:
        check_pickle_bounds(f)
    assert str(e.value).startswith(f"checkpoint file {f}: algorithm.y.0.0")
    assert f"nests deeper than {MAX_CHECKPOINT_DEPTH} lists/mappings" in str(e.value)
    assert len(str(e.value).splitlines()) == 1 and len(str(e.value)) < 400
    key: tuple = (0.0,)
    for _ in range(21):  # 2^22 values: building the dict here hashes them once (a bomb of 2^60 never hashes in time)
        key = (key, key)
    torch.save({key: 1}, f)  # a tuple key is hashed while it is unpickled: refused before that
    with pytest.raises(CheckpointMismatch, match="unfolds to more than"):
        check_pickle_bounds(f)
    cycle: list = []
    cycle.append(cycle)
    torch.save({"c": cycle}, f)
    with pytest.raises(CheckpointUnreadable, match="a cycle"):
        check_pickle_bounds(f)


class NoPolicies:
    def policy_names(self):
        return []


@pytest.mark.parametrize("value, described", [
    ([1, 2], "a list"),
    (-(2 ** 100), "an integer of 101 bits"),
    ("s" * 10 ** 6, "a string of 1000000 characters"),
    (-3, "-3"),
    ("one", "'one'"),
], ids=["list", "big-int", "1e6-string", "negative", "string"])
def test_a_trainer_state_step_of_the_wrong_kind_is_described_without_repr_of_it_whole(tmp_path, value, described):
    torch.save({"step": value, "data_position": 0, "rng": {}}, tmp_path / "trainer_state.pt")
    with pytest.raises(CheckpointMismatch) as e:
        load_checkpoint(tmp_path, NoPolicies())
    assert f"step must be an integer >= 0, got {described};" in str(e.value) and len(str(e.value)) < 400
