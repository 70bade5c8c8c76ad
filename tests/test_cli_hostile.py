"""The command line under hostile input (issue 34, items 7-11a): a broken plugin, a workflow that never
calls the model, raises, is not ``async`` or asks for an undeclared role, a role map naming a role the
team has not, a read-only or full run directory, a truncated last checkpoint. Each ends in one line
on stderr naming the cause and what to do, with exit code 2 (``TEAMRL_TRACEBACK=1`` adds the
traceback). The tests drive ``teamrl.cli.main`` in this process; a subprocess where a real read-only
or full file system (bubblewrap) is needed.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from teamrl.core.config import ConfigError
from teamrl.workflows import WORKFLOWS, EpisodeOutcome, Workflow, register_workflow
from tests.test_bad_input import assert_one_line_error, run_cli, tiny_train

BWRAP = shutil.which("bwrap")
# a subprocess's stderr: transformers' own FutureWarnings are not ours to count
QUIET = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def math_train(tmp_path: Path, workflow: str, *overrides: str) -> list[str]:
    """argv of a one-step run of ``workflow`` on math.solve with the tiny model."""
    return tiny_train(tmp_path, "task.name=math.solve", f"workflow.name={workflow}", *overrides)


# ---- the workflows under test --------------------------------------------------------------------

async def silent(ctx, task, problem, settings):
    """Never calls the model."""
    return EpisodeOutcome("", None, False)


async def raises(ctx, task, problem, settings):
    """The user's own bug, after one call."""
    await ctx.generate("agent", task.question(problem))
    raise ValueError("my own bug")


async def undeclared(ctx, task, problem, settings):
    """Asks a role it did not declare."""
    await ctx.generate("critic", task.question(problem))
    return EpisodeOutcome("", None, False)


def plain(ctx, task, problem, settings):
    """Not ``async``."""
    return EpisodeOutcome("", None, False)


@pytest.fixture
def flows(monkeypatch):
    for name, fn in (("silent", silent), ("raises", raises), ("undeclared", undeclared), ("plain", plain)):
        monkeypatch.setitem(WORKFLOWS, name, Workflow(fn, ("agent",)))


# ---- 7: a plugin with a syntax error, or one that raises on import -------------------------------

def test_plugin_with_a_syntax_error_is_one_line(capsys, tmp_path):
    # old: SyntaxError escaped (a 19-line traceback, exit 1)
    plugin = tmp_path / "broken_plugin.py"
    plugin.write_text("from teamrl.api import register_workflow\ndef oops(:\n    pass\n")
    rc, err = run_cli(capsys, "config", "--plugin", str(plugin))
    assert_one_line_error(rc, err, f"{plugin}:2", "invalid syntax", "--plugin")
    assert "teamrl_plugin_broken_plugin" not in sys.modules


def test_plugin_that_raises_on_import_is_one_line(capsys, tmp_path):
    plugin = tmp_path / "raising_plugin.py"
    plugin.write_text("x = 1\nimport this_module_does_not_exist_anywhere\n")
    rc, err = run_cli(capsys, "config", "--plugin", str(plugin))
    assert_one_line_error(rc, err, f"{plugin}:2", "ModuleNotFoundError", "this_module_does_not_exist_anywhere")


# ---- 8: a workflow that never calls the model -----------------------------------------------------

def test_workflow_that_never_calls_the_model_is_one_line(capsys, tmp_path, flows):
    # old: RuntimeError: max(): Expected reduction dim ... (trainer.py, exit 1)
    rc, err = run_cli(capsys, *math_train(tmp_path, "silent"))
    assert_one_line_error(rc, err, "'silent'", "ctx.generate", "step 1")


# ---- 11a: a workflow that raises, asks for an undeclared role, or is not async -------------------

def test_workflow_that_raises_is_one_line_naming_workflow_problem_role_and_place(capsys, tmp_path, flows):
    # old: ValueError: my own bug at the end of a 50-line traceback naming neither workflow nor problem
    rc, err = run_cli(capsys, *math_train(tmp_path, "raises"))
    assert_one_line_error(rc, err, "'raises'", "ValueError: my own bug", "problem ", "role 'agent'",
                          f"{__file__}:", "TEAMRL_TRACEBACK=1")


def test_teamrl_traceback_shows_the_users_traceback_then_the_line(capsys, tmp_path, flows, monkeypatch):
    monkeypatch.setenv("TEAMRL_TRACEBACK", "1")
    rc, err = run_cli(capsys, *math_train(tmp_path, "raises"))
    assert rc == 2, err
    assert "Traceback (most recent call last)" in err and 'raise ValueError("my own bug")' in err
    assert err.strip().splitlines()[-1].startswith("teamrl: workflow 'raises' raised ValueError: my own bug")


