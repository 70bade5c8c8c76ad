"""AT-GRPO: property tests over random environments and turn orders, and the GRPO reduction."""

import contextlib
import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from teamrl.algorithms.at_grpo import ATGRPO, ATGRPOConfig, select_branch
from teamrl.core.config import load_config
from teamrl.policies.models import load_model
from teamrl.rollout.engine import SamplingParams
from teamrl.rollout.hf_engine import HFEngine
from teamrl.rollout.scheduler import GenerationScheduler
from teamrl.tasks import TASKS
from teamrl.tasks.environment import Environment
from teamrl.tasks.task import Problem
from teamrl.tasks.word_count import WordCountOptions, WordCountTask
from teamrl.trainer.trainer import Trainer


@dataclass(frozen=True)
class ToyState:
    problem: str
    log: tuple = ()  # (role, text) of every applied action, in order


class ToyEnv(Environment):
    """Every observation shows the whole log, so a prompt reveals exactly which state it came from."""

    name = "toy_env"

    def __init__(self, roles=("planner", "tool"), parallel=False, turns=2, seed=0):
        self.roles = roles
        self.parallel = parallel
        self.max_turns = turns
        self.seed = seed
        self.applied = []  # every (input state, output state) pair, to check apply never mutates

    def problems(self):
        return [Problem(f"p{i}", {"i": i}) for i in range(3)]

    def reset(self, problem):
        return ToyState(problem.id)

    def observe(self, state, role):
        log = " | ".join(f"{r}:{t!r}" for r, t in state.log)
        return [{"role": "user", "content": f"[{state.problem}] you are {role}. log: {log}"}]

    def apply(self, state, role, text):
        new = ToyState(state.problem, state.log + ((role, text),))
        local = (sum(map(ord, text)) % 7) / 7 + (0.1 if role == self.roles[0] else 0.0)
        return new, local

    def team_reward(self, state):
        return (sum(len(t) for _, t in state.log) % 5) / 5

    def done(self, state):
        return False


@pytest.fixture(scope="module")
def tiny_engine_tok():
    model, tok = load_model("tiny-random")
    return HFEngine(lambda p: contextlib.nullcontext(model), tok), tok


def _rollout(engine, tok, env, k, select, grouping="tree", seed=0):
    sched = GenerationScheduler(engine, seed=seed)
    algo = ATGRPO(ATGRPOConfig(alpha=0.5, select=select, grouping=grouping), k=k, seed=seed)
    params = SamplingParams(max_new_tokens=4)
    from teamrl.workflows.context import EpisodeContext

    def make(p, e, tags):
        return EpisodeContext(sched, lambda r: "p", tok, params, p.id, e, tags)

    return algo.rollout(env.problems(), env, make, sched.run), sched


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n_roles=st.integers(1, 3), parallel=st.booleans(), k=st.integers(2, 4), turns=st.integers(1, 3),
       select=st.sampled_from(["greedy", "random"]), seed=st.integers(0, 1000))
def test_tree_groups_and_chosen_branches(tiny_engine_tok, n_roles, parallel, k, turns, select, seed):
    engine, tok = tiny_engine_tok
    roles = ("planner", "tool", "critic")[:n_roles]
    env = ToyEnv(roles, parallel, turns, seed)
    samples, sched = _rollout(engine, tok, env, k, select, seed=seed)
    assert len(samples) == 3 * turns * n_roles * k
    groups = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    for key, g in groups.items():
        assert len(g) == k
        assert len({(s.problem_id, s.turn, s.role) for s in g}) == 1  # one problem, turn and agent
        assert len({s.prompt_text for s in g}) == 1  # one identical prompt
        assert sum(bool(s.tags.get("chosen")) for s in g) == 1
        if select == "greedy":
            best = max(s.reward for s in g)
            chosen = next(s for s in g if s.tags.get("chosen"))
            assert chosen.reward == best and all(s.reward < best for s in g if s.branch < chosen.branch)
    # the chosen branch is exactly what the next agent and the next turn see
    for p in ("p0", "p1", "p2"):
        order = sorted({(s.turn, roles.index(s.role)) for s in samples if s.problem_id == p})
        chosen = {(s.turn, s.role): s for s in samples if s.problem_id == p and s.tags.get("chosen")}
        for (turn, ri) in order:
            prompt = next(s.prompt_text for s in samples if s.problem_id == p and s.turn == turn and s.role == roles[ri])
            # the prompt's log is exactly the chain of chosen actions before it: no stale state, no rejected branch
            earlier = [(t, r) for (t, r) in order if (t, r) < (turn, ri) and (not parallel or t < turn)]
            expected = " | ".join(f"{roles[r]}:{chosen[(t, roles[r])].text!r}" for t, r in earlier)
            assert f"log: {expected}<|im_end|>" in prompt
            if parallel and ri > 0:  # parallel agents of a turn saw the same state
                first = next(s.prompt_text for s in samples if s.problem_id == p and s.turn == turn and s.role == roles[0])
                assert first.split("log:")[1] == prompt.split("log:")[1]
    # all problems' candidates of a step go to the engine together (the env adapter's calls are sequential,
    # parallel environments too: one role's candidates per step)
    assert all(n == 3 for _, n in sched.calls)


