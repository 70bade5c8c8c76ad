"""Bad input that reached a traceback, a hang or an exhausted memory (issue 45, H11-H13, H16): YAML bombs, a
config that is not UTF-8, sizes beyond what the machine can hold, numbers no library takes, command-line values out
of range, ports and files that cannot be used, checkpoints of another run. Each ends in one line on stderr that
names the input and what is accepted, exit code 2, before anything is allocated for it.

The tests drive the real command line (``teamrl.cli.main``, a subprocess where memory must be capped).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_bad_input import assert_one_line_error, run_cli, tiny_train

ROOT = Path(__file__).resolve().parents[1]


def _capped(limit_bytes: int):
    """preexec_fn of a subprocess whose address space is capped: a bomb that is not refused fails there, not here."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    return cap


def run_capped(*argv: str, timeout: float = 150) -> subprocess.CompletedProcess:
    """``python -m teamrl argv`` with 4 GiB of address space and a time limit (a hang is a failure, not a stuck test)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    try:
        return subprocess.run([sys.executable, "-m", "teamrl.cli", *argv], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=ROOT, preexec_fn=_capped(4 << 30))
    except subprocess.TimeoutExpired:
        pytest.fail(f"teamrl {' '.join(a[:60] for a in argv)} still running after {timeout} s")


# ---- H11: YAML bombs -------------------------------------------------------------------------------

def _laughs(levels: int = 9, width: int = 10) -> list[str]:
    """A billion laughs: ``width ** levels`` strings from ~100 aliases."""
    rows = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    rows += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return rows


BOMB_FIELDS = ["policy.resources.w.resources", "rollout.vllm.resources"]


@pytest.mark.parametrize("field", BOMB_FIELDS)
def test_a_yaml_bomb_in_a_config_file_is_refused_at_once(capsys, tmp_path, field):
    # old: MemoryError after 66 s (the file), or still running at 180 s
    *parents, leaf = field.split(".")
    lines = [f"{'  ' * i}{p}:" for i, p in enumerate(parents)]
    lines.append(f"{'  ' * len(parents)}{leaf}:")
    lines += [f"{'  ' * (len(parents) + 1)}{row}" for row in _laughs()]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("task: {name: word_count}\n" + "\n".join(lines) + "\n")
    r = run_capped("config", str(bomb))
    assert_one_line_error(r.returncode, r.stderr, str(bomb), "alias")
    t0 = time.perf_counter()
    rc, err = run_cli(capsys, "config", str(bomb))
    assert time.perf_counter() - t0 < 2
    assert_one_line_error(rc, err, str(bomb), "alias", "at most")


@pytest.mark.parametrize("field", BOMB_FIELDS)
def test_a_yaml_bomb_in_an_override_is_refused_at_once(capsys, field):
    override = f"{field}={{{', '.join(_laughs())}}}"
    r = run_capped("config", override)
    assert_one_line_error(r.returncode, r.stderr, field, "alias")
    t0 = time.perf_counter()
    rc, err = run_cli(capsys, "config", override)
    assert time.perf_counter() - t0 < 2
    assert_one_line_error(rc, err, field, "alias", "at most")


def test_recursive_yaml_alias_is_refused(capsys, tmp_path):
    loop = tmp_path / "loop.yaml"
    loop.write_text("task: &t {name: word_count, x: *t}\n")
    rc, err = run_cli(capsys, "config", str(loop))
    assert_one_line_error(rc, err, str(loop), "refers to itself")


def test_a_few_yaml_aliases_are_still_fine(tmp_path):
    from teamrl.core.config import load_config

    ok = tmp_path / "anchors.yaml"
    ok.write_text("task: {name: word_count}\ntrain: {loss: {eps_low: &e 0.3, eps_high: *e}}\n"
                  "policy: {lora: {<<: {r: 4, alpha: 8}, dropout: 0.1}}\n")
    cfg = load_config(ok)
    assert (cfg.train.loss.eps_high, cfg.policy.lora.r, cfg.policy.lora.dropout) == (0.3, 4, 0.1)


def test_a_huge_config_file_is_refused_before_it_is_read(capsys, tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.write(b"task: {name: word_count}\n# ")
        f.truncate(64 << 20)  # sparse: 64 MiB of NULs
    rc, err = run_cli(capsys, "config", str(big))
    assert_one_line_error(rc, err, str(big), "MiB", "at most")


# ---- H12: a config that is not UTF-8 ----------------------------------------------------------------

def test_a_config_that_is_not_utf8_is_one_line(capsys, tmp_path):
    # old: UnicodeDecodeError traceback
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes("task: {name: word_count}\nname: caf\xe9\n".encode("latin-1"))
    rc, err = run_cli(capsys, "config", str(latin))
    assert_one_line_error(rc, err, str(latin), "UTF-8", "line 2")


# ---- H16: free-form mappings are checked against their annotation -------------------------------------

@pytest.mark.parametrize("override, names", [
    ("rollout.vllm.env={A: [1]}", ["rollout.vllm.env.A", "a string", "[1]"]),
    ("rollout.vllm.env={1: x}", ["rollout.vllm.env", "key 1", "a string"]),
    ("policy.roles={critic: [1]}", ["policy.roles.critic", "a string"]),
    ("policy.workers={base: [main, [1]]}", ["policy.workers.base[1]", "a string"]),
    ("policy.resources={w: [1]}", ["policy.resources.w", "a mapping"]),
])
def test_a_free_form_mapping_is_checked_against_its_type(capsys, override, names):
    # old: accepted (exit 0)
    rc, err = run_cli(capsys, "config", "task.name=word_count", override)
    assert_one_line_error(rc, err, *names)


def test_a_free_form_mapping_of_the_right_type_is_kept():
    from teamrl.core.config import load_config

    cfg = load_config(None, ["rollout.vllm.env={A: '1', B: x}", "workflow.options={k: [1, {a: 2}]}"])
    assert cfg.rollout.vllm.env == {"A": "1", "B": "x"}
    assert cfg.workflow.options == {"k": [1, {"a": 2}]}


# ---- H12: values no library takes ---------------------------------------------------------------------

@pytest.mark.parametrize("override, names", [
    (f"seed={2 ** 70}", ["seed", str(2 ** 70), "<= 9223372036854775807"]),
    ("seed=-1", ["seed", ">= 0"]),
    ("train.lr=1e308", ["train.lr", "<= 1"]),
    ("name=" + "x" * 300, ["name", "255 bytes"]),
    ("task={name: [1]}", ["task.name", "[1]", "a string"]),
])
def test_a_value_out_of_what_the_libraries_take_is_one_line(capsys, tmp_path, override, names):
    # old: seed: RuntimeError Overflow when unpacking long; lr: NaN weights, a ValueError traceback at the checkpoint;
    # name: OSError File name too long; task.name a list: TypeError unhashable type
    rc, err = run_cli(capsys, *tiny_train(tmp_path, override))
    assert_one_line_error(rc, err, *names)


# ---- H12: sizes beyond the machine ----------------------------------------------------------------------

@pytest.mark.parametrize("override, names", [
    ("rollout.group_size=1000000000", ["rollout.group_size=1000000000", "GiB", "memory"]),
    ("rollout.batch_size=1000000000", ["rollout.batch_size=1000000000", "GiB", "memory"]),
    ("rollout.max_new_tokens=1000000000", ["rollout.max_new_tokens=1000000000", "GiB", "memory"]),
    ("task={name: word_count, num_problems: 1000000000}", ["task.num_problems", "1000000000", "GiB", "memory"]),
])
def test_a_size_beyond_memory_is_refused_before_anything_is_allocated(capsys, tmp_path, override, names):
    # old: MemoryError / allocation errors, or (batch_size) still running at 180 s
    t0 = time.perf_counter()
    rc, err = run_cli(capsys, *tiny_train(tmp_path, override))
    assert_one_line_error(rc, err, *names)
    assert time.perf_counter() - t0 < 20


def test_a_study_grid_of_a_billion_cells_is_refused_before_it_is_built(tmp_path):
    # old: 1000 tasks x 1000 models x 1000 seeds grew 0.44 -> 2.25 GB in 72 s and printed nothing
    import yaml

    study = tmp_path / "grid.yaml"
    study.write_text(yaml.safe_dump({"name": "huge", "tasks": [{"name": "math.solve", "num_problems": i + 1}
                                                                for i in range(1000)],
                                     "models": [f"m{i}" for i in range(1000)], "seeds": list(range(1000))}))
    t0 = time.perf_counter()
    r = run_capped("study", str(study), timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, f"exit code {r.returncode}, stderr: {r.stderr[-2000:]}"
    for name in ("study grid", "7000000000 cells", "1000 tasks x 1000 models x 1000 seeds", "at most 10000"):
        assert name in lines[0], lines[0]
    assert time.perf_counter() - t0 < 30


def test_a_study_grid_is_refused_when_its_cells_need_more_memory_than_the_machine_has(monkeypatch, tmp_path):
    from teamrl.core import options
    from teamrl.core.config import ConfigError
    from teamrl.trainer.study import load_study

    study = tmp_path / "grid.yaml"
    study.write_text("name: small\nseeds: [0, 1]\n")
    assert load_study(study).seeds == [0, 1]
    monkeypatch.setattr(options, "machine_memory", lambda: 1000)
    with pytest.raises(ConfigError, match=r"study grid \(14 cells\) needs at least .* GiB of memory"):
        load_study(study)


@pytest.mark.parametrize("command", ["train", "eval"])
def test_max_new_tokens_beyond_the_models_context_is_refused_before_generating(capsys, tmp_path, command, monkeypatch):
    # a machine with memory enough for 1e9 tokens (the 128 GiB device): the model's context still bounds them;
    # old: RuntimeError from the allocator (DefaultCPUAllocator: 256000000000 bytes), a traceback
    from teamrl.core import options

    monkeypatch.setattr(options, "machine_memory", lambda: 1 << 50)
    argv = tiny_train(tmp_path, "rollout.max_new_tokens=1000000000")
    if command == "eval":
        argv = ["eval", *argv[1:], "--method", "single", "--limit", "1"]
    t0 = time.perf_counter()
    rc, err = run_cli(capsys, *argv)
    err = "".join(line for line in err.splitlines(keepends=True) if not line.startswith("[teamrl eval]"))
    assert_one_line_error(rc, err, "rollout.max_new_tokens=1000000000", "max_position_embeddings 2048", "at most 2048")
    assert time.perf_counter() - t0 < 60


def test_lora_rank_beyond_the_model_is_refused_before_the_adapter_is_made(capsys, tmp_path):
    # old: RuntimeError from the allocator (a 1e9-row adapter)
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "policy.lora.r=1000000000"))
    assert_one_line_error(rc, err, "policy.lora.r", "1000000000", "at most")


def test_sizes_that_fit_still_pass():
    from teamrl.core.config import load_config

    cfg = load_config(None, ["rollout.group_size=64", "rollout.batch_size=64", "rollout.max_new_tokens=4096",
                             "task.name=word_count", "task.num_problems=100000"])
    assert cfg.rollout.group_size == 64


# ---- H12, H13: command-line values ------------------------------------------------------------------

EVAL = ("eval", "model=tiny-random", "task.name=word_count", "rollout.max_new_tokens=4", "--method", "single")


@pytest.mark.parametrize("flag, value, names", [
    ("--temperature", "nan", ["--temperature", "nan", "finite"]),
    ("--temperature", "-1", ["--temperature", "-1", ">= 0"]),
    ("--temperature", "warm", ["--temperature", "'warm'", "a number"]),
    ("--limit", "-5", ["--limit", "-5", ">= 1"]),
    ("--limit", "0", ["--limit", "0", ">= 1"]),
])
def test_eval_refuses_a_value_out_of_range(capsys, flag, value, names):
    # old: --temperature nan and --limit -5 evaluated (59 problems), exit 0; --temperature -1: a traceback
    rc, err = run_cli(capsys, *EVAL, "--limit", "1", flag, value)
    assert_one_line_error(rc, err, *names)


def test_eval_refuses_an_out_that_is_a_file_before_evaluating(capsys, tmp_path, monkeypatch):
    # old: FileExistsError traceback after the whole evaluation
    from teamrl.trainer import evaluate

    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **k: pytest.fail("evaluated before --out was checked"))
    taken = tmp_path / "results"
    taken.write_text("not a folder")
    rc, err = run_cli(capsys, *EVAL, "--limit", "1", "--out", str(taken))
    assert_one_line_error(rc, err, "--out", str(taken), "not a folder")


@pytest.mark.parametrize("flag, value, names", [
    ("--lr", "nan", ["--lr", "nan", "finite"]),
    ("--lr", "-1", ["--lr", "-1", "> 0"]),
    ("--lr", "1e308", ["--lr", "<= 1"]),
    ("--epochs", "0", ["--epochs", ">= 1"]),
    ("--batch-size", "-3", ["--batch-size", ">= 1"]),
    ("--problems", "0", ["--problems", ">= 1"]),
])
def test_sft_refuses_a_value_out_of_range(capsys, tmp_path, flag, value, names):
    # old: --lr nan: NaN weights refused at the checkpoint (ValueError traceback); --lr -1: torch's ValueError traceback
    demos = tmp_path / "demos.jsonl"
    demos.write_text('{"role": "agent", "messages": "What is 2+2?", "completion": "Answer: 4"}\n')
    rc, err = run_cli(capsys, "sft", "model=tiny-random", f"run.dir={tmp_path}", "task.name=math.solve",
                      "task.source=generated_easy", "task.num_problems=4", "task.test_size=1", "workflow.name=single",
                      "run.progress=false", "policy.lora.r=4", "--data", str(demos), "--epochs", "1", flag, value)
    assert_one_line_error(rc, err, *names)


def test_an_argument_error_is_one_line(capsys):
    rc, err = run_cli(capsys, "eval", "--limit")
    assert_one_line_error(rc, err, "--limit", "expected one argument")


# ---- H12: teamrl serve's address, port, threads and ready file -----------------------------------------------

@pytest.fixture
def busy_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def no_model(monkeypatch):
    """``teamrl serve`` must refuse its arguments before the model loads."""
    from teamrl.rollout import server

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(server, "ModelServer", refuse)


def _serve_cases(tmp_path: Path, busy: int) -> list[tuple[list[str], list[str]]]:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    return [
        (["--port", "99999"], ["--port", "99999", "<= 65535"]),
        (["--port", "-1"], ["--port", ">= 0"]),
        (["--port", str(busy)], ["--port", str(busy), "in use", "0"]),
        (["--host", "192.0.2.1"], ["--host", "192.0.2.1", "not an address of this machine"]),
        (["--host", "no-such-host.invalid"], ["--host", "no-such-host.invalid", "cannot be resolved"]),
        (["--threads", "-2"], ["--threads", ">= 0"]),
        (["--seed", str(2 ** 70)], ["--seed", "<= 9223372036854775807"]),
        (["--ready-file", str(blocker / "ready")], ["--ready-file", str(blocker / "ready"), "cannot be written"]),
        (["--ready-file", str(tmp_path)], ["--ready-file", str(tmp_path), "a folder"]),
    ]


@pytest.mark.parametrize("case", range(9))
def test_serve_refuses_bad_arguments_before_loading_the_model(capsys, tmp_path, busy_port, no_model, case):
    # old: OverflowError (port 99999), OSError (port in use, foreign host), socket.gaierror (bad host name),
    # RuntimeError (--threads -2), FileNotFoundError/NotADirectoryError (ready file): tracebacks, after the model loaded
    args, names = _serve_cases(tmp_path, busy_port)[case]
    rc, err = run_cli(capsys, "serve", "--model", "tiny-random", *args)
    assert_one_line_error(rc, err, *names)


def test_a_gateway_port_in_use_is_one_line(busy_port):
    # old: OSError [Errno 98] Address already in use, a traceback
    from teamrl.core.config import InputError
    from teamrl.rollout.gateway import Gateway, GatewayOptions

    with pytest.raises(InputError, match=f"127.0.0.1:{busy_port}.*in use.*0"):
        Gateway(GatewayOptions(port=busy_port)).start()


def test_a_gateway_port_in_use_is_one_line_from_the_cli(capsys, tmp_path, busy_port):
    rc, err = run_cli(capsys, *tiny_train(tmp_path, "--plugin", str(ROOT / "examples" / "openai_team.py"),
                                          "task={name: math.solve, source: generated_easy, num_problems: 4, test_size: 1}",
                                          "workflow.name=openai_team", "policy.mode=lora_per_role",
                                          f"workflow.options={{port: {busy_port}}}"))
    assert_one_line_error(rc, err, f"127.0.0.1:{busy_port}", "in use")


# ---- H12: --resume of a run with other settings; checkpoint files of the wrong content ------------------------

@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A run directory with one checkpoint (tiny-random, LoRA r 16), trained once for the module."""
    from teamrl.cli import main

    base = tmp_path_factory.mktemp("trained")
    assert main(tiny_train(base, "name=run", "run.log_episodes=false")) == 0
    return base


