"""The managed vLLM server (``rollout.engine=vllm``, teamrl/rollout/vllm_server.py), with a stand-in for vLLM
(tests/fake_vllm.py: vLLM's flags, then ``teamrl serve --strict vllm``): the flags it is started with, training
through it, no process left after the run, after SIGINT or after SIGKILL of the trainer, and one-line errors at
start-up. tests_vllm/ runs the same against the real vLLM (make test-vllm)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from teamrl.core.config import ConfigError, VllmConfig, load_config
from teamrl.rollout.completions_api import ServerError
from teamrl.rollout.vllm_server import (ManagedVLLMServer, check_lora_slots, check_served_model, death_reason,
                                        explain_lora_error, lora_rank_for, served_model_path)

REPO = Path(__file__).resolve().parents[1]
FAKE = Path(__file__).with_name("fake_vllm.py")


def processes_with(marker: str) -> list[int]:
    """Pids whose command line holds ``marker`` (zombies left out)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if marker.encode() in (d / "cmdline").read_bytes() and ") Z " not in (d / "stat").read_text():
                out.append(int(d.name))
        except OSError:
            pass
    return out


def alive(pid: int) -> bool:
    try:
        return ") Z " not in Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout  # only a bound on a broken run; each loop ends as soon as it can
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """tiny-random (seed 0) saved as a model folder: the managed server needs files."""
    from teamrl.policies.models import load_model

    model, tok = load_model("tiny-random", seed=0)
    folder = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The stand-in's record file and the marker of its engine-core child (through the environment teamrl passes on)."""
    marker = f"fake-vllm-core-{uuid.uuid4().hex}"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "record.json"))
    monkeypatch.setenv("FAKE_VLLM_MARKER", marker)
    yield tmp_path / "record.json", marker
    for pid in processes_with(marker):  # a failed test must not leave them either
        os.kill(pid, signal.SIGKILL)


def overrides(tmp_path: Path, folder: Path, *more: str) -> list[str]:
    return [f"model={folder}", "threads=1", "rollout.max_new_tokens=6", "rollout.batch_size=1", "rollout.group_size=2",
            "run.progress=false", "run.tensorboard=false", "run.log_episodes=false", "policy.lora.r=4",
            "policy.lora.target_modules=[q_proj,v_proj]", "train.steps=1", f"run.dir={tmp_path}", "rollout.engine=vllm",
            f"rollout.vllm.command=[{sys.executable}, {FAKE}]", *more]


def test_a_run_starts_the_server_with_the_flags_trains_and_leaves_no_process(tmp_path, tiny_folder, fake, capsys):
    from teamrl.trainer.trainer import Trainer

    record, marker = fake
    trainer = Trainer(load_config(None, overrides(tmp_path, tiny_folder, "name=managed")))
    server = trainer.vllm_server
    assert server.running and trainer.engine.dialect == "vllm" and trainer.engine.base_url == server.url
    got = json.loads(record.read_text())
    flags = [a for a in got["argv"] if a.startswith("--")]
    argv = {a: got["argv"][i + 1] for i, a in enumerate(got["argv"][:-1]) if a.startswith("--")}
    assert argv["--model"] == str(tiny_folder.resolve()) and argv["--served-model-name"] == str(tiny_folder)
    assert "--enable-lora" in flags and "--gpu-memory-utilization" not in flags  # a CPU run
    assert {k: argv[k] for k in ("--dtype", "--max-loras", "--logprobs-mode", "--host")} == {
        "--dtype": "float32", "--max-loras": "1", "--logprobs-mode": "processed_logprobs", "--host": "127.0.0.1"}
    assert argv["--max-lora-rank"] == "8"  # policy.lora.r=4, rounded up to a rank vLLM takes
    # issue 57 item 7: every managed server gets its own key, in its environment (not on the command line, which
    # every local user can read), and the rollouts send it
    key = got["env"].pop("VLLM_API_KEY", "")
    assert got["env"] == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": "2"}
    assert len(key) >= 32 and key == server.api_key == trainer.engine.api_key and key not in " ".join(got["argv"])
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}),
                       ("/v1/completions", {"model": str(tiny_folder), "prompt": [1, 2], "max_tokens": 1})):
        no_key = httpx.post(server.url + path, json=body, timeout=30)
        wrong = httpx.post(server.url + path, json=body, headers={"Authorization": "Bearer " + key[:-1]}, timeout=30)
        assert (no_key.status_code, wrong.status_code) == (401, 401), (path, no_key.text, wrong.text)
    assert processes_with(marker) and alive(got["pid"])
    trainer.train()
    err = capsys.readouterr().err
    assert "ready at " + server.url in err and f"vLLM server (pid {got['pid']}) stopped" in err
    assert "processes of its group left: none" in err
    assert not server.running and not alive(got["pid"]) and processes_with(marker) == []
    log = (tmp_path / "managed" / "vllm_server.log").read_text()  # the command teamrl ran, then the server's own output
    assert log.startswith("==== teamrl ") and f"--port {server.port}" in log and "listening on " + server.url in log