def test_sequential_agent_sees_the_previous_agents_choice_within_the_turn(tiny_engine_tok):
    engine, tok = tiny_engine_tok
    samples, _ = _rollout(engine, tok, ToyEnv(("planner", "tool"), False, 1), 3, "greedy")
    for p in ("p0", "p1", "p2"):
        chosen_plan = next(s for s in samples if s.problem_id == p and s.role == "planner" and s.tags.get("chosen"))
        tool_prompts = {s.prompt_text for s in samples if s.problem_id == p and s.role == "tool"}
        assert len(tool_prompts) == 1 and f"planner:{chosen_plan.text!r}" in tool_prompts.pop()


def test_trajectory_grouping(tiny_engine_tok):
    engine, tok = tiny_engine_tok
    samples, _ = _rollout(engine, tok, ToyEnv(("planner", "tool"), False, 2), 4, "greedy", grouping="trajectory")
    assert len(samples) == 3 * 4 * 2 * 2  # problems x episodes x turns x roles
    groups = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    assert set(groups) == {(p, r) for p in ("p0", "p1", "p2") for r in ("planner", "tool")}
    for g in groups.values():
        assert len({s.episode for s in g}) == 4
        for s in g:  # local reward + alpha * the episode's final team reward
            assert s.reward == pytest.approx(s.tags["local_reward"] + 0.5 * s.tags["team_reward"])
    m = ATGRPO.metrics(samples)  # each role's own (local) reward per turn, apart from the team's share
    for role in ("planner", "tool"):
        for turn in (0, 1):
            own = [s.tags["local_reward"] for s in samples if s.role == role and s.turn == turn]
            assert m[f"local_reward/{role}/turn{turn}"] == pytest.approx(sum(own) / len(own))
    assert len({m[f"local_reward/{r}/turn{t}"] for r in ("planner", "tool") for t in (0, 1)}) > 1  # not one number


def test_select_branch():
    assert select_branch([0.1, 0.5, 0.5, 0.2], "greedy", random.Random(0)) == 1
    assert {select_branch([0, 0, 0], "random", random.Random(s)) for s in range(30)} == {0, 1, 2}
    with pytest.raises(ValueError, match="greedy"):
        select_branch([1.0], "best", random.Random(0))


class OneAgentEnv(Environment):
    """word_count as a one-agent, one-turn environment."""

    name = "word_count_env"
    roles = ("agent",)
    max_turns = 1

    @dataclass
    class Options(WordCountOptions):
        name: str = "word_count_env"

    def __init__(self, opts=None):
        o = opts or self.Options()
        self.inner = WordCountTask(WordCountOptions(**{k: v for k, v in vars(o).items() if k != "name"}))

    def problems(self):
        return self.inner.problems()

    def reset(self, problem):
        return (problem, None)

    def observe(self, state, role):
        return self.inner.prompt(state[0])

    def apply(self, state, role, text):
        return (state[0], text), self.inner.reward(state[0], text)

    def team_reward(self, state):
        return 0.0

    def done(self, state):
        return state[1] is not None


def test_one_agent_one_turn_at_grpo_equals_grpo(monkeypatch, tmp_path):
    monkeypatch.setitem(TASKS, "word_count_env", OneAgentEnv)
    common = ["model=tiny-random", "threads=1", "rollout.max_new_tokens=10", "rollout.batch_size=2", "rollout.group_size=4",
              "run.progress=false", "policy.lora.r=4", "train.steps=2", f"run.dir={tmp_path}", "run.log_episodes=false"]
    g = Trainer(load_config(None, common + ["name=g", "algorithm=grpo", "task.name=word_count"])).train()
    a = Trainer(load_config(None, common + ["name=a", "algorithm=at_grpo", "task.name=word_count_env"])).train()
    for k in ("loss/shared", "grad_norm/shared", "reward_mean", "completion_len"):
        for x, y in zip(g, a):
            assert x[k] == pytest.approx(y[k], rel=1e-6, abs=1e-7), k
    assert "success_rate" in a[0] and "zero_var_groups/agent/turn0" in a[0]


def test_at_grpo_needs_an_environment(tmp_path):
    cfg = load_config(None, ["model=tiny-random", "algorithm=at_grpo", "task.name=word_count", f"run.dir={tmp_path}"])
    with pytest.raises(Exception, match="at_grpo needs a multi-turn environment"):
        Trainer(cfg)