def test_generate_with_an_undeclared_role_is_one_line(capsys, tmp_path, flows):
    # old: KeyError naming the role at the end of a 68-line traceback
    rc, err = run_cli(capsys, *math_train(tmp_path, "undeclared"))
    assert_one_line_error(rc, err, "'undeclared'", "'critic'", "['agent']", "roles=")


def test_plain_def_workflow_is_refused_at_registration():
    # old: accepted; training then failed with TypeError: object EpisodeOutcome can't be used in 'await' expression
    with pytest.raises(ConfigError, match=r"register_workflow 'plain_def_flow': .*async def") as e:
        register_workflow("plain_def_flow", roles=("agent",))(plain)
    assert len(str(e.value).splitlines()) == 1
    assert "plain_def_flow" not in WORKFLOWS


def test_plain_def_workflow_in_a_plugin_is_one_line(capsys, tmp_path):
    plugin = tmp_path / "plain_plugin.py"
    plugin.write_text("from teamrl.api import register_workflow\n\n"
                      "@register_workflow('plain_in_plugin', roles=('agent',))\n"
                      "def flow(ctx, task, problem, settings):\n    return None\n")
    rc, err = run_cli(capsys, "config", "--plugin", str(plugin))
    assert_one_line_error(rc, err, "'plain_in_plugin'", "async def")


def test_a_workflow_object_whose_run_is_not_async_is_one_line_at_run_time(capsys, tmp_path, flows):
    rc, err = run_cli(capsys, *math_train(tmp_path, "plain"))
    assert_one_line_error(rc, err, "'plain'", "async def")


def test_an_async_workflow_behind_a_functools_wraps_decorator_is_accepted():
    import functools

    def logged(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)  # returns the coroutine
        return wrapper

    try:
        register_workflow("wrapped_async_flow", roles=("agent",))(logged(silent))
        assert "wrapped_async_flow" in WORKFLOWS
    finally:
        WORKFLOWS.pop("wrapped_async_flow", None)


# ---- 11a: a role map naming a role the team has not ----------------------------------------------

def test_role_map_with_a_role_the_team_does_not_have_is_one_line_before_any_model(capsys, tmp_path):
    # old: accepted without a word (an extra policy built and never trained)
    role_map = "policy.roles={agent: a, agnet: b}"
    rc, err = run_cli(capsys, "config", "policy.mode=lora_per_role", role_map)
    assert_one_line_error(rc, err, "policy.roles", "'agnet'", "['agent']")
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "policy.mode=lora_per_role", role_map, "model=no-such-model-here"))
    assert_one_line_error(rc, err, "'agnet'")  # before the model name is even looked at


def test_role_map_entries_for_declared_roles_and_instances_are_accepted(capsys):
    # M-GRPO's single-agent baseline acts with main only; the map may still list the environment's sub
    rc, err = run_cli(capsys, "config", "task.name=research", "algorithm=m_grpo", "m_grpo.agents=single",
                      "policy.mode=lora_per_role", "policy.roles={main: m, sub: s}")
    assert rc == 0, err
    rc, err = run_cli(capsys, "config", "task.name=math.solve", "workflow.name=voting", "policy.mode=lora_per_role",
                      "policy.roles={generator: g, generator0: g0, aggregator: a}")
    assert rc == 0, err


# ---- 9: a read-only run directory ----------------------------------------------------------------

@pytest.mark.skipif(BWRAP is None, reason="needs bubblewrap for a read-only bind mount")
def test_read_only_run_directory_is_one_line_before_any_model(tmp_path):
    # old: OSError: [Errno 30] Read-only file system (a 20-line traceback, exit 1, after the model loaded)
    ro = tmp_path / "ro"
    ro.mkdir()
    r = subprocess.run([BWRAP, "--bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--ro-bind", str(ro), str(ro),
                        sys.executable, "-m", "teamrl.cli", *tiny_train(ro, "model=no-such-model-here")],
                       capture_output=True, text=True, timeout=120, env=QUIET)
    assert_one_line_error(r.returncode, r.stderr, str(ro), "read-only", "run.dir")


def test_run_dir_that_is_a_file_is_one_line(capsys, tmp_path):
    afile = tmp_path / "a_file"
    afile.write_text("not a folder")
    rc, err = run_cli(capsys, *tiny_train(afile, "model=no-such-model-here"))
    assert_one_line_error(rc, err, str(afile), "run.dir")


# ---- 10: --resume with a truncated last checkpoint -----------------------------------------------