@pytest.fixture
def run_copy(trained_run, tmp_path):
    import shutil

    shutil.copytree(trained_run, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _last_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "run" / "checkpoints").glob("step_*"))[-1]


@pytest.mark.parametrize("override, names", [
    ("model=tiny-random-wide", ["model", "'tiny-random-wide'", "'tiny-random'", "config.yaml"]),
    ("policy.lora.r=8", ["policy.lora.r", "8", "16", "config.yaml"]),
    ("policy.lora=null", ["policy.lora", "None", "config.yaml"]),
])
def test_resume_with_other_model_settings_is_one_line(capsys, run_copy, override, names):
    # old: RuntimeError size mismatch / KeyError: checkpoint has weights the model lacks (tracebacks)
    rc, err = run_cli(capsys, *tiny_train(run_copy, "name=run", "train.steps=2", "--resume", override))
    assert_one_line_error(rc, err, "--resume", *names)


def test_resume_with_another_rank_and_no_config_names_the_tensor(capsys, run_copy):
    (run_copy / "run" / "config.yaml").unlink()  # only the checkpoint's own tensors say what it was trained with
    rc, err = run_cli(capsys, *tiny_train(run_copy, "name=run", "train.steps=2", "--resume", "policy.lora.r=8"))
    assert_one_line_error(rc, err, "policy_shared.pt", "lora_A", "[16, 64]", "[8, 64]")


