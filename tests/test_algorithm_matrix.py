"""Every shipped workflow x every algorithm: one scripted rollout, or the refusal (docs/algorithm_matrix.md is current).

The example's row (examples/proposer_critic_judge.py) is trained through ``teamrl train`` in a subprocess, so this
process never registers the example into the library's registries."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from teamrl.algorithms import make_algorithm
from teamrl.core.config import ConfigError, load_config
from teamrl.tasks import make_task
from tests.scripted import scripted_rollout
from tools.algorithm_matrix import ALGORITHM_ORDER, DOC, EXAMPLE, ROWS, overrides

ROOT = Path(__file__).resolve().parents[1]
TEAMRL = Path(sys.executable).parent / "teamrl"
LIBRARY_ROWS = [r for r in ROWS if r[1] != "proposer_critic_judge"]


def _doc_cell(label: str, algorithm: str) -> str:
    row = next(line for line in DOC.read_text().splitlines() if line.startswith(f"| {label} |"))
    return [c.strip() for c in row.strip("|").split("|")][1 + ALGORITHM_ORDER.index(algorithm)]


def _script(policy: str, prompt: str, n: int) -> list[str]:
    """Varied short texts; research's main agent answers, every other role states a number."""
    if "<answer>" in prompt:
        return [f"<answer>{j}</answer>" for j in range(n)]
    return [f"Answer: {j + len(prompt) % 3}" for j in range(n)]


@pytest.mark.parametrize("algorithm", ALGORITHM_ORDER)
@pytest.mark.parametrize("label, workflow, task", LIBRARY_ROWS, ids=[r[1] or r[2]["name"] for r in LIBRARY_ROWS])
def test_cell_runs_one_rollout_or_is_refused(label, workflow, task, algorithm):
    cfg = load_config(None, overrides(algorithm, workflow, task))
    task_obj = make_task(cfg.task)
    expected = _doc_cell(label, algorithm)
    try:
        algo = make_algorithm(cfg, task_obj)
    except ConfigError as e:
        assert expected == f"refused: {str(e).removeprefix('algorithm: ')}"
        return
    assert expected == "tested"
    samples = scripted_rollout(algo, task_obj.problems()[:2], task_obj, _script)
    trained = [s for s in samples if s.trainable and not s.baseline]
    assert trained, "no trainable sample"
    assert all(isinstance(s.reward, float) and math.isfinite(s.reward) for s in trained)
    groups: dict = {}
    for s in trained:
        assert s.group is not None
        groups.setdefault(s.group, []).append(s)
    assert all(len({(s.problem_id) for s in g}) == 1 for g in groups.values())  # a group never spans problems
    assert max(len(g) for g in groups.values()) >= 2  # something to compare
    roles = {s.role for s in trained}
    assert roles and all(isinstance(r, str) for r in roles)


def test_docs_matrix_is_current():
    done = subprocess.run([sys.executable, "-m", "tools.algorithm_matrix"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == DOC.read_text(), "docs/algorithm_matrix.md is stale: run python -m tools.algorithm_matrix --write"


@pytest.mark.parametrize("algorithm, extra", [("at_grpo", []), ("magrpo", ["policy.mode=lora_per_role"])])
def test_example_trains_with_another_algorithm_by_one_config_key(tmp_path, algorithm, extra):
    """examples/proposer_critic_judge.yaml trains with grpo (tests/test_extension_api.py); algorithm=<other> is the
    only change (plus the tiny model settings every example test uses; under magrpo one adapter per role, so that
    each role's optimizer steps are counted apart)."""
    done = subprocess.run([str(TEAMRL), "train", str(ROOT / "examples" / "proposer_critic_judge.yaml"), "--plugin", str(EXAMPLE),
                           f"algorithm={algorithm}", *extra, "model=tiny-random", "train.steps=1", "rollout.group_size=2",
                           "rollout.batch_size=1", "rollout.max_new_tokens=4", "policy.device=cpu", f"run.dir={tmp_path}",
                           "name=pcj", "run.progress=false", "run.tensorboard=false"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    (record,) = [json.loads(line) for line in (tmp_path / "pcj" / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and all(math.isfinite(v) for v in record.values() if isinstance(v, float))
    logged = [json.loads(line) for line in (tmp_path / "pcj" / "episodes" / "step_000001.jsonl").read_text().splitlines()]
    assert {r["role"] for r in logged} == {"proposer", "critic", "judge"}
    trained = [r for r in logged if r["trainable"]]
    if algorithm == "at_grpo":  # K=2 candidates per call, one group per (problem, turn, role)
        assert len(trained) == 6 and sum(bool(r["tags"].get("chosen")) for r in trained) == 3
        # the proposer and the critic get no reward before the judge: their candidates' episodes are played out
        assert {r["role"] for r in logged if r["tags"].get("rollout")} == {"critic", "judge"}
    else:  # MAGRPO: every role's first call branches: G proposals, G critiques under each, G verdicts under each of those
        # (before: only the proposer trained, optimizer_steps 0 for the critic and the judge)
        assert sorted(r["role"] for r in trained) == ["critic"] * 4 + ["judge"] * 8 + ["proposer"] * 2
        # each role's samples reached an update: a step, or one skipped because its samples carried no signal (the
        # tiny model's rewards may all be equal: no optimizer step from noise)
        assert all(record[f"optimizer_steps/{role}"] + record.get(f"skipped_no_signal/{role}", 0) == 1
                   for role in ("proposer", "critic", "judge"))