@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    """run.dir of a run named ``r`` with checkpoints step_000001 and step_000002 (tiny model)."""
    from teamrl.cli import main

    root = tmp_path_factory.mktemp("two_checkpoints")
    assert main(tiny_train(root, "name=r", "train.steps=2", "run.save_every=1")) == 0
    assert sorted(p.name for p in (root / "r" / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    return root


@pytest.mark.parametrize("broken", ["policy_shared.pt", "trainer_state.pt", "optimizer_shared.pt"])
def test_resume_with_a_truncated_last_checkpoint_names_it_and_offers_the_intact_one(capsys, tmp_path, two_checkpoints,
                                                                                     broken):
    # old: RuntimeError: PytorchStreamReader failed reading zip archive (checkpoint.py:112, exit 1)
    shutil.copytree(two_checkpoints, tmp_path, dirs_exist_ok=True)
    last = tmp_path / "r" / "checkpoints" / "step_000002"
    os.truncate(last / broken, 1000)
    argv = tiny_train(tmp_path, "name=r", "train.steps=3", "run.save_every=1")
    rc, err = run_cli(capsys, *argv, "--resume")
    assert_one_line_error(rc, err, str(last / broken), "step_000001", "--resume-intact")
    rc, err = run_cli(capsys, *argv, "--resume-intact")
    assert rc == 0, err
    assert "step_000001" in err and "step_000002" in err  # it says what it did
    ckpts = tmp_path / "r" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_000002", "step_000003"]
    assert (ckpts / "unreadable_step_000002" / broken).stat().st_size == 1000  # kept aside, not deleted
    torch.load(ckpts / "step_000002" / broken, weights_only=False)  # rewritten whole


def test_resume_drops_a_cut_last_line_of_metrics_jsonl_and_says_so(capsys, tmp_path, two_checkpoints):
    # old: json.decoder.JSONDecodeError traceback (core/metrics.py MetricsSink.__init__ / the trainer's replay)
    import json

    shutil.copytree(two_checkpoints, tmp_path, dirs_exist_ok=True)
    metrics = tmp_path / "r" / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + '{"step": 3, "reward_mean": 0.')  # a run killed while writing step 3's line
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "name=r", "train.steps=3", "run.save_every=1"), "--resume")
    assert rc == 0, err
    notes = [line for line in err.splitlines() if "metrics.jsonl" in line]
    assert len(notes) == 1 and "cut short" in notes[0] and "line 3" in notes[0], notes
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if "reward_mean" in r] == [1, 2, 3]


def test_resume_with_a_malformed_line_inside_metrics_jsonl_is_one_line(capsys, tmp_path, two_checkpoints):
    shutil.copytree(two_checkpoints, tmp_path, dirs_exist_ok=True)
    metrics = tmp_path / "r" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(["[1, 2", *lines]) + "\n")
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "name=r", "train.steps=3"), "--resume")
    assert_one_line_error(rc, err, str(metrics), "line 1", "not a JSON record")


class _RunsACommand:
    """What an attacker puts into a checkpoint: unpickling it runs ``touch <path>`` (issue 44, H3)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_checkpoint_that_would_run_code_is_refused_in_one_line_and_runs_nothing(capsys, tmp_path, two_checkpoints):
    # old: trainer_state.pt was loaded with weights_only=False: both commands ran `touch PWNED`
    shutil.copytree(two_checkpoints, tmp_path, dirs_exist_ok=True)
    last = tmp_path / "r" / "checkpoints" / "step_000002"
    pwned = tmp_path / "PWNED"
    state = torch.load(last / "trainer_state.pt", weights_only=False)  # the test crafts it: its own file
    state["rng"]["python"] = _RunsACommand(pwned)
    torch.save(state, last / "trainer_state.pt")
    rc, err = run_cli(capsys, "eval", "--checkpoint", str(tmp_path / "r"), "--limit", "1")
    assert not pwned.exists()
    assert_one_line_error(rc, err, str(last / "trainer_state.pt"))
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "name=r", "train.steps=3"), "--resume")
    assert not pwned.exists()
    assert_one_line_error(rc, err, str(last / "trainer_state.pt"))


def test_rng_states_are_plain_data_and_a_checkpoint_of_the_old_layout_still_restores(tmp_path):
    """RNG states are stored as tensors and lists (weights_only loads them); the tuples and numpy array of checkpoints
    written before still restore (rebuilding an array runs no code of the file's)."""
    import random

    import numpy as np

    from teamrl.core.seeding import rng_state, set_rng_state
    from teamrl.trainer.checkpoint import _read

    legacy = lambda: {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}  # noqa: E731
    for capture in (rng_state, legacy):
        torch.save({"rng": capture()}, tmp_path / "s.pt")
        want = (random.random(), float(np.random.rand()), float(torch.rand(1)))
        random.random(), np.random.rand(), torch.rand(1)  # move every generator on
        set_rng_state(_read(tmp_path / "s.pt")["rng"])
        assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == want


def test_no_file_a_run_directory_holds_is_unpickled_with_code_allowed():
    """Every load of a checkpoint is ``torch.load(..., weights_only=True)``: tensors and plain data only."""
    import re

    root = Path(__file__).resolve().parents[1] / "teamrl"
    found = [f"{p}:{i}" for p in root.rglob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"weights_only\s*=\s*False|pickle\.loads?\(|torch\.load\((?!.*weights_only=True)", line)]
    assert not found, found


