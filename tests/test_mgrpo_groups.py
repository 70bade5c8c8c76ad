"""M-GRPO's groups are the K rollouts (main) and the aligned sub-trajectories (sub), whatever their numbers of turns."""

import json

import pytest
import torch

from teamrl.algorithms import m_grpo as m_grpo_module
from teamrl.core.config import load_config
from teamrl.losses import group_advantages, trajectory_advantages, trajectory_ids
from teamrl.trainer.trainer import make_trainer
from teamrl.workflows.research_team import ResearchOutcome, SubCall

# per rollout (episode): main turns, main reward, turns of its one sub-agent call
PLAN = [(3, 1.0, 3), (1, 0.0, 1), (1, 0.0, 1), (1, 1.0, 1)]
ADV = 0.5 / (1 / 3) ** 0.5  # rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) -> +-0.866


async def scripted_team(ctx, env, problem):
    main_turns, reward, sub_turns = PLAN[ctx.episode]
    for turn in range(main_turns):
        await ctx.generate("main", "question", turn=turn)
    for turn in range(sub_turns):
        await ctx.generate_group("sub", "subtask", n=1, turn=turn, tags={"parent_episode": ctx.episode, "call": 0})
    return ResearchOutcome("a", True, reward, reward == 1.0, [SubCall("find", "found", True, sub_turns)])


@pytest.mark.parametrize("decoupled", [[], ["policy.mode=separate", "policy.placement=local"]], ids=["shared", "decoupled"])
def test_every_rollout_and_sub_trajectory_counts_once_in_its_group(tmp_path, monkeypatch, decoupled):
    monkeypatch.setattr(m_grpo_module, "research_team", scripted_team)
    cfg = load_config(None, ["algorithm=m_grpo", "task={name: research, num_problems: 2}", "model=tiny-random",
                             "rollout.group_size=4", "rollout.batch_size=1", "rollout.max_new_tokens=4", "policy.lora.r=4",
                             "threads=1", "m_grpo.d_max=1", "m_grpo.sub_reward=outcome", *decoupled,
                             f"run.dir={tmp_path}", "run.progress=false", "run.tensorboard=false", "name=g"])
    make_trainer(cfg).train_step()
    logged = [json.loads(line) for line in (tmp_path / "g" / "episodes" / "step_000001.jsonl").read_text().splitlines()]
    for role, column in (("main", 0), ("sub", 2)):
        own = [r for r in logged if r["role"] == role]
        assert len(own) == sum(p[column] for p in PLAN)  # every turn trained
        for r in own:
            expected = ADV if PLAN[r["episode"]][1] == 1.0 else -ADV
            assert r["advantage"] == pytest.approx(expected, abs=1e-3), (role, r["episode"], r["turn"], r["advantage"])


def test_trajectory_advantages_weigh_each_trajectory_once():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0])  # turns [3, 1, 1, 1] of four rollouts of one group
    groups = torch.zeros(6, dtype=torch.long)
    per_rollout = trajectory_advantages(rewards, groups, torch.tensor([0, 0, 0, 1, 2, 3]))
    assert per_rollout.tolist() == pytest.approx([ADV, ADV, ADV, -ADV, -ADV, ADV], abs=1e-3)
    for mode in ("group", "rloo", "batch", "mean"):  # one sample per trajectory: exactly group_advantages
        assert torch.equal(trajectory_advantages(rewards, groups, torch.arange(6), mode), group_advantages(rewards, groups, mode))
    assert trajectory_ids([3, None, 3, None]).tolist() == [0, 1, 0, 2]
    with pytest.raises(ValueError, match=r"rewards: sample 1 has 0.0 but sample 0 of its trajectory"):
        trajectory_advantages(torch.tensor([1.0, 0.0]), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