def _sigint_as_at_a_terminal() -> None:
    """In the child before exec: SIGINT's default action, whatever this process has. A background job of a
    non-interactive shell (`make test &`, nohup, some CI runners) starts with SIGINT ignored, every child inherits
    that, and Python then installs no KeyboardInterrupt handler: the trainer would never see the Ctrl-C sent."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_the_trainer_subprocess_gets_ctrl_c_even_where_this_process_ignores_it():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        out = subprocess.run([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT).__name__)"],
                             preexec_fn=_sigint_as_at_a_terminal, capture_output=True, text=True, check=True).stdout
    finally:
        signal.signal(signal.SIGINT, before)
    assert out.strip() == "default_int_handler"


def _train_in_a_subprocess(tmp_path: Path, folder: Path, record: Path, marker: str, name: str) -> subprocess.Popen:
    """``teamrl train`` with a stand-in that never answers, returned once its server and engine core run."""
    env = {**os.environ, "FAKE_VLLM_MODE": "hang", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "teamrl.cli", "train", *overrides(tmp_path, folder, f"name={name}")],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_sigint_as_at_a_terminal)
    wait_until(lambda: record.exists() and processes_with(marker) or proc.poll() is not None, 120, "the server did not start")
    assert proc.poll() is None, proc.communicate()[1]
    return proc


def test_sigkill_of_the_trainer_takes_the_server_and_its_children_down(tmp_path, tiny_folder, fake):
    """The guard gets the kernel's parent-death signal and ends the server's whole process group."""
    record, marker = fake
    proc = _train_in_a_subprocess(tmp_path, tiny_folder, record, marker, "killed")
    server_pid = json.loads(record.read_text())["pid"]
    proc.kill()
    proc.communicate(timeout=60)
    wait_until(lambda: not alive(server_pid) and not processes_with(marker), 30, "the server outlived a SIGKILLed trainer")


def test_ctrl_c_of_the_trainer_stops_the_server(tmp_path, tiny_folder, fake):
    record, marker = fake
    proc = _train_in_a_subprocess(tmp_path, tiny_folder, record, marker, "interrupted")
    server_pid = json.loads(record.read_text())["pid"]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "teamrl: interrupted (SIGINT)" in err and "Traceback" not in err, err
    assert f"vLLM server (pid {server_pid}) stopped" in err and "processes of its group left: none" in err
    assert not alive(server_pid) and processes_with(marker) == []


def test_a_server_that_dies_while_starting_is_named_in_one_line(tmp_path, fake, monkeypatch):
    record, marker = fake
    monkeypatch.setenv("FAKE_VLLM_MODE", "fail")
    server = ManagedVLLMServer(VllmConfig(command=[sys.executable, str(FAKE)]), "m", 1, 16, tmp_path / "vllm.log",
                               model_path=str(tmp_path))
    with pytest.raises(ServerError) as e:
        server.start(log=lambda line: None)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the vLLM server exited with status 1 while starting")
    assert "ValueError: LoRA rank 16 is not supported here" in msg and "(APIServer" not in msg and str(tmp_path / "vllm.log") in msg
    assert not server.running and processes_with(marker) == []


def test_start_up_errors_are_one_line_naming_the_key(tmp_path):
    def make(**settings):
        return ManagedVLLMServer(VllmConfig(**settings), "m", 2, 16, tmp_path / "log", model_path=str(tmp_path))

    with pytest.raises(ConfigError, match=r"^rollout.vllm.python: '/no/such/python' does not exist; run `make setup-vllm`"):
        make(python="/no/such/python")
    if subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode != 0:  # .venv has no vLLM
        with pytest.raises(ConfigError, match=r"^rollout.vllm.python: .* has no vllm package"):
            make(python=sys.executable)
    with pytest.raises(ConfigError, match=r"^rollout.vllm.command: 'no-such-vllm' is neither"):
        make(command=["no-such-vllm", "serve"])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"^rollout.vllm.port: 127.0.0.1:{port} is in use .*rollout.engine=http"):
            make(command=[sys.executable], port=port)
    with pytest.raises(ConfigError, match=r"^rollout.vllm.max_loras: 1 is fewer than this run's 2 policies"):
        make(command=[sys.executable], max_loras=1)
    with pytest.raises(ConfigError, match="built in memory"):
        served_model_path("tiny-random")
    with pytest.raises(ConfigError, match=r"^rollout.vllm.max_lora_rank: 16 is smaller than the adapters' rank policy.lora.r=32"):
        load_config(None, ["rollout.engine=vllm", "policy.lora.r=32", "rollout.vllm.max_lora_rank=16"])
    with pytest.raises(ConfigError, match=r"^rollout.vllm.max_lora_rank: 12 is not a rank vLLM takes"):
        load_config(None, ["rollout.engine=vllm", "rollout.vllm.max_lora_rank=12"])
    assert [lora_rank_for(r) for r in (1, 4, 8, 16, 17, 300)] == [1, 8, 8, 16, 32, 320]


class _Server:
    """What the flag checks read of a server: ``/v1/models`` and ``/metrics``."""

    base_url = "http://127.0.0.1:1"

    def __init__(self, models: list[dict], metrics: str | None) -> None:
        self.cards, self.metrics = models, metrics

    def model_cards(self) -> list[dict]:
        return self.cards

    def request(self, method: str, path: str, body=None):
        if self.metrics is None:
            raise ServerError(f"{method} {self.base_url}{path}: HTTP 404: Not Found")
        return self.metrics


def test_an_existing_servers_flags_are_checked_naming_the_flag():
    vllm = [{"id": "/models/smol", "parent": None}, {"id": "a@run-1", "parent": "/models/smol"}]
    with pytest.raises(ServerError, match=r"serves base model '/models/smol', not the config's model 'smollm2-135m': start vLLM "
                                          r"with --served-model-name smollm2-135m"):
        check_served_model(_Server(vllm, None), "smollm2-135m")
    check_served_model(_Server(vllm, None), "/models/smol")
    one_slot = '# TYPE vllm:lora_requests_info gauge\nvllm:lora_requests_info{max_lora="1",running_lora_adapters=""} 1.7e9\n'
    with pytest.raises(ServerError, match=r"started with --max-loras 1, fewer than this run's 2 policies \(tldr, summary\).*"
                                          r"--max-loras 2$"):
        check_lora_slots(_Server(vllm, one_slot), ["tldr", "summary"])
    assert check_lora_slots(_Server(vllm, one_slot.replace('"1"', '"2"')), ["tldr", "summary"]) == 2
    probed = []
    assert check_lora_slots(_Server(vllm, "no lora metrics yet"), ["a"], probe=lambda: probed.append(1)) is None
    assert probed == [1]  # the metric appears only once a request ran: one is sent
    assert check_lora_slots(_Server(vllm, None), ["a", "b"]) is None  # a server without /metrics (teamrl serve): no check
    rank = explain_lora_error(ServerError(  # vLLM 0.32's answer (tests_vllm/test_existing_server.py)
        "POST http://h/v1/load_lora_adapter: HTTP 500: Call to add_lora method failed: Worker failed with error 'LoRA rank "
        "32 is greater than max_lora_rank 16.', please check the stack trace above for the root cause"), 32)
    assert str(rank).endswith("start vLLM with --max-lora-rank 32 or more (policy.lora.r is 32)")
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in str(explain_lora_error(
        ServerError("POST http://h/v1/load_lora_adapter: HTTP 404: Not Found"), 8))
    other = ServerError("POST http://h/v1/completions: HTTP 500: boom")
    assert explain_lora_error(other, 8) is other


def test_death_reason_picks_the_exception_line():
    lines = ["INFO starting", "Traceback (most recent call last):", '  File "a.py"',
             "(EngineCore pid=12) RuntimeError: operator torchvision::nms does not exist", "Engine core initialization failed."]
    assert death_reason(lines) == "RuntimeError: operator torchvision::nms does not exist"
    assert death_reason(["only this"]) == "only this"
    pydantic = ["    s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)",
                "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
                "  Value error, User-specified max_model_len (100000) is greater than the derived max_model_len",
                "    For further information visit https://errors.pydantic.dev/2.14/v/value_error"]
    assert death_reason(pydantic) == ("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig "
                                      "Value error, User-specified max_model_len (100000) is greater than the derived "
                                      "max_model_len")  # as vLLM 0.32 dies with --max-model-len 100000


def test_a_key_the_user_gives_is_the_one_sent():
    """vLLM takes --api-key (rollout.vllm.extra_args) over VLLM_API_KEY (rollout.vllm.env): teamrl sends that one."""
    from teamrl.rollout.vllm_server import GUARDED_LAUNCHER  # noqa: F401  (the default launcher exists)

    made = ManagedVLLMServer(VllmConfig(command=[sys.executable]), "m", 1, 8, "/tmp/x.log")
    env = ManagedVLLMServer(VllmConfig(command=[sys.executable], env={"VLLM_API_KEY": "from-env"}), "m", 1, 8, "/tmp/x.log")
    flag = ManagedVLLMServer(VllmConfig(command=[sys.executable], env={"VLLM_API_KEY": "from-env"},
                                        extra_args=["--api-key", "from-flag"]), "m", 1, 8, "/tmp/x.log")
    assert len(made.api_key) >= 32 and made.environment()["VLLM_API_KEY"] == made.api_key
    assert (env.api_key, flag.api_key) == ("from-env", "from-flag")