def test_resume_intact_without_any_intact_checkpoint_is_one_line(capsys, tmp_path, two_checkpoints):
    shutil.copytree(two_checkpoints, tmp_path, dirs_exist_ok=True)
    for step in ("step_000001", "step_000002"):
        os.truncate(tmp_path / "r" / "checkpoints" / step / "policy_shared.pt", 10)
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "name=r", "train.steps=3"), "--resume-intact")
    assert_one_line_error(rc, err, "no intact checkpoint", str(tmp_path / "r" / "checkpoints"))


# ---- 11: disk full while writing a checkpoint ------------------------------------------------------

def test_disk_full_while_writing_a_checkpoint_is_one_line_and_resume_continues(capsys, tmp_path, monkeypatch):
    # old: a torch traceback (unexpected pos ... / basic_ios::clear), exit 1
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        where = f if isinstance(f, (str, os.PathLike)) else f.name  # a path, or a file object
        if "step_000002" in str(where):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    argv = tiny_train(tmp_path, "name=r", "train.steps=2", "run.save_every=1")
    rc, err = run_cli(capsys, *argv)
    ckpts = tmp_path / "r" / "checkpoints"
    assert_one_line_error(rc, err, str(ckpts / "step_000002"), "No space left on device", "step_000001")
    assert [p.name for p in ckpts.iterdir()] == ["step_000001"]  # the previous one intact, no half-written folder
    monkeypatch.setattr(torch, "save", real_save)
    rc, err = run_cli(capsys, *argv, "--resume")
    assert rc == 0, err
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000001", "step_000002"]


@pytest.mark.skipif(BWRAP is None, reason="needs bubblewrap for a small private tmpfs")
def test_disk_full_on_a_real_small_tmpfs_is_one_line(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    r = subprocess.run([BWRAP, "--bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--size", "600000", "--tmpfs",
                        str(full), sys.executable, "-m", "teamrl.cli",
                        *tiny_train(full, "name=r", "train.steps=2", "run.save_every=1")],
                       capture_output=True, text=True, timeout=180, env=QUIET)
    assert_one_line_error(r.returncode, r.stderr, str(full / "r" / "checkpoints"), "No space left on device")


# ---- issue 44 H14: one process per run directory ----------------------------------------------------

def test_a_second_train_of_the_same_run_is_refused_in_one_line_naming_the_first(capsys, tmp_path):
    """old: two `teamrl train` of one name both ran; one failed with a misleading 'could not be written ... free
    space' and metrics.jsonl got step 1 twice (likewise two concurrent --resume)."""
    import time

    argv = [sys.executable, "-c", "import sys; from teamrl.cli import main; sys.exit(main())", *tiny_train(tmp_path, "name=twice", "train.steps=40", "rollout.max_new_tokens=8")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    first = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "twice" / "metrics.jsonl").exists():  # the first holds the run directory
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.poll() is not None else "slow"
            time.sleep(0.2)
        rc, err = run_cli(capsys, *tiny_train(tmp_path, "name=twice", "train.steps=2"))
        assert_one_line_error(rc, err, str(tmp_path / "twice"), f"pid {first.pid}")
        rc, err = run_cli(capsys, *tiny_train(tmp_path, "name=twice", "train.steps=2"), "--resume")
        assert_one_line_error(rc, err, str(tmp_path / "twice"), f"pid {first.pid}")
    finally:
        first.kill()
        first.wait()
    # the first process is gone (killed: its lock went with it): the run resumes
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "name=twice", "train.steps=2", "run.save_every=1"), "--resume")
    assert rc == 0, err


# ---- issue 44: Ctrl-C and SIGTERM end in one line, clean up, and the run resumes -----------------------------------

