import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from teamrl.core.config import load_config
from teamrl.core.metrics import read_metrics
from teamrl.trainer.trainer import RunExists, Trainer

TINY = ["model=tiny-random", "threads=1", "rollout.max_new_tokens=12", "rollout.batch_size=2", "rollout.group_size=4",
        "run.progress=false", "train.lr=1e-2", "policy.lora.r=4"]


def _cfg(tmp_path, *extra):
    return load_config(None, [*TINY, f"run.dir={tmp_path}", *extra])


def test_run_directory_holds_config_metrics_episodes_checkpoints(tmp_path):
    t = Trainer(_cfg(tmp_path, "name=r", "train.steps=3", "run.save_every=2"))
    metrics = t.train()
    d = tmp_path / "r"
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert yaml.safe_load((d / "config.yaml").read_text())["model"] == "tiny-random"
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    eps = [json.loads(line) for line in (d / "episodes" / "step_000001.jsonl").read_text().splitlines()]
    assert len(eps) == 2 * 4
    groups = {}
    for e in eps:
        groups.setdefault(e["group"], set()).add(e["problem_id"])
    assert len(groups) == 2 and all(len(v) == 1 for v in groups.values())  # no group spans two problems
    m = metrics[0]
    assert m["engine_calls"] == 1  # all 8 episodes went to the engine together
    assert 0 <= m["reward_mean"] <= 1 and m["grad_norm/shared"] > 0
    with pytest.raises(RunExists):
        Trainer(_cfg(tmp_path, "name=r", "train.steps=3"))


def test_advantages_sum_to_zero_per_group_and_max_mode_uses_greedy_baseline(tmp_path):
    t = Trainer(_cfg(tmp_path, "name=a", "train.steps=1"))
    t.train_step()
    eps = [json.loads(line) for line in (tmp_path / "a" / "episodes" / "step_000001.jsonl").read_text().splitlines()]
    by = {}
    for e in eps:
        by.setdefault(e["group"], []).append(e["advantage"])
    assert all(abs(sum(v)) < 1e-4 for v in by.values())
    t2 = Trainer(_cfg(tmp_path, "name=b", "train.steps=1", "train.advantage=max"))
    rec = t2.train_step()
    eps = [json.loads(line) for line in (tmp_path / "b" / "episodes" / "step_000001.jsonl").read_text().splitlines()]
    base = {e["group"]: e["reward"] for e in eps if e["baseline"]}
    assert len(base) == 2 and "greedy_reward_mean" in rec
    for e in eps:
        if not e["baseline"]:
            assert e["advantage"] == pytest.approx(e["reward"] - base[e["group"]], abs=1e-6)


def test_resume_after_kill_reproduces_the_next_steps(tmp_path):
    steps = 30
    ref = Trainer(_cfg(tmp_path, "name=ref", f"train.steps={steps}", "run.save_every=1", "run.log_episodes=false")).train()
    cmd = [sys.executable, "-m", "teamrl.cli", "train", *TINY, f"run.dir={tmp_path}", "name=killed",
           f"train.steps={steps}", "run.save_every=1", "run.log_episodes=false", "run.keep_checkpoints=100"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    ck = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 120
    while not (ck / "step_000002" / "trainer_state.pt").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    done = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert len(done) < steps, "the run finished before it could be killed"
    resumed = Trainer(_cfg(tmp_path, "name=killed", f"train.steps={steps}", "run.save_every=1", "run.log_episodes=false"), resume=True)
    start = resumed.step
    assert 2 <= start < steps
    after = resumed.train()
    assert [m["step"] for m in after] == list(range(1, steps + 1))  # no duplicated or missing steps
    keys = ("reward_mean", "loss/shared", "grad_norm/shared", "completion_len", "data_position")
    for k in keys:
        for s in range(start, min(start + 3, steps)):
            assert after[s][k] == pytest.approx(ref[s][k], rel=1e-5, abs=1e-6), (k, s + 1)


def test_a_step_logs_its_named_phases_and_weights_leave_the_learner_in_one_place(tmp_path):
    """fit()'s phases are timed in metrics.jsonl (timing/collect_s, learn_s, publish_s); every sync of new weights to an
    engine goes through WeightSync.publish (issue 45, items 1 and 2)."""
    import re
    from pathlib import Path

    from teamrl.core.config import load_config
    from teamrl.trainer.trainer import Trainer

    tr = Trainer(load_config(None, ["model=tiny-random", f"run.dir={tmp_path}", "name=phases", "train.steps=1",
                                    "rollout.group_size=2", "rollout.batch_size=1", "rollout.max_new_tokens=4",
                                    "run.progress=false", "run.tensorboard=false"]))
    (rec,) = tr.train()
    for phase in ("collect", "learn", "publish"):
        assert rec[f"timing/{phase}_s"] >= 0, rec
    assert rec["timing/learn_s"] + rec["timing/publish_s"] <= rec["update_s"] + 1e-9
    root = Path(__file__).resolve().parents[1] / "teamrl"
    callers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if re.search(r"\.sync_weights\(", p.read_text()) and "def sync_weights" not in p.read_text())
    assert callers == ["trainer/weight_sync.py"], callers


def test_weights_are_loaded_into_a_rollout_copy_in_one_place_per_kind():
    """grep: one weight-sync implementation per kind (issue 45): the driver copy is ``DriverCopy`` (the only load into
    the router rollouts sample from), the server upload is each engine's own ``sync_weights``, called by
    ``WeightSync`` and by the engines that wrap others without loading anything themselves: the collector's, and
    ``PolicyRoutes`` (one server per full-weight policy: the policy's own; a pool hands each endpoint's to a thread); the other loads are
    the learner's own weights (``PolicyWorker``) and a checkpoint restored into a router (``RouterStates``)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "teamrl"
    where: dict[str, set[str]] = {"load_named_state": set(), "sync_weights": set()}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            owner = node.name if isinstance(node, ast.ClassDef) else "<module>" if node is tree else None
            if owner is None:
                continue
            body = [n for n in node.body if not isinstance(n, ast.ClassDef)] if owner == "<module>" else node.body
            for call in (c for n in body for c in ast.walk(n)):
                if isinstance(call, ast.Call) and getattr(call.func, "attr", "") in where:
                    where[call.func.attr].add(f"{path.relative_to(root)}:{owner}")
    assert where == {"load_named_state": {"trainer/checkpoint.py:RouterStates", "trainer/learner.py:PolicyWorker",
                                          "trainer/weight_sync.py:DriverCopy"},
                     "sync_weights": {"trainer/weight_sync.py:WeightSync", "trainer/collector.py:StoppableEngine",
                                      "rollout/policy_routes.py:PolicyRoutes"}}, where
