"""examples/openai_team.py (a team written only against the `openai` package) trains through the gateway.

The training runs in a subprocess (the example registers its workflow; this process's registries stay clean).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "openai_team.py"
EXAMPLE_YAML = ROOT / "examples" / "openai_team.yaml"

# Trains 2 steps on the tiny model, recording what the engine sampled and what the rollouts recorded.
TRAIN = r'''
import json, sys
from teamrl.api import load_plugin, register_reward
from teamrl.core.config import load_config
from teamrl.trainer.trainer import Trainer

load_plugin(sys.argv[1])

@register_reward("token_parity")  # differs between samples of a random model, so advantages (and adapters) move
def token_parity(sample, outcome):
    return (sum(sample.completion_ids) % 7) / 6

cfg = load_config(sys.argv[2], sys.argv[4:] + [f"run.dir={sys.argv[3]}"])
trainer = Trainer(cfg)
sampled, recorded = [], []
generate_many = trainer.engine.generate_many
def recording_engine(calls):
    out = generate_many(calls)
    sampled.extend(c.token_ids for per_policy in out for per_request in per_policy for c in per_request)
    return out
trainer.engine.generate_many = recording_engine
rollout = trainer._rollout
def recording_rollout(*args):
    samples = rollout(*args)
    recorded.extend({"role": s.role, "policy": s.policy, "ids": s.completion_ids, "lp": s.sampling_logprobs} for s in samples)
    return samples
trainer._rollout = recording_rollout
trainer.train()
json.dump({"sampled": sampled, "recorded": recorded}, open(f"{sys.argv[3]}/trace.json", "w"))
'''


def test_the_example_is_plain_openai_code():
    tree = ast.parse(EXAMPLE.read_text())
    episode = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "episode")
    called = {n.func.attr for n in ast.walk(episode) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert "create" in called
    top_imports = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    assert top_imports == {"re", "sys", "openai"}  # teamrl only registers it, inside a try


def test_the_openai_team_trains_two_steps_through_the_gateway(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    done = subprocess.run([sys.executable, str(script), str(EXAMPLE), str(EXAMPLE_YAML), str(tmp_path),
                           "model=tiny-random", "train.steps=2", "rollout.group_size=4", "rollout.batch_size=2",
                           "rollout.max_new_tokens=6", "workflow.reward=token_parity", "policy.device=cpu", "train.lr=0.01",
                           "name=team", "run.progress=false", "run.tensorboard=false", "task.num_problems=16",
                           "task.test_size=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "teamrl gateway: serving episodes on http://127.0.0.1:" in done.stderr
    trace = json.loads((tmp_path / "trace.json").read_text())
    # 2 steps x 2 problems x 4 episodes x (solver, reviewer): every call recorded once, with the engine's own tokens
    assert len(trace["recorded"]) == 2 * 2 * 4 * 2
    assert sorted(map(tuple, (r["ids"] for r in trace["recorded"]))) == sorted(map(tuple, trace["sampled"]))
    assert {(r["role"], r["policy"]) for r in trace["recorded"]} == {("solver", "solver"), ("reviewer", "reviewer")}
    records = [json.loads(line) for line in (tmp_path / "team" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["episodes_dropped"] == 0 for r in records)
    ckpt = sorted((tmp_path / "team" / "checkpoints").iterdir())[-1]
    for name in ("solver", "reviewer"):  # LoRA B starts at zero: a non-zero B is an adapter that moved
        weights = torch.load(ckpt / f"policy_{name}.pt")
        assert [k for k, v in weights.items() if "lora_B" in k and v.abs().max() > 0], f"adapter {name!r} did not move"