@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_ends_train_in_one_line_and_the_run_resumes(capsys, tmp_path, sig):
    """old: SIGINT printed a KeyboardInterrupt traceback (exit 1); SIGTERM left a .tmp_step_* folder."""
    import signal
    import time

    argv = [sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from teamrl.cli import main; sys.exit(main())",
            *tiny_train(tmp_path, "name=sig", "train.steps=400", "run.save_every=1", "rollout.max_new_tokens=8")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ckpts = tmp_path / "sig" / "checkpoints"
    deadline = time.monotonic() + 120
    while len(list(ckpts.glob("step_*"))) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else "slow"
        time.sleep(0.1)
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + getattr(signal, sig), (proc.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "interrupted" in lines[0] and "--resume" in lines[0] and "Traceback" not in err, err
    assert not list(ckpts.glob(".tmp_step_*")), list(ckpts.iterdir())
    last = int(sorted(ckpts.glob("step_*"))[-1].name[5:])
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "name=sig", f"train.steps={last + 1}", "run.save_every=1"), "--resume")
    assert rc == 0, err
    assert (ckpts / f"step_{last + 1:06d}").is_dir()


def test_an_interrupt_while_a_checkpoint_is_written_leaves_no_temporary_folder(tmp_path, monkeypatch):
    import teamrl.trainer.checkpoint as checkpoint

    real, written = checkpoint._write, []

    def interrupted(obj, path):
        if written:
            raise KeyboardInterrupt
        written.append(path)
        real(obj, path)

    monkeypatch.setattr(checkpoint, "_write", interrupted)
    from teamrl.trainer.trainer import Trainer
    from teamrl.core.config import load_config

    argv = tiny_train(tmp_path, "name=int")[1:]
    tr = Trainer(load_config(None, argv))
    with pytest.raises(KeyboardInterrupt):
        tr.train()
    assert written and not list((tmp_path / "int" / "checkpoints").glob(".tmp_step_*"))


# ---- small ones: bench arguments, a plugin that exits, an argument without '=', run names that hide their text --------

def test_bench_with_no_known_part_or_negative_steps_is_one_line_and_writes_nothing(capsys, tmp_path):
    # old: exit 0, and an empty table appended to bench/RESULTS.md
    out = tmp_path / "RESULTS.md"
    for args, names in ((["--only", "zzz"], ["--only", "'zzz'", "a, b, c, d, e, f"]),
                        (["--steps", "-3"], ["--steps", "-3", "at least 1"])):
        rc, err = run_cli(capsys, "bench", *args, "--out", str(out))
        assert_one_line_error(rc, err, *names)
    assert not out.exists()


def test_a_plugin_that_raises_system_exit_is_one_line(capsys, tmp_path):
    # old: `teamrl config --plugin p.py` exited 0 and printed nothing
    plugin = tmp_path / "exits.py"
    plugin.write_text("import sys\n\nraise SystemExit(0)\n")
    rc, err = run_cli(capsys, "config", "--plugin", str(plugin))
    assert_one_line_error(rc, err, f"{plugin}:3", "SystemExit")


def test_an_argument_without_equals_after_the_config_is_one_line_exit_2(capsys, tmp_path):
    # old: SystemExit with the message: exit code 1
    rc, err = run_cli(capsys, "config", "configs/grpo_word_count.yaml", "train.steps")
    assert_one_line_error(rc, err, "'train.steps'", "key.sub=value")


@pytest.mark.parametrize("name, shown", [('"a\\nb"', "U+000A"), ('"a\\tb"', "U+0009"), ("run\u202etxt.exe", "U+202E")])
def test_a_run_name_with_a_control_or_format_character_makes_no_folder(capsys, tmp_path, name, shown):
    # old: a folder named with a newline / a right-to-left override (its name shows reversed) was made
    rc, err = run_cli(capsys, *tiny_train(tmp_path, f"name={name}"))  # a quoted YAML override: "a\nb" is a newline
    assert_one_line_error(rc, err, "name:", shown)
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_inside_torch_save_is_the_interrupt_not_the_zip_writers_error(tmp_path, monkeypatch):
    """Seen once in make test (test_a_signal_ends_train_in_one_line_and_the_run_resumes[SIGINT]): SIGINT landed inside
    torch.save, torch's zip writer then failed closing the file (`RuntimeError: ... unexpected pos 12608 vs 12560`)
    and that error, not the interrupt, ended the run: exit 1 with a traceback instead of the one-line 130."""
    import torch

    from teamrl.trainer import checkpoint

    def interrupted_save(obj, f):
        try:
            raise KeyboardInterrupt
        finally:  # torch's writer closing the zip after the interrupt
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 12608 vs 12560")

    monkeypatch.setattr(torch, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        checkpoint._write({"x": 1}, tmp_path / "a.pt")
