from dataclasses import dataclass

import pytest

from teamrl.algorithms.magrpo import (completion_returns, discounted_return, joint_indices)
from teamrl.core.config import load_config
from teamrl.tasks import TASKS
from teamrl.tasks.task import Problem, TeamTask
from teamrl.tasks.word_count import WordCountOptions, WordCountTask
from teamrl.trainer.trainer import Trainer


def test_joint_indices_aligned_and_cross():
    assert joint_indices(3, 2, "aligned") == [(0, 0), (1, 1), (2, 2)]
    cross = joint_indices(2, 3, "cross")
    assert len(cross) == 8 and cross[0] == (0, 0, 0) and cross[5] == (1, 0, 1)
    with pytest.raises(ValueError, match="aligned"):
        joint_indices(2, 2, "pairs")


def test_cross_return_is_the_mean_over_the_joint_actions_containing_it():
    joint = joint_indices(2, 2, "cross")  # (0,0) (0,1) (1,0) (1,1)
    r = [1.0, 0.0, 0.5, 0.25]
    got = completion_returns(joint, r, 2, 2)
    # agent 0: sample 0 in (0,0),(0,1) -> (1+0)/2; sample 1 in (1,0),(1,1) -> (0.5+0.25)/2
    # agent 1: sample 0 in (0,0),(1,0) -> (1+0.5)/2; sample 1 in (0,1),(1,1) -> (0+0.25)/2
    assert got == [[0.5, 0.375], [0.75, 0.125]]
    assert completion_returns(joint_indices(3, 2, "aligned"), [1.0, 2.0, 3.0], 3, 2) == [[1.0, 2.0, 3.0]] * 2


def test_discounted_return():
    assert discounted_return(1.0, [], 0.9) == 1.0
    assert discounted_return(1.0, [0.0, 1.0], 0.9) == pytest.approx(1.0 + 0.9 * 0.5)


@dataclass
class ToyOptions:
    name: str = "toy_team"
    num_problems: int = 4


class ToyTeam(TeamTask):
    """Two agents; reward = how close the two answers' lengths are to 10 and 20 characters."""

    name = "toy_team"
    roles = ("short", "long")
    max_reward = 2.0
    Options = ToyOptions

    def __init__(self, opts=None):
        self.opts = opts or ToyOptions()

    def problems(self):
        return [Problem(f"t{i}", {"i": i}) for i in range(self.opts.num_problems)]

    def prompt(self, problem, role, turn=0, history=(), feedback=""):
        prev = history[-1][role] if history else ""
        return [{"role": "user", "content": f"{role} {problem.data['i']} turn {turn} {prev[:8]} {feedback}"}]

    def reward(self, problem, outputs):
        return max(0.0, 1 - abs(len(outputs["short"]) - 10) / 10) + max(0.0, 1 - abs(len(outputs["long"]) - 20) / 20)

    def feedback(self, problem, outputs, reward):
        return f"score {reward:.1f}"


@pytest.fixture
def toy(monkeypatch, tmp_path):
    monkeypatch.setitem(TASKS, "toy_team", ToyTeam)

    def make(*extra):
        return load_config(None, ["model=tiny-random", "threads=1", "algorithm=magrpo", "task.name=toy_team",
                                  "rollout.max_new_tokens=8", "rollout.batch_size=2", "rollout.group_size=3",
                                  "run.progress=false", "policy.mode=lora_per_role", "policy.lora.r=4",
                                  f"run.dir={tmp_path}", *extra])
    return make


