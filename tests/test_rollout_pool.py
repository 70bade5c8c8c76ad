"""A pool of rollout endpoints (teamrl/rollout/pool.py, issue 32 item 3): requests spread deterministically over
the endpoints, every endpoint synced and verified after each update, GRPO and MAGRPO through two servers (and GRPO
with rollout.max_staleness=1), managed servers placed by Ray on two local nodes, and a killed endpoint named within
seconds (the run continues on the rest of the pool, or stops in one line).

Servers: `teamrl serve --strict vllm` in threads of this process (tests/test_vllm_contract.py's strict_server) where
nothing needs killing, and managed stand-ins for vLLM (tests/fake_vllm.py, own processes) where a process is killed
or placed by Ray."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from teamrl.core.config import ConfigError, load_config
from teamrl.rollout.completions_api import ServerUnreachable
from teamrl.rollout.engine import Completion, Engine, GenerationRequest
from teamrl.rollout.http_engine import HTTPEngine
from teamrl.rollout.pool import EndpointFailed, EnginePool, spread
from teamrl.tasks import TASKS
from tests.test_magrpo import ToyTeam
from tests.test_vllm_contract import strict_server
from tests.test_vllm_server import FAKE, alive, processes_with, tiny_folder, wait_until  # noqa: F401 (a fixture)

COMMON = ["model=tiny-random", "threads=1", "rollout.max_new_tokens=6", "rollout.batch_size=2", "rollout.group_size=2",
          "run.progress=false", "run.tensorboard=false", "run.log_episodes=false", "train.lr=5e-2", "policy.lora.r=4",
          "policy.lora.target_modules=[q_proj,v_proj]", "train.steps=2"]
SETUPS = {"grpo": ["algorithm=grpo", "task.name=word_count"],
          "magrpo": ["algorithm=magrpo", "task.name=toy_team", "policy.mode=lora_per_role"]}


# ---- spreading: deterministic, groups kept whole (no server) ---------------------------------------------------

class Recorder(Engine):
    """An engine that answers with (endpoint, seed, prompt) in the text and records its calls; ``fail``: raise it."""

    def __init__(self, name: str, fail: BaseException | None = None) -> None:
        self.name, self.fail, self.calls = name, fail, []

    def generate(self, policy, requests, seed=None):
        self.calls.append((policy, [r.prompt_ids[0] for r in requests], seed))
        if self.fail is not None:
            raise self.fail
        return [[Completion([r.prompt_ids[0], j], [0.0, 0.0], f"{self.name}:{seed}:{r.prompt_ids[0]}", "eos")
                 for j in range(r.n)] for r in requests]


def _requests(groups: int, size: int) -> list[GenerationRequest]:
    """``groups`` prompts, each ``size`` times (a GRPO group), interleaved so that a group's copies are not adjacent."""
    return [GenerationRequest([10 + g, 1]) for _ in range(size) for g in range(groups)]


def test_spreading_is_deterministic_and_keeps_each_group_on_one_endpoint():
    reqs = _requests(5, 3)
    plan = spread(reqs, 7, ["a", "b"])
    assert plan == spread(reqs, 7, ["a", "b"])  # same seed, same endpoints: same assignment and seeds
    prompts = [{reqs[i].prompt_ids[0] for i in idx} for _, idx, _ in plan]
    assert sum(len(p) for p in prompts) == len(set().union(*prompts)) == 5  # a group's copies all on one endpoint
    assert sorted(i for _, idx, _ in plan for i in idx) == list(range(15))
    assert len({s for _, _, s in plan}) == 2  # each chunk its own seed
    assert spread(reqs, 7, ["a", "b", "c"]) != plan  # the samples depend on the number of endpoints
    assert [ep for ep, _, _ in spread(reqs[:1], 0, ["a", "b"])] != [ep for ep, _, _ in spread(reqs[:1], 1, ["a", "b"])]

    engines = [Recorder("a"), Recorder("b")]
    first = EnginePool(engines).generate("p", reqs, seed=7)
    again = EnginePool([Recorder("a"), Recorder("b")]).generate("p", reqs, seed=7)
    assert [[c.text for c in r] for r in first] == [[c.text for c in r] for r in again]
    assert all(c.text.endswith(f":{reqs[i].prompt_ids[0]}") for i, r in enumerate(first) for c in r)  # answers in order
    assert engines[0].calls and engines[1].calls


