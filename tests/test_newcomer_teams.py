"""The two newcomer teams of issue 55 as shipped examples (examples/coder_critic.py, examples/orchestrator_workers.py):
each trains a GRPO step, calibrates and warm-starts (teamrl sft --self-play) through the CLI on the tiny model, and a
scripted player shows what each team's reward reads (the final program's printed value; the orchestrator's answer).

Plugins are loaded by ``teamrl`` subprocesses only: nothing registers into this process's registries."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TEAMRL = Path(sys.executable).parent / "teamrl"
TEAMS = {"coder_critic": ("coder", "critic"), "orchestrator_workers": ("orchestrator", "worker")}
TINY = ["model=tiny-random", "threads=1", "policy.lora.r=4", "rollout.max_new_tokens=8", "run.progress=false",
        "run.tensorboard=false"]

# Writes every role's reply from the problem's reference answer (math.solve, generated_easy): `play` makes the team
# right, `play_wrong_revision` has the coder's first program right and its revision wrong.
PLAYER = '''
from teamrl.tasks.solve import MathSolve, MathSolveOptions

ANSWERS = {p.data["question"]: p.data["answer"] for p in MathSolve(MathSolveOptions(source="generated_easy")).problems()}


def reply(role, messages, revision_offset):
    text = messages if isinstance(messages, str) else messages[-1]["content"]
    answer = int(next(a for q, a in ANSWERS.items() if q in text))
    if role == "coder":
        return f"```python\\nprint({answer + revision_offset if 'Your program' in text else answer})\\n```"
    if role == "critic":
        return "Looks right."
    if role == "orchestrator":
        return f"Answer: {answer}" if "reported" in text else "Worker: add\\nWorker: check it\\nWorker: check again"
    return f"Result: {answer}"


def play(role, messages):
    return reply(role, messages, 0)


def play_wrong_revision(role, messages):
    return reply(role, messages, 1)
'''


def _teamrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(TEAMRL), *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PATH": "/usr/bin:/bin",
                               "PYTHONPATH": str(ROOT)})  # this checkout's teamrl, whichever the venv installed


def _example(team: str) -> list[str]:
    return [f"examples/{team}.yaml", "--plugin", f"examples/{team}.py"]


@pytest.mark.parametrize("team", sorted(TEAMS))
def test_one_training_step_has_a_sample_of_every_role(tmp_path, team):
    done = _teamrl("train", *_example(team), *TINY, "train.steps=1", "rollout.batch_size=2", "rollout.group_size=2",
                   f"run.dir={tmp_path}", f"name={team}")
    assert done.returncode == 0, done.stderr[-2000:]
    episodes = tmp_path / team / "episodes"
    calls = [json.loads(line) for line in (episodes / "step_000001.jsonl").read_text().splitlines()]
    outcomes = [json.loads(line) for line in (episodes / "outcomes_000001.jsonl").read_text().splitlines()]
    assert len(outcomes) == 2 * 2  # batch_size problems x group_size episodes
    assert {c["policy"] for c in calls} == set(TEAMS[team])  # lora_per_role: one adapter per declared role
    per_episode = Counter((c["problem_id"], c["episode"]) for c in calls)
    assert len(per_episode) == len(outcomes)
    for role in TEAMS[team]:  # every role acted in every episode
        acted = {(c["problem_id"], c["episode"]) for c in calls if c["policy"] == role}
        assert acted == set(per_episode), (role, acted)
    records = [json.loads(line) for line in (tmp_path / team / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]


@pytest.mark.parametrize("team", sorted(TEAMS))
def test_calibrate_prints_its_table_with_the_free_text_role_not_judged(tmp_path, team):
    done = _teamrl("calibrate", *_example(team), *TINY, "--problems", "2", f"run.dir={tmp_path}",
                   "--out", str(tmp_path / "cal"))
    assert done.returncode == 0, done.stderr[-2000:]
    table = [[c.strip() for c in line.strip("|").split("|")] for line in done.stdout.splitlines()
             if line.startswith("| ")]
    valid = table[0].index("valid replies")
    rows = [r for r in table[1:] if r[0] == "as configured (G=4)"]
    assert [r[1] for r in rows] == ["team", *TEAMS[team]]
    free_text = rows[-1]  # the critic and the workers write free text: their workflow's formats say not to judge it
    assert free_text[valid] == "-", done.stdout
    assert (tmp_path / "cal" / "calibration.json").is_file()


@pytest.mark.parametrize("team", sorted(TEAMS))
def test_sft_self_play_warm_starts_every_role(tmp_path, team):
    done = _teamrl("sft", *_example(team), *TINY, "--self-play", "2", "--min-reward", "0", "--problems", "2",
                   "--epochs", "1", f"run.dir={tmp_path}", "name=warm")
    assert done.returncode == 0, done.stderr[-2000:]
    state = torch.load(tmp_path / "warm" / "checkpoints" / "step_000000" / "trainer_state.pt", weights_only=False)
    assert state["trained_on"]["kept"] == 4  # --min-reward 0 keeps every episode
    assert {p.name for p in (tmp_path / "warm" / "checkpoints" / "step_000000").glob("policy_*.pt")} == {
        f"policy_{role}.pt" for role in TEAMS[team]}


def _scripted(tmp_path: Path, team: str, player: str) -> subprocess.CompletedProcess:
    (tmp_path / "player.py").write_text(PLAYER)
    return _teamrl("sft", *_example(team), *TINY, "--self-play", "2", "--problems", "2", "--epochs", "1",
                   "--player", f"{tmp_path / 'player.py'}:{player}", f"run.dir={tmp_path}", "name=scripted")


@pytest.mark.parametrize("team, calls", [
    ("coder_critic", {"coder": 8, "critic": 4}),
    ("orchestrator_workers", {"orchestrator": 8, "worker0": 4, "worker1": 4, "worker2": 4}),  # the plan's 3 workers
])
def test_a_right_team_scores_1_on_every_episode(tmp_path, team, calls):
    done = _scripted(tmp_path, team, "play")  # --min-reward 1 (the default): only full successes are kept
    assert done.returncode == 0, done.stderr[-2000:]
    trained_on = torch.load(tmp_path / "scripted" / "checkpoints" / "step_000000" / "trainer_state.pt",
                            weights_only=False)["trained_on"]
    assert (trained_on["episodes"], trained_on["kept"], trained_on["calls_kept"]) == (4, 4, calls)


def test_the_coder_critic_reward_is_the_revised_programs_not_the_drafts(tmp_path):
    done = _scripted(tmp_path, "coder_critic", "play_wrong_revision")  # right draft, wrong revision: no success
    assert done.returncode == 2
    assert "none of the 4 episodes sampled reached --min-reward 1" in done.stderr, done.stderr[-2000:]