def test_two_turn_tree_returns_groups_and_batching(toy):
    t = Trainer(toy("name=tree", "magrpo.num_turns=2", "magrpo.gamma=0.5", "train.steps=1"))
    problems = t._next_problems()
    from teamrl.rollout.scheduler import GenerationScheduler
    from teamrl.workflows.context import EpisodeContext

    sched = GenerationScheduler(t.engine, seed=1)
    samples = t.algorithm.rollout(problems, t.task, lambda p, e, tags: EpisodeContext(sched, t.router.policy_name, t.tokenizer, t.params, p.id, e, tags), sched.run)
    G = 3
    # per problem and agent: G at turn 0, then G children nodes x G samples at turn 1
    assert len(samples) == 2 * 2 * (G + G * G)
    # one request batch per policy per turn, each holding every problem's and node's request
    # (both policies of a turn decode together on their shared base: tests/test_multi_lora.py)
    assert sorted(sched.calls) == sorted([("short", 2), ("long", 2), ("short", 2 * G), ("long", 2 * G)])
    groups = {}
    for s in samples:
        assert s.policy == s.role  # lora_per_role: each agent's samples go to its own adapter
        groups.setdefault(s.group, []).append(s)
    assert all(len(g) == G for g in groups.values())
    assert all(len({s.prompt_text for s in g}) == 1 for g in groups.values())  # a group saw one prompt
    assert all(len({s.problem_id for s in g}) == 1 for g in groups.values())
    # aligned: the turn-0 return of sample j = r_j + 0.5 * mean(turn-1 returns of node j's children)
    for s in samples:
        if s.turn == 0:
            kids = [c for c in samples if c.problem_id == s.problem_id and c.role == s.role and c.tags["path"] == (s.branch,)]
            assert len(kids) == G
            expect = s.tags["turn_reward"] + 0.5 * sum(k.reward for k in kids) / G
            assert s.reward == pytest.approx(expect)
        else:
            assert s.reward == pytest.approx(s.tags["turn_reward"])  # leaves


def test_termination_threshold_stops_expansion(toy):
    t = Trainer(toy("name=term", "magrpo.num_turns=3", "magrpo.termination_threshold=0.0", "train.steps=1"))
    rec = t.train_step()
    import json

    eps = [json.loads(line) for line in (t.run_dir / "episodes" / "step_000001.jsonl").read_text().splitlines()]
    assert {e["turn"] for e in eps} == {0}  # every joint action reached the threshold at turn 0
    assert "normalised_return" in rec and 0 <= rec["normalised_return"] <= 1


def test_cross_mode_trains_both_agents_separately(toy):
    t = Trainer(toy("name=cross", "magrpo.joint_mode=cross", "train.steps=2"))
    m = t.train()
    assert {"grad_norm/short", "grad_norm/long", "reward/short", "reward/long"} <= set(m[-1])
    assert m[-1]["engine_calls"] == 2


@dataclass
class OneRoleOptions(WordCountOptions):
    name: str = "word_count_team"


class OneRoleTeam(TeamTask):
    """word_count seen as a team of one."""

    name = "word_count_team"
    roles = ("agent",)
    Options = OneRoleOptions

    def __init__(self, opts=None):
        self.inner = WordCountTask(WordCountOptions(**{k: v for k, v in vars(opts or OneRoleOptions()).items() if k != "name"}))

    def problems(self):
        return self.inner.problems()

    def prompt(self, problem, role, turn=0, history=(), feedback=""):
        return self.inner.prompt(problem)

    def reward(self, problem, outputs):
        return self.inner.reward(problem, outputs["agent"])


def test_one_agent_one_turn_magrpo_equals_grpo(monkeypatch, tmp_path):
    monkeypatch.setitem(TASKS, "word_count_team", OneRoleTeam)
    common = ["model=tiny-random", "threads=1", "rollout.max_new_tokens=10", "rollout.batch_size=2", "rollout.group_size=4",
              "run.progress=false", "policy.lora.r=4", "train.steps=2", f"run.dir={tmp_path}", "run.log_episodes=false"]
    g = Trainer(load_config(None, common + ["name=g", "algorithm=grpo", "task.name=word_count"])).train()
    m = Trainer(load_config(None, common + ["name=m", "algorithm=magrpo", "task.name=word_count_team"])).train()
    for k in ("loss/shared", "grad_norm/shared", "reward_mean", "completion_len"):
        for a, b in zip(g, m):
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7), k


def test_algorithm_and_task_kind_must_match(tmp_path):
    from teamrl.core.config import ConfigError

    with pytest.raises(ConfigError, match="magrpo needs a team task"):
        Trainer(load_config(None, ["model=tiny-random", "algorithm=magrpo", f"run.dir={tmp_path}"]))