def test_generate_many_sends_every_policys_chunks_and_answers_as_generate_would():
    reqs = _requests(4, 2)
    many = EnginePool([Recorder("a"), Recorder("b")]).generate_many([("p", reqs, 1), ("q", reqs[:3], 2)])
    one = EnginePool([Recorder("a"), Recorder("b")])
    assert [[c.text for c in r] for r in many[0]] == [[c.text for c in r] for r in one.generate("p", reqs, 1)]
    assert [[c.text for c in r] for r in many[1]] == [[c.text for c in r] for r in one.generate("q", reqs[:3], 2)]


def test_a_failed_endpoint_is_named_and_its_share_resent():
    lines = []
    dead = Recorder("b", fail=ServerUnreachable("x", reason="POST /v1/completions: [Errno 111] Connection refused"))
    pool = EnginePool([Recorder("a"), dead], names=["http://a", "http://b"], log=lines.append)
    out = pool.generate("p", _requests(4, 2), seed=3)
    assert all(c.text.startswith("a:") for r in out for c in r) and len(out) == 8
    assert lines == ["rollout endpoint 2 of 2 (http://b) failed: POST /v1/completions: [Errno 111] Connection refused; "
                     "continuing on 1 endpoint"]
    assert pool.metrics() == {"pool/endpoints_live": 1.0, "pool/endpoints": 2.0}
    calls = len(dead.calls)
    pool.generate("p", _requests(4, 2), seed=4)
    pool.sync_weights("p")
    assert len(dead.calls) == calls  # a dead endpoint gets no more requests


def test_a_hung_endpoint_is_named_by_its_health_probes(monkeypatch):
    """A host that is gone refuses nothing: the request would wait for its whole timeout. The pool probes /health of
    an endpoint a call waits on and gives it up after PROBE_FAILURES failed probes."""
    import teamrl.rollout.pool as pool_mod

    monkeypatch.setattr(pool_mod, "PROBE_AFTER_S", 0.2)
    monkeypatch.setattr(pool_mod, "PROBE_EVERY_S", 0.2)
    release = threading.Event()

    class Hung(Recorder):
        def generate(self, policy, requests, seed=None):
            release.wait(30)
            return super().generate(policy, requests, seed)

        def health(self, timeout):
            raise ServerUnreachable("x", reason="GET /health: timed out")

    lines = []
    pool = EnginePool([Recorder("a"), Hung("b")], names=["http://a", "http://b"], log=lambda x: lines.append((time.monotonic(), x)))
    t0 = time.monotonic()
    out = pool.generate("p", _requests(4, 1), seed=0)
    release.set()
    assert all(c.text.startswith("a:") for r in out for c in r)
    assert len(lines) == 1 and lines[0][0] - t0 < 5
    assert lines[0][1].startswith("rollout endpoint 2 of 2 (http://b) failed: no answer to GET /health 2 times in a row")


def test_a_managed_server_whose_process_exits_is_named_at_once():
    """A managed server's process exiting marks it dead without waiting for its request (or a health probe)."""
    release = threading.Event()

    class Stuck(Recorder):
        def generate(self, policy, requests, seed=None):
            release.wait(30)
            return super().generate(policy, requests, seed)

    lines, gone = [], []
    pool = EnginePool([Recorder("a"), Stuck("b")], names=["http://a", "http://b"], log=lambda x: lines.append(x),
                      exited=[None, lambda: "its process (pid 42) exited with status 137" if gone else None])
    threading.Timer(0.3, gone.append, args=[True]).start()
    t0 = time.monotonic()
    out = pool.generate("p", _requests(4, 1), seed=0)
    release.set()
    assert time.monotonic() - t0 < 2 and all(c.text.startswith("a:") for r in out for c in r)
    assert lines == ["rollout endpoint 2 of 2 (http://b) failed: its process (pid 42) exited with status 137; continuing on "
                     "1 endpoint"]


