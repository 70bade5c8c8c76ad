"""A problem drawn twice in one step's batch is two instances: no group, outcome or metric merges them."""

import itertools
from dataclasses import dataclass

import pytest

from teamrl.algorithms import m_grpo as m_grpo_module
from teamrl.algorithms.at_grpo import ATGRPO, ATGRPOConfig
from teamrl.algorithms.m_grpo import MGRPO, MGRPOConfig
from teamrl.algorithms.magrpo import MAGRPO, MAGRPOConfig
from teamrl.tasks.environment import Environment
from teamrl.tasks.research import ResearchEnv, ResearchOptions, sub_reward
from teamrl.tasks.task import Problem, batch_instances
from teamrl.workflows.research_team import ResearchOutcome, SubCall
from tests.scripted import ScriptedTeam, scripted_rollout

PROBLEM = Problem("p0", {"x": 1})


def _counting_script():
    """Every request gets texts no other request gets, so two instances' histories differ."""
    counter = itertools.count()
    return lambda policy, prompt, n: [f"t{next(counter)}" for _ in range(n)]


def _groups(samples):
    groups = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    return groups


def test_batch_instances_gives_repeats_distinct_ids_and_keeps_the_data():
    other = Problem("p0#2")
    got = batch_instances([PROBLEM, other, PROBLEM, PROBLEM])
    assert [p.id for p in got] == ["p0", "p0#2", "p0#3", "p0#4"]  # "p0#2" is taken by a real problem
    assert all(p.data is PROBLEM.data for i, p in enumerate(got) if i != 1)
    assert [p.id for p in batch_instances([PROBLEM, other])] == ["p0", "p0#2"]  # no repeat: unchanged


def test_magrpo_groups_of_a_repeated_problem_stay_apart():
    G = 2
    algo = MAGRPO(MAGRPOConfig(num_turns=2), group_size=G)
    samples = scripted_rollout(algo, [PROBLEM, PROBLEM], ScriptedTeam(), _counting_script())
    groups = _groups(samples)
    assert len(groups) == 2 * (1 + G)  # per instance: one node at turn 0, G at turn 1
    for g in groups.values():
        assert len(g) == G and len({s.prompt_text for s in g}) == 1


@dataclass(frozen=True)
class LogState:
    log: tuple = ()


class WinEnv(Environment):
    """One role; the episode is solved (and over) once a chosen text is "win"."""

    name = "win_env"
    roles = ("agent",)
    max_turns = 2

    def problems(self):
        return [PROBLEM]

    def reset(self, problem):
        return LogState()

    def observe(self, state, role):
        return [{"role": "user", "content": f"log: {' '.join(state.log)}"}]

    def apply(self, state, role, text):
        return LogState(state.log + (text,)), 0.0

    def team_reward(self, state):
        return float("win" in state.log)

    def done(self, state):
        return "win" in state.log


@pytest.mark.parametrize("grouping", ["tree", "trajectory"])
def test_at_grpo_groups_and_success_of_a_repeated_problem_stay_apart(grouping):
    K = 2
    calls = itertools.count()

    def script(policy, prompt, n):  # the first request (instance 0) can win; nothing else can
        first = next(calls) == 0
        return ["win"] + [f"x{i}" for i in range(n - 1)] if first else [f"y{next(calls)}" for _ in range(n)]

    algo = ATGRPO(ATGRPOConfig(grouping=grouping), k=K)
    samples = scripted_rollout(algo, [PROBLEM, PROBLEM], WinEnv(), script)
    for g in _groups(samples).values():
        if grouping == "tree":  # K candidates of one state
            assert len(g) == K and len({s.prompt_text for s in g}) == 1
        else:  # every turn of K episodes of one instance
            assert len({s.episode for s in g}) == K and len(g) >= K
    assert ATGRPO.metrics(samples)["success_rate"] == pytest.approx(1 / 2 if grouping == "tree" else 1 / (2 * K))


def test_m_grpo_sub_agent_gets_its_own_instance_outcome(monkeypatch):
    K = 2
    started = itertools.count()
    seen = []

    async def workflow(ctx, env, problem):
        """The first instance's rollouts answer correctly, the second's wrongly; each makes one valid sub-agent call."""
        correct = next(started) < K
        main = await ctx.generate_group("main", "question", n=1, turn=0)
        sub = await ctx.generate_group("sub", "subtask", n=1, turn=0, tags={"parent_episode": ctx.episode, "call": 0})
        reward = 1.0 if correct else 0.0
        seen.append((main[0], sub[0], reward))
        return ResearchOutcome("a", True, reward, correct, [SubCall("find", "found", True, 1)])

    monkeypatch.setattr(m_grpo_module, "research_team", workflow)
    algo = MGRPO(MGRPOConfig(d_max=1, sub_reward="gated"), k=K)
    samples = scripted_rollout(algo, [PROBLEM, PROBLEM], ResearchEnv(ResearchOptions(num_problems=1)), _counting_script())
    assert len(seen) == 2 * K
    for main, sub, reward in seen:
        assert main.reward == reward
        assert sub.reward == sub_reward(reward, True, "gated")  # its own rollout's outcome, not the other copy's
    groups = _groups(samples)
    assert sorted(len(g) for g in groups.values()) == [K] * 4  # main and sub groups of each instance
