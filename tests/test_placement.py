"""Policy placement (``policy.placement``): every algorithm with its policies as Ray actors trains exactly as in the
driver's process; roles placed on the nodes the config names; a dead worker fails clearly, resume continues; a dead
driver leaves no actors behind.

One Ray cluster for the module: two local nodes (``ray.cluster_utils.Cluster``) with custom resources ``node_a`` and
``node_b``, tiny models, one thread everywhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from teamrl.core.config import ConfigError, load_config
from teamrl.tasks import TASKS
from teamrl.trainer.trainer import Trainer
from tests.test_algorithm_resume import LogEnv
from tests.test_magrpo import ToyTeam
from tests.test_mgrpo import ScriptedResearch

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["model=tiny-random", "threads=1", "rollout.max_new_tokens=8", "rollout.batch_size=2", "rollout.group_size=3",
          "policy.lora.r=4", "train.lr=0.01", "train.steps=2", "run.progress=false", "run.tensorboard=false",
          "run.log_episodes=false", "policy.ray_timeout_s=120"]
# algorithm -> its overrides on a tiny task whose rewards vary (so that the weights move)
SETUPS = {
    "grpo": ["algorithm=grpo", "task.name=word_count"],
    "magrpo": ["algorithm=magrpo", "task.name=toy_team", "policy.mode=lora_per_role"],
    "at_grpo": ["algorithm=at_grpo", "task.name=log_env", "at_grpo.select=random", "policy.mode=separate"],
    # both M-GRPO agents' adapters on one worker, sharing its base
    "m_grpo": ["algorithm=m_grpo", "task={name: research_scripted, num_problems: 4, max_sub_calls: 3, max_sub_turns: 2}",
               "m_grpo.d_max=2", "policy.mode=lora_per_role"],
    "workflow": ["task={name: math.solve, source: generated_easy, num_problems: 8, test_size: 2}", "workflow.name=voting",
                 "workflow.options.num_generators=2", "workflow.reward=tests.test_placement:token_parity", "policy.mode=lora_per_role"],
}
# placement ray: the overrides on top of SETUPS (MAGRPO's two roles on two nodes; M-GRPO's two adapters on one worker)
RAY = {
    "magrpo": ["policy.resources={short: {num_cpus: 1, resources: {node_a: 1}}, long: {num_cpus: 1, resources: {node_b: 1}}}"],
    "m_grpo": ["policy.workers={base: [main, sub]}"],
}


def token_parity(sample, outcome) -> float:
    """A reward that varies on a tiny random model (the workflow test's ``workflow.reward``)."""
    return (sum(sample.completion_ids) % 7) / 6


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on this machine: the head with resource ``node_a``, a second with ``node_b``; this process connected."""
    from ray.cluster_utils import Cluster

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1}, "include_dashboard": False})
    node_b = c.add_node(num_cpus=2, resources={"node_b": 1})
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield {"address": c.address, "node_a": c.head_node.node_id, "node_b": node_b.node_id}
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture
def tasks(monkeypatch):
    for name, cls in (("toy_team", ToyTeam), (LogEnv.name, LogEnv), (ScriptedResearch.name, ScriptedResearch)):
        monkeypatch.setitem(TASKS, name, cls)


def _cfg(tmp_path, algorithm, *extra):
    return load_config(None, [*COMMON, *SETUPS[algorithm], f"run.dir={tmp_path}", *extra])


def _run(cfg, steps=2):
    """``steps`` iterations; (trainer, records, initial weights, trained weights from the workers)."""
    tr = Trainer(cfg)
    initial = {n: {k: v.clone() for k, v in p.named_state().items()} for n, p in tr.router.policies.items()}
    records = [tr.train_step() for _ in range(steps)]
    trained = {n: tr.learner.state(n)[0] for n in tr.router.policies}
    return tr, records, initial, trained


@pytest.mark.parametrize("algorithm", sorted(SETUPS))
def test_ray_placement_equals_local(cluster, tasks, tmp_path, algorithm):
    _, rec_local, initial, w_local = _run(_cfg(tmp_path, algorithm, "name=local"))
    # the weights moved, so that the comparison below is not vacuous
    for name, weights in w_local.items():
        assert any(not torch.equal(initial[name][k], v) for k, v in weights.items()), (algorithm, name)
    tr, rec_ray, _, w_ray = _run(_cfg(tmp_path, algorithm, "name=ray", "policy.placement=ray", *RAY.get(algorithm, [])))
    try:
        keys = [k for k in rec_local[-1] if k.startswith(("loss/", "grad_norm/", "reward_mean", "completion_len"))]
        assert sum(k.startswith("loss/") for k in keys) == len(w_local)
        for a, b in zip(rec_local, rec_ray):
            for k in keys:
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (algorithm, a["step"], k)
        for name in w_local:
            driver_copy = tr.router.policies[name].named_state()  # what the next rollout samples with
            for k, v in w_local[name].items():
                assert torch.allclose(w_ray[name][k], v, rtol=1e-5, atol=1e-6), (algorithm, name, k)
                assert torch.equal(driver_copy[k], w_ray[name][k]), (algorithm, name, k)
        where = tr.learner.where()
        assert all(d["pid"] != os.getpid() for d in where.values())  # the policies trained in other processes
        if algorithm == "magrpo":  # the roles on the nodes the config named
            assert {w: d["node_id"] for w, d in where.items()} == {"short": cluster["node_a"], "long": cluster["node_b"]}
        if algorithm == "m_grpo":  # two adapters, one worker
            assert list(where) == ["base"] and tr.learner.worker_of == {"main": "base", "sub": "base"}
    finally:
        tr.shutdown()


def test_killed_worker_is_named_within_seconds_and_resume_reproduces_the_next_steps(cluster, tmp_path):
    from teamrl.trainer.learner import WorkerFailed

    def cfg(name, placement):
        return _cfg(tmp_path, "grpo", f"name={name}", "train.steps=3", "run.save_every=1", f"policy.placement={placement}")

    reference = Trainer(cfg("ref", "local")).train()
    cut = Trainer(cfg("cut", "ray"))
    cut.train_step()
    rollout = cut._rollout

    def rollout_then_kill(*args):  # the worker dies mid-step: after the rollout, before the update
        samples = rollout(*args)
        ray.kill(cut.learner.actors["shared"])
        return samples

    cut._rollout = rollout_then_kill
    t0 = time.perf_counter()
    with pytest.raises(WorkerFailed, match=r"policy worker 'shared' died .*--resume"):
        cut.train_step()
    assert time.perf_counter() - t0 < 10
    cut.shutdown()
    ckpts = sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir())
    assert ckpts == ["step_000001"]  # the last checkpoint, intact (no partial step 2)
    resumed = Trainer(cfg("cut", "ray"), resume=True)
    assert resumed.step == 1
    records = resumed.train()  # fresh actors; stops them at the end
    assert [r["step"] for r in records] == [1, 2, 3]
    keys = [k for k in reference[-1] if k.startswith(("loss/", "grad_norm/", "reward_mean", "completion_len"))]
    for step in (1, 2):
        for k in keys:
            assert records[step][k] == pytest.approx(reference[step][k], rel=1e-5, abs=1e-7), (step + 1, k)


def test_http_rollouts_sample_from_the_weights_the_ray_workers_trained(cluster, tmp_path):
    import threading

    from teamrl.rollout.server import ModelServer, TeamrlHTTPServer

    httpd = TeamrlHTTPServer(ModelServer("tiny-random", seed=0), "127.0.0.1", 0)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        local = Trainer(_cfg(tmp_path, "grpo", "name=local", "run.log_episodes=true"))
        served = Trainer(_cfg(tmp_path, "grpo", "name=served", "run.log_episodes=true", "policy.placement=ray",
                              "rollout.engine=http", f"rollout.server_url={httpd.url}"))
        for _ in range(2):
            a, b = local.train_step(), served.train_step()
            assert a["grad_norm/shared"] > 0  # the adapter moves, so step 2 tests the sync worker -> driver -> server
            assert b["loss/shared"] == pytest.approx(a["loss/shared"], rel=1e-5, abs=1e-7)
        served.shutdown()
    finally:
        httpd.shutdown()
        httpd.server_close()

    def episodes(name):
        lines = (tmp_path / name / "episodes" / "step_000002.jsonl").read_text().splitlines()
        return [(e["completion"], e["completion_tokens"]) for e in map(json.loads, lines)]

    assert episodes("served") == episodes("local")  # step 2 sampled from the adapter the worker trained


def test_a_worker_the_cluster_cannot_place_fails_naming_it_and_what_it_asked_for(cluster, tmp_path):
    from teamrl.trainer.learner import WorkerFailed

    cfg = _cfg(tmp_path, "grpo", "name=nowhere", "policy.placement=ray", "policy.ray_timeout_s=3",
               "policy.resources={shared: {num_cpus: 1, resources: {node_c: 1}}}")
    t0 = time.perf_counter()
    with pytest.raises(WorkerFailed, match=r"policy worker 'shared' did not start within policy.ray_timeout_s=3 s; it asks "
                                           r"Ray for \{'num_cpus': 1, 'resources': \{'node_c': 1\}\}"):
        Trainer(cfg)
    assert time.perf_counter() - t0 < 30


def test_a_dead_driver_leaves_no_actors(cluster, tmp_path):
    driver = textwrap.dedent(f"""
        import json, time, ray
        ray.init(address={cluster["address"]!r}, log_to_driver=False)
        from teamrl.core.config import load_config
        from teamrl.trainer.trainer import Trainer
        tr = Trainer(load_config(None, {[*COMMON, *SETUPS["grpo"], "policy.placement=ray", f"run.dir={tmp_path}", "name=orphan"]!r}))
        print(json.dumps({{w: d["pid"] for w, d in tr.learner.where().items()}}), flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    try:
        pids = json.loads(proc.stdout.readline())
        assert pids and all(_alive(p) for p in pids.values())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_alive(p) for p in pids.values()), f"actor processes {pids} outlived their driver"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_placement_config_is_checked_before_any_model_loads(tmp_path):
    with pytest.raises(ConfigError, match=r"policy.resources.shared.gpus: unknown key; allowed keys are \['num_cpus'"):
        load_config(None, ["policy.placement=ray", "policy.resources={shared: {gpus: 1}}"])
    with pytest.raises(ConfigError, match=r"policy.resources.shared.num_gpus: expected a number >= 0, got -1"):
        load_config(None, ["policy.resources={shared: {num_gpus: -1}}"])
    with pytest.raises(ConfigError, match=r"policy.workers: policy 'main' is on workers 'a' and 'b'"):
        load_config(None, ["policy.workers={a: [main], b: [main, sub]}"])
    with pytest.raises(ConfigError, match=r"policy.placement: 'gpu' is not allowed; choose one of \['local', 'ray'\]"):
        load_config(None, ["policy.placement=gpu"])
    # the former decoupled M-GRPO trainer is a placement now; its keys fail naming the ones that say it
    with pytest.raises(ConfigError, match=r"^m_grpo.decoupled was moved: write policy.mode=separate and policy.placement=ray"):
        load_config(None, ["algorithm=m_grpo", "task.name=research", "m_grpo.decoupled=ray"])
    with pytest.raises(ConfigError, match=r"^m_grpo.ray_timeout_s was moved: write policy.ray_timeout_s$"):
        load_config(None, ["algorithm=m_grpo", "task.name=research", "m_grpo.ray_timeout_s=7"])


def test_workers_that_name_unknown_policies_fail_naming_them(tmp_path, monkeypatch):
    from teamrl.trainer.learner import worker_groups

    monkeypatch.setitem(TASKS, "toy_team", ToyTeam)
    cfg = _cfg(tmp_path, "magrpo", "policy.workers={pair: [short, lng]}")
    with pytest.raises(ConfigError, match=r"policy.workers: policy 'lng' does not exist; the policies are \['short', 'long'\]"):
        worker_groups(cfg, ["short", "long"])
    cfg = _cfg(tmp_path, "magrpo", "policy.workers={pair: [short]}")
    with pytest.raises(ConfigError, match=r"policies \['long'\] are on no worker"):
        worker_groups(cfg, ["short", "long"])
    cfg = _cfg(tmp_path, "magrpo", "policy.resources={shrt: {num_cpus: 1}}")
    with pytest.raises(ConfigError, match=r"policy.resources: 'shrt' is not a worker; the workers are \['short', 'long'\]"):
        worker_groups(cfg, ["short", "long"])