@pytest.mark.parametrize("content, names", [
    ([1, 2, 3], ["trainer_state.pt", "a list", "step"]),
    ({"step": 1}, ["trainer_state.pt", "data_position"]),
    ({"step": 1, "data_position": 0, "rng": {"python": 3}}, ["trainer_state.pt", "rng"]),
    ({"step": "one", "data_position": 0, "rng": {}}, ["trainer_state.pt", "step", "'one'"]),
])
def test_a_trainer_state_of_the_wrong_content_is_one_line(capsys, run_copy, content, names):
    # old: TypeError list indices / KeyError 'rng' / TypeError cannot unpack (tracebacks)
    import torch

    torch.save(content, _last_checkpoint(run_copy) / "trainer_state.pt")
    rc, err = run_cli(capsys, *tiny_train(run_copy, "name=run", "train.steps=2", "--resume"))
    assert_one_line_error(rc, err, *names)


@pytest.mark.parametrize("how", ["shape", "missing", "not a mapping"])
def test_a_policy_file_of_the_wrong_content_is_one_line(capsys, run_copy, how):
    # old: RuntimeError The size of tensor a (64) must match ... (shape); missing weights were silently not restored
    import torch

    f = _last_checkpoint(run_copy) / "policy_shared.pt"
    weights = torch.load(f)
    name = next(k for k in weights if "lora_A" in k)
    if how == "shape":
        weights[name] = torch.zeros(3, 5)
        names = [str(f), name, "[3, 5]", "[16, 64]"]
    elif how == "missing":
        del weights[name]
        names = [str(f), name, "lacks"]
    else:
        weights = [1, 2]
        names = [str(f), "tensor"]
    torch.save(weights, f)
    rc, err = run_cli(capsys, *tiny_train(run_copy, "name=run", "train.steps=2", "--resume"))
    assert_one_line_error(rc, err, *names)


def test_eval_of_a_checkpoint_with_a_tensor_of_the_wrong_shape_is_one_line(capsys, run_copy):
    import torch

    f = _last_checkpoint(run_copy) / "policy_shared.pt"
    weights = torch.load(f)
    name = next(k for k in weights if "lora_B" in k)
    weights[name] = torch.zeros(2, 2)
    torch.save(weights, f)
    rc, err = run_cli(capsys, "eval", "--checkpoint", str(run_copy / "run"), "--method", "team", "--limit", "1")
    assert_one_line_error(rc, err, str(f), name, "[2, 2]")


def test_resume_with_the_same_settings_still_works(capsys, run_copy):
    rc, err = run_cli(capsys, *tiny_train(run_copy, "name=run", "train.steps=2", "--resume", "policy.lora.alpha=8"))
    assert rc == 0, err