def test_stop_and_no_endpoint_left_are_one_line():
    refused = ServerUnreachable("x", reason="POST /v1/completions: [Errno 111] Connection refused")
    stop = EnginePool([Recorder("a"), Recorder("b", fail=refused)], names=["http://a", "http://b"], on_failure="stop")
    with pytest.raises(EndpointFailed) as e:
        stop.generate("p", _requests(4, 1), seed=0)
    assert str(e.value) == ("rollout endpoint 2 of 2 (http://b) failed: POST /v1/completions: [Errno 111] Connection "
                            "refused; stopping (rollout.on_endpoint_failure=stop)")
    gone = EnginePool([Recorder("a", fail=refused), Recorder("b", fail=ConnectionResetError("reset"))], names=["http://a", "http://b"])
    with pytest.raises(EndpointFailed) as e:
        gone.generate("p", _requests(4, 1), seed=0)
    msg = str(e.value)
    assert "\n" not in msg and "no rollout endpoint is left" in msg and "http://a" in msg and "http://b" in msg


class SlowRecorder(Recorder):
    """A Recorder whose answers take ``seconds``."""

    def __init__(self, name: str, seconds: float) -> None:
        super().__init__(name)
        self.seconds = seconds

    def generate(self, policy, requests, seed=None):
        time.sleep(self.seconds)
        return super().generate(policy, requests, seed)


def test_close_waits_for_the_calls_still_in_flight_when_the_pool_stopped():
    """A stop leaves the live endpoints' calls running on their threads; teamrl then exits. A daemon thread still
    inside native code when the interpreter ends takes the process down ('terminate called without an active
    exception', exit -6, seen in CI): close() lets them end first."""
    refused = ServerUnreachable("x", reason="POST /v1/completions: [Errno 111] Connection refused")
    slow = SlowRecorder("a", 1.0)
    pool = EnginePool([slow, Recorder("b", fail=refused)], names=["http://a", "http://b"], on_failure="stop")
    with pytest.raises(EndpointFailed):
        pool.generate("p", _requests(4, 1), seed=0)
    assert any(t.name == "teamrl-pool-endpoint1" for t in threading.enumerate())  # the slow call still runs
    pool.close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("teamrl-pool-endpoint")]


