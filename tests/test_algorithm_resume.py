"""Resume is bit-exact for AT-GRPO (random branch choice) and M-GRPO (trajectory alignment): their own RNG is checkpointed."""

from dataclasses import dataclass

import pytest
import torch

from teamrl.core.config import load_config
from teamrl.tasks import TASKS
from teamrl.tasks.environment import Environment
from teamrl.tasks.task import Problem
from teamrl.trainer.trainer import make_trainer
from tests.test_mgrpo import ScriptedResearch


class LogEnv(Environment):
    """One agent, two turns; the prompt shows every chosen text, so the branch chosen decides what comes next."""

    name = "log_env"
    roles = ("agent",)
    max_turns = 2

    @dataclass
    class Options:
        name: str = "log_env"

    def __init__(self, opts=None):
        pass

    def problems(self):
        return [Problem(f"p{i}") for i in range(4)]

    def reset(self, problem):
        return (problem.id,)

    def observe(self, state, role):
        return [{"role": "user", "content": " | ".join(state)}]

    def apply(self, state, role, text):
        return state + (text,), (len(text) % 5) / 5

    def team_reward(self, state):
        return 0.0

    def done(self, state):
        return False

COMMON = ["model=tiny-random", "threads=1", "rollout.max_new_tokens=6", "rollout.batch_size=2", "rollout.group_size=3",
          "policy.lora.r=4", "train.lr=1e-2", "run.progress=false", "run.tensorboard=false", "run.log_episodes=false",
          "run.save_every=1", "run.keep_checkpoints=10"]
SETUPS = {
    "at_grpo": ["algorithm=at_grpo", "task.name=log_env", "at_grpo.select=random"],
    "m_grpo": ["algorithm=m_grpo", "task={name: research_scripted, num_problems: 4, max_sub_calls: 3, max_sub_turns: 2}",
               "m_grpo.d_max=2"],
}
STEPS, CUT = 3, 1


@pytest.mark.parametrize("algorithm", sorted(SETUPS))
def test_resume_reproduces_the_next_steps_bit_exactly(tmp_path, monkeypatch, algorithm):
    monkeypatch.setitem(TASKS, ScriptedResearch.name, ScriptedResearch)
    monkeypatch.setitem(TASKS, LogEnv.name, LogEnv)

    def cfg(name, steps):
        return load_config(None, [*COMMON, *SETUPS[algorithm], f"run.dir={tmp_path}", f"name={name}", f"train.steps={steps}"])

    ref = make_trainer(cfg("ref", STEPS))
    ref_records = ref.train()
    make_trainer(cfg("cut", CUT)).train()  # a run stopped after step CUT, with its checkpoint
    saved = torch.load(tmp_path / "cut" / "checkpoints" / f"step_{CUT:06d}" / "trainer_state.pt", weights_only=False)
    assert saved["algorithm"] == {"calls": CUT}
    resumed = make_trainer(cfg("cut", STEPS), resume=True)
    assert resumed.step == CUT
    records = resumed.train()
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    keys = [k for k in ref_records[-1] if k.startswith(("loss/", "grad_norm/", "reward_mean", "sub_calls", "success_rate"))]
    assert any(k.startswith("loss/") for k in keys)
    for step in range(CUT, STEPS):
        for k in keys:
            assert records[step][k] == ref_records[step][k], (algorithm, step + 1, k)
    for name, policy in ref.router.policies.items():
        want, got = policy.named_state(), resumed.router.policies[name].named_state()
        assert all(torch.equal(want[k], got[k]) for k in want), name
