"""``train.advantage_scope``: agent-wise (each role's own comparison group, Dr. MAS's remedy, the default) or
team-wide (one group per problem pooling every role's samples, the global normalisation Dr. MAS compares with)."""


import pytest
import torch

from teamrl.core.config import ConfigError, load_config
from teamrl.core.sample import Sample
from teamrl.trainer.trainer import Trainer, comparison_keys


def _sample(problem, role, reward, turn=0):
    return Sample(role=role, policy="shared", problem_id=problem, prompt_ids=[1], completion_ids=[2], sampling_logprobs=[0.0],
                  turn=turn, reward=reward, group=(problem, role, turn))


def test_agent_scope_keeps_the_algorithms_groups_and_team_scope_pools_a_problems_roles():
    samples = [_sample("p0", "a", 1.0), _sample("p0", "b", 0.0, turn=1), _sample("p1", "a", 0.5)]
    assert comparison_keys(samples, "agent") == [("p0", "a", 0), ("p0", "b", 1), ("p1", "a", 0)]
    assert comparison_keys(samples, "team") == [("p0",), ("p0",), ("p1",)]
    with pytest.raises(ValueError, match="advantage_scope 'role'.*agent, team"):
        comparison_keys(samples, "role")


def test_team_scope_with_a_greedy_baseline_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="train.advantage_scope: team.*max"):
        load_config(None, ["model=tiny-random", "train.advantage=max", "train.advantage_scope=team", "rollout.group_size=1"])


def _trainer(tmp_path, scope):
    return Trainer(load_config(None, ["model=tiny-random", "threads=1", "run.progress=false", "policy.lora.r=4", "algorithm=grpo",
                                      "task.name=math.solve", "workflow.name=voting", f"train.advantage_scope={scope}",
                                      f"run.dir={tmp_path}", f"name={scope}"]))


def test_team_scope_normalises_over_the_problems_pooled_samples_and_agent_scope_per_role(tmp_path):
    """Per-role rewards that differ in distribution (generators often right, the aggregator rarely): agent-wise
    advantages are centred within each role's group; team-wide ones over every role's samples of the problem,
    with the pooled mean and std, so the often-right generators get positive advantages on average."""
    rewards = {"generator": [1.0, 1.0, 0.0, 1.0], "aggregator": [0.0, 1.0, 0.0, 0.0]}
    for scope in ("agent", "team"):
        samples = [_sample(p, role, r, turn=int(role == "aggregator")) for p in ("p0", "p1")
                   for role, rs in rewards.items() for r in rs]
        train = _trainer(tmp_path, scope)._assign_advantages(samples)
        assert len(train) == 16
        by_key: dict = {}
        for s in train:
            by_key.setdefault(s.problem_id if scope == "team" else s.group, []).append(s)
        assert len(by_key) == (2 if scope == "team" else 4)
        for members in by_key.values():
            r = torch.tensor([m.reward for m in members])
            adv = torch.tensor([m.advantage for m in members])
            assert torch.allclose(adv, (r - r.mean()) / (r.std() + 1e-4), atol=1e-5), scope
        generators = [s.advantage for s in train if s.role == "generator"]
        assert (sum(generators) > 0.5) == (scope == "team")  # agent-wise: each role's advantages sum to 0