@pytest.mark.parametrize("answer", [b"", b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"status\""])
def test_an_answer_cut_off_is_an_unreachable_server(answer):
    """A server killed while answering closes the connection, with no answer or half of one. Half an answer raised
    http.client.IncompleteRead out of HTTPEngine.request before (a traceback, not a failed endpoint); no answer was
    already a ServerError (now ServerUnreachable, which the pool takes for a dead endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]

        def answer_and_close():
            conn, _ = s.accept()
            conn.recv(65536)
            conn.sendall(answer)
            conn.close()

        threading.Thread(target=answer_and_close, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(ServerUnreachable) as e:
            HTTPEngine(f"http://127.0.0.1:{port}", dialect="teamrl").health(timeout=5)
        assert time.monotonic() - t0 < 3
        assert e.value.reason == ("GET /health: IncompleteRead(9 bytes read, 91 more expected)" if answer else
                                  "GET /health: Remote end closed connection without response")


def test_config_errors_are_one_line():
    cases = {("rollout.engine=http", "rollout.server_urls=[http://a:1, 'http://a:1/']"): "rollout.server_urls: 'http://a:1' is listed twice",
             ("rollout.engine=http", "rollout.server_urls=[a:1]"): "rollout.server_urls[0]: 'a:1' must start with http://",
             ("rollout.engine=vllm", "rollout.vllm.spread=true"): "rollout.vllm.spread: true places the vLLM servers with Ray",
             ("rollout.engine=vllm", "rollout.vllm.resources={gpus: 1}"): "rollout.vllm.resources.gpus: unknown key",
             ("rollout.vllm.servers=0",): "rollout.vllm.servers: 0 is out of range",
             ("rollout.on_endpoint_failure=retry",): "rollout.on_endpoint_failure: 'retry' is not allowed"}
    for overrides, start in cases.items():
        with pytest.raises(ConfigError) as e:
            load_config(None, list(overrides))
        assert str(e.value).startswith(start) and "\n" not in str(e.value), str(e.value)


def test_servers_on_other_machines_need_a_shared_absolute_adapter_dir():
    from teamrl.rollout.vllm_placement import check_shared_adapter_dir

    check_shared_adapter_dir("", "10.0.0.1", ["10.0.0.1", "10.0.0.1"])  # one machine: the default works
    check_shared_adapter_dir("/shared/adapters", "10.0.0.1", ["10.0.0.2"])
    for relative in ("", "adapters"):
        with pytest.raises(ConfigError, match=r"^rollout.adapter_dir: .* cannot be read by the vLLM servers on other machines "
                                              r"\(10.0.0.2\): give an absolute folder"):
            check_shared_adapter_dir(relative, "10.0.0.1", ["10.0.0.1", "10.0.0.2"])


# ---- two `teamrl serve --strict vllm` endpoints ----------------------------------------------------------------

@pytest.fixture
def counted_servers():
    """Two vLLM-like servers (processed log-probs) in threads; each counts the rollout completions it served."""
    with strict_server("vllm", logprobs_mode="processed_logprobs") as a, strict_server("vllm", logprobs_mode="processed_logprobs") as b:
        counts = {}
        for s in (a, b):
            ms = s.model_server
            counts[s.url] = []

            def complete(body, _orig=ms.complete, _log=counts[s.url]):
                # a rollout's: not a check's probe (greedy, or EOS ignored), not the LoRA-slot probe of the base model
                if not body.get("ignore_eos") and body.get("temperature", 0) > 0 and body.get("model") != "tiny-random":
                    _log.append(body["model"])
                return _orig(body)

            ms.complete = complete
        yield (a, b), counts


def _trainer(tmp_path, algorithm, *extra):
    from teamrl.trainer.trainer import Trainer

    return Trainer(load_config(None, [*COMMON, *SETUPS[algorithm], f"run.dir={tmp_path}", *extra]))


@pytest.mark.parametrize("algorithm", ["grpo", "magrpo"])
def test_two_endpoints_train_and_each_is_synced_and_verified_every_step(counted_servers, tmp_path, monkeypatch, algorithm):
    monkeypatch.setitem(TASKS, "toy_team", ToyTeam)
    from teamrl.trainer.trainer import Trainer

    (a, b), counts = counted_servers
    references = []
    probe = Trainer._probe_logprobs

    def counted(self, policy, *args, **kwargs):
        references.append(policy)
        return probe(self, policy, *args, **kwargs)

    monkeypatch.setattr(Trainer, "_probe_logprobs", counted)
    trainer = _trainer(tmp_path, algorithm, "name=pool", "rollout.engine=http", f"rollout.server_urls=[{a.url},{b.url}]")
    policies = list(trainer.router.policies)
    assert isinstance(trainer.engine, EnginePool) and len(policies) == (2 if algorithm == "magrpo" else 1)
    try:
        for step in (1, 2):
            before = {u: len(c) for u, c in counts.items()}
            references.clear()
            rec = trainer.train_step()
            assert sorted(references) == sorted(policies)  # one reference forward per policy, shared by both endpoints
            assert rec["pool/endpoints_live"] == 2
            assert all(len(c) > before[u] for u, c in counts.items()), (step, counts)  # both endpoints sampled this step
            for name in policies:  # every endpoint synced and verified after the update
                assert rec[f"sync/{name}/endpoints_synced"] == 2
                assert rec[f"sync/{name}/endpoint1/max_logprob_gap"] < 1e-4 and rec[f"sync/{name}/endpoint2/max_logprob_gap"] < 1e-4
        for e in trainer.engine.engines:
            assert set(e.versions) == set(policies) and set(e.versions.values()) == {3}  # initial load + 2 updates
        served = {u: set(c) for u, c in counts.items()}
        assert served[a.url] == {f"{p}@{trainer.engine.engines[0].adapter_tag}" for p in policies}  # each its own adapter names
        assert served[b.url] == {f"{p}@{trainer.engine.engines[1].adapter_tag}" for p in policies}
    finally:
        trainer.shutdown()
    assert {m["id"] for m in a.model_server.list_models()["data"]} == {"tiny-random"}  # the run's adapters unloaded


def test_two_endpoints_with_max_staleness_1_train_only_samples_at_most_one_version_behind(counted_servers, tmp_path):
    """Issue 32's acceptance with a pool: rollout.max_staleness=1 on 2 endpoints; from the run directory's episodes,
    every sample of step s was sampled at most 1 update behind (s - 1 - policy_version <= 1; 1 does occur), and each
    group holds one version."""
    (a, b), counts = counted_servers
    trainer = _trainer(tmp_path, "grpo", "name=k1", "rollout.engine=http", f"rollout.server_urls=[{a.url},{b.url}]",
                       "rollout.max_staleness=1", "train.steps=4", "run.log_episodes=true")
    records = trainer.train()
    assert all(len(c) > 0 for c in counts.values())
    behind_seen = set()
    for step in range(1, 5):
        rows = [json.loads(x) for x in (tmp_path / "k1" / "episodes" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        behind = {step - 1 - r["policy_version"] for r in rows}
        assert behind <= {0, 1}, (step, behind)
        behind_seen |= behind
        versions: dict[str, set] = {}
        for r in rows:
            versions.setdefault(json.dumps(r["group"]), set()).add(r["policy_version"])
        assert all(len(v) == 1 for v in versions.values())
    assert 1 in behind_seen  # the producer did run ahead
    assert all(r["pool/endpoints_live"] == 2 and r["async/staleness_mean/shared"] <= 1 for r in records)


def test_stop_names_the_failed_endpoint_in_one_line(tmp_path):
    with strict_server("vllm", logprobs_mode="processed_logprobs") as a:
        b = strict_server("vllm", logprobs_mode="processed_logprobs")
        bs = b.__enter__()
        trainer = _trainer(tmp_path, "grpo", "name=stop", "rollout.engine=http", f"rollout.server_urls=[{a.url},{bs.url}]",
                           "rollout.on_endpoint_failure=stop")
        try:
            trainer.train_step()
            b.__exit__(None, None, None)  # endpoint 2 goes away: its port refuses connections
            t0 = time.monotonic()
            with pytest.raises(EndpointFailed) as e:
                trainer.train_step()
            assert time.monotonic() - t0 < 10
            msg = str(e.value)
            assert "\n" not in msg and msg.startswith(f"rollout endpoint 2 of 2 ({bs.url}) failed: ")
            assert "Connection refused" in msg and msg.endswith("; stopping (rollout.on_endpoint_failure=stop)")
        finally:
            trainer.shutdown()


def test_teamrl_train_stops_in_one_line_when_an_endpoint_goes(tmp_path):
    """The CLI: one line on stderr naming the endpoint, no traceback; exit status 1, as for any server failure during
    training (teamrl/cli.py)."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    with strict_server("vllm", logprobs_mode="processed_logprobs") as a:
        b = strict_server("vllm", logprobs_mode="processed_logprobs")
        bs = b.__enter__()
        args = [*COMMON, *SETUPS["grpo"], "train.steps=200", "run.save_every=1000", f"run.dir={tmp_path}", "name=cli",
                "rollout.engine=http", f"rollout.server_urls=[{a.url},{bs.url}]", "rollout.on_endpoint_failure=stop"]
        proc = subprocess.Popen([sys.executable, "-m", "teamrl.cli", "train", *args], cwd=repo, text=True,
                                env={**os.environ, "PYTHONPATH": str(repo)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        metrics = tmp_path / "cli" / "metrics.jsonl"
        try:
            wait_until(lambda: metrics.exists() and metrics.read_text().strip() or proc.poll() is not None, 120, "no step")
        finally:
            b.__exit__(None, None, None)  # after the first step: endpoint 2 goes away
        _, err = proc.communicate(timeout=120)
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in err, err[-2000:]
    assert last.startswith(f"teamrl: rollout endpoint 2 of 2 ({bs.url}) failed: ") and last.endswith(
        "; stopping (rollout.on_endpoint_failure=stop)")
    assert 1 <= len(metrics.read_text().splitlines()) < 200


# ---- managed servers: a kill -9 mid-run, and placement by Ray ----------------------------------------------------

@pytest.fixture
def marker(monkeypatch):
    """The marker of the stand-ins' engine-core children (none may be left)."""
    mark = f"fake-vllm-core-{uuid.uuid4().hex}"
    monkeypatch.setenv("FAKE_VLLM_MARKER", mark)
    yield mark
    for pid in processes_with(mark):
        os.kill(pid, signal.SIGKILL)


def _managed(tmp_path: Path, folder: Path, *more: str) -> list[str]:
    return [f"model={folder}", "threads=1", "rollout.max_new_tokens=6", "rollout.batch_size=2", "rollout.group_size=2",
            "run.progress=false", "run.tensorboard=false", "policy.lora.r=4", "policy.lora.target_modules=[q_proj,v_proj]",
            "train.steps=2", f"run.dir={tmp_path}", "rollout.engine=vllm", f"rollout.vllm.command=[{sys.executable}, {FAKE}]",
            "rollout.vllm.servers=2", "algorithm=grpo", "task.name=word_count", *more]


def test_a_killed_server_is_named_within_seconds_and_the_run_goes_on(tmp_path, tiny_folder, marker):  # noqa: F811
    from teamrl.trainer.trainer import Trainer

    trainer = Trainer(load_config(None, _managed(tmp_path, tiny_folder, "name=killed")))
    pool, servers = trainer.engine, trainer.vllm_servers
    assert isinstance(pool, EnginePool) and [s.log_path.name for s in servers] == ["vllm_server_1.log", "vllm_server_2.log"]
    assert len({s.port for s in servers}) == 2
    lines, killed = [], []
    pool.log = lambda line: lines.append((time.monotonic(), line))
    second = pool.endpoints[1].engine
    generate = second.generate

    def kill_then_generate(*args, **kwargs):  # SIGKILL the server in the middle of step 2's rollout
        if trainer.step == 1 and not killed:
            os.kill(servers[1].server_pid, signal.SIGKILL)
            killed.append(time.monotonic())
        return generate(*args, **kwargs)

    second.generate = kill_then_generate
    records = trainer.train()  # step 2 completes on endpoint 1; then the servers are stopped
    assert killed and len(lines) == 1, lines
    at, line = lines[0]
    print(f"endpoint 2 named {at - killed[0]:.2f} s after its server's SIGKILL: {line}")
    assert at - killed[0] < 10, at - killed[0]
    assert line.startswith(f"rollout endpoint 2 of 2 ({servers[1].url}) failed: ") and line.endswith("; continuing on 1 endpoint")
    assert [r["step"] for r in records] == [1, 2] and records[-1]["sync/shared/endpoints_synced"] == 1
    assert [r["pool/endpoints_live"] for r in records] == [2, 1]
    assert not pool.endpoints[1].live and pool.endpoints[0].live
    episodes = [json.loads(x) for x in (tmp_path / "killed" / "episodes" / "step_000002.jsonl").read_text().splitlines()]
    assert len(episodes) == 4  # every sample of step 2 sampled (on the endpoint left)
    wait_until(lambda: not any(s.running for s in servers) and not processes_with(marker), 30, "a server or its child was left")


@pytest.fixture(scope="module")
def local_ray():
    """Two Ray nodes on this machine (``ray.cluster_utils.Cluster``, 2 logical CPUs each), this process connected."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    c.add_node(num_cpus=2)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.mark.ray
def test_spread_needs_as_many_nodes_as_servers(tmp_path, local_ray):
    from teamrl.rollout.completions_api import ServerError
    from teamrl.rollout.vllm_placement import start_ray_servers

    cfg = load_config(None, ["policy.placement=ray", "policy.ray_timeout_s=2", "rollout.engine=vllm", "rollout.vllm.servers=3",
                             "rollout.vllm.spread=true", "rollout.vllm.resources={num_cpus: 0.5}"])
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        start_ray_servers(cfg, tmp_path, 1, log=lambda line: None)
    assert time.monotonic() - t0 < 30 and "\n" not in str(e.value)
    assert str(e.value).startswith("rollout.vllm.spread: Ray could not place 3 vLLM servers on 3 different nodes, each "
                                   "asking for {'num_cpus': 0.5}")


@pytest.mark.ray
def test_ray_places_the_managed_servers_and_a_killed_actor_takes_its_server_down(tmp_path, tiny_folder, local_ray):  # noqa: F811
    """Two stand-in servers, each started by its own Ray actor (policy.placement: ray), one per node (spread); the second
    actor is killed after step 1 (its server goes with it), the run goes on on the first; after the run both actors and
    servers are gone."""
    import ray

    from teamrl.trainer.trainer import Trainer

    mark = f"fake-vllm-core-{uuid.uuid4().hex}"
    trainer = Trainer(load_config(None, _managed(tmp_path, tiny_folder, "name=ray", "policy.placement=ray",
                                                 "policy.ray_timeout_s=120", f"rollout.vllm.env={{FAKE_VLLM_MARKER: {mark}}}",
                                                 "run.log_episodes=false", "rollout.vllm.spread=true",
                                                 "rollout.vllm.resources={num_cpus: 0.5}")))
    try:
        servers = list(trainer.vllm_servers)
        actors = [s.actor for s in servers]
        assert [s.index for s in servers] == [1, 2] and len({s.url for s in servers}) == 2
        assert all(s.node["pid"] != os.getpid() and s.node["main_thread"] for s in servers)
        assert all(s.url.startswith("http://127.0.0.1:") for s in servers)  # one machine
        assert len({s.node["node_id"] for s in servers}) == 2  # spread: one per node
        assert all(alive(s.server_pid) for s in servers) and len(processes_with(mark)) == 2
        trainer.train_step()
        t0 = time.monotonic()
        ray.kill(actors[1])
        wait_until(lambda: not alive(servers[1].server_pid), 30, "a killed actor left its server running")
        print(f"the server of the killed actor 2 was gone {time.monotonic() - t0:.2f} s after ray.kill")
        lines = []
        trainer.engine.log = lines.append
        rec = trainer.train_step()
        assert rec["sync/shared/endpoints_synced"] == 1
        assert len(lines) == 1 and lines[0].startswith(f"rollout endpoint 2 of 2 ({servers[1].url}) failed: ")
    finally:
        trainer.shutdown()
    for a in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(a.where.remote(), timeout=60)
    wait_until(lambda: not any(alive(s.server_pid) for s in servers) and not processes_with(mark), 30,
               "a server outlived the run")
