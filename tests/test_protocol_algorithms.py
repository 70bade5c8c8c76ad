"""Algorithms over a user's workflow in the episode protocol: rewards reported with ctx.reward, steps, refusals."""

from __future__ import annotations

import asyncio

import pytest

from teamrl.algorithms import ATGRPO, GRPO, MAGRPO, ATGRPOConfig, MAGRPOConfig, make_algorithm
from teamrl.core.config import ConfigError, InputError, load_config
from teamrl.tasks import make_task
from teamrl.tasks.task import Problem
from teamrl.workflows import Workflow
from tests.scripted import scripted_rollout

REF = "tests.test_protocol_algorithms:"
PROBLEMS = [Problem("p0"), Problem("p1")]


async def two_steps(ctx, task, problem, settings):
    """a, then b who sees a's text; a's own reward: its length; team reward 1 when b says 'yes' after a 'long' a."""
    a = await ctx.generate("a", f"{problem.id} start")
    ctx.reward(float(len(a)), role="a")
    ctx.reward(0.5)
    b = await ctx.generate("b", f"{problem.id} after {a}")
    ctx.reward(1.0 if (a == "long" and b == "yes") else 0.0)
    return None


TWO_STEPS = Workflow(two_steps, ("a", "b"))
BLACK_BOX = Workflow(two_steps, ("a", "b"), replayable=False)


def _script(policy, prompt, n):
    return (["x", "long"] if policy == "a" else ["no", "yes"])[:n] + ["z"] * max(0, n - 2)


def test_at_grpo_scores_candidates_on_their_segment_and_continues_from_the_chosen_text():
    samples = scripted_rollout(ATGRPO(ATGRPOConfig(alpha=2.0), workflow=REF + "TWO_STEPS", k=2), PROBLEMS, None, _script)
    a = sorted((s for s in samples if s.role == "a" and s.problem_id == "p0"), key=lambda s: s.branch)
    # own reward (its length) + alpha * cumulative team reward after it (0.5)
    assert [s.reward for s in a] == [1.0 + 2.0 * 0.5, 4.0 + 2.0 * 0.5] and a[1].tags.get("chosen")
    b = sorted((s for s in samples if s.role == "b" and s.problem_id == "p0"), key=lambda s: s.branch)
    assert all("after long" in s.prompt_text for s in b)  # b continues from a's chosen text
    assert [s.reward for s in b] == [2.0 * 0.5, 2.0 * 1.5] and b[1].tags.get("chosen")
    assert {s.group for s in samples} == {(p, 0, r) for p in ("p0", "p1") for r in ("a", "b")}


def test_magrpo_on_a_sequential_workflow_makes_each_call_a_step():
    """With the default num_turns=1 both roles' first calls (turn 0) are branched: a's step, then b's under each of
    a's joint actions (tags depth 0 and 1); ``turn`` stays each call's own turn, as under every algorithm
    (before: turn was the depth, and num_turns=2 was needed to train b at all)."""
    samples = scripted_rollout(MAGRPO(MAGRPOConfig(num_turns=1), workflow=REF + "TWO_STEPS", group_size=2), PROBLEMS,
                               None, _script)
    p0 = [s for s in samples if s.problem_id == "p0"]
    assert all(s.trainable for s in p0)
    assert sorted((s.role, s.turn, s.tags["depth"], s.tags["path"]) for s in p0) == sorted(
        [("a", 0, 0, ())] * 2 + [("b", 0, 1, (0,))] * 2 + [("b", 0, 1, (1,))] * 2)
    b_after_long = sorted((s for s in p0 if s.tags["path"] == (1,)), key=lambda s: s.branch)
    assert [s.reward for s in b_after_long] == [0.0, 1.0]  # the team reward of each joint action's segment
    a = sorted((s for s in p0 if s.role == "a"), key=lambda s: s.branch)
    assert [s.reward for s in a] == [0.5 + 0.0, 0.5 + 0.5]  # r_0 + mean of the children's returns


def test_grpo_per_role_reads_the_rewards_a_role_reported():
    algo = GRPO(2, workflow=REF + "TWO_STEPS", reward="per_role")
    samples = scripted_rollout(algo, PROBLEMS, None, lambda policy, prompt, n: ["long" if policy == "a" else "yes"] * n)
    assert {s.reward for s in samples if s.role == "a"} == {4.0}  # its own reward
    assert {s.reward for s in samples if s.role == "b"} == {1.5}  # no own reward: the team return 0.5 + 1.0
    assert {s.group for s in samples} == {(p, r, 0) for p in ("p0", "p1") for r in ("a", "b")}


@pytest.mark.parametrize("algorithm", ["at_grpo", "magrpo"])
def test_branching_refuses_a_workflow_that_cannot_be_replayed(algorithm):
    cfg = load_config(None, [f"algorithm={algorithm}", f"workflow.name={REF}BLACK_BOX", "task.name=word_count"])
    with pytest.raises(ConfigError, match=rf"algorithm: {algorithm} branches episodes by replaying .* replayable=False"):
        make_algorithm(cfg, make_task(cfg.task))
    cfg = load_config(None, ["algorithm=grpo", f"workflow.name={REF}BLACK_BOX", "task.name=word_count"])
    assert make_algorithm(cfg, make_task(cfg.task)).name == "grpo"


def test_at_grpo_replay_applies_each_environment_step_once(monkeypatch):
    """A copy replays its prefix from ctx.memo: env.apply runs once per sampled candidate, as before replay
    (without the memo: 168 apply calls for these 48 samples)."""
    env = make_task({"name": "plan_path", "num_problems": 2})
    calls = []
    apply = type(env).apply
    monkeypatch.setattr(type(env), "apply", lambda self, state, role, text: calls.append(role) or apply(self, state, role, text))
    samples = scripted_rollout(ATGRPO(ATGRPOConfig(), k=4), env.problems(), env,
                               lambda policy, prompt, n: [f"Answer: {j}" for j in range(n)])
    assert len(samples) == 48 and len(calls) == len(samples)


async def tool_or_round_two(ctx, task, problem, settings):
    """The critic's second call is a post-tool call in even episodes and a round-2 review (after a revision) in odd ones:
    both are its call position 1, which GRPO groups together."""
    code = await ctx.generate("coder", f"{problem.id} write")
    review = await ctx.generate("critic", f"{problem.id} review {code}")
    if ctx.episode % 2 == 0:
        await ctx.generate("critic", f"{problem.id} the tool said ok")
    else:
        code = await ctx.generate("coder", f"{problem.id} revise after {review}")
        await ctx.generate("critic", f"{problem.id} review round 2 {code}")
    return 1.0


TOOL_OR_ROUND_TWO = Workflow(tool_or_round_two, ("coder", "critic"))


async def some_workers(ctx, task, problem, settings):
    """An orchestrator, 1 or 2 workers at once (by episode), a synthesizer: the synthesizer's call is one kind of call."""
    await ctx.generate("orchestrator", f"{problem.id} plan")
    await asyncio.gather(*[ctx.generate(f"worker{i}", f"{problem.id} part {i}") for i in range(1 + ctx.episode % 2)])
    await ctx.generate("synthesizer", f"{problem.id} combine")
    return 1.0


SOME_WORKERS = Workflow(some_workers, ("orchestrator", "worker", "synthesizer"))


def test_grpo_warns_once_when_a_group_mixes_calls_of_different_kinds(capsys):
    # before: the critic's post-tool call and another episode's round-2 review formed one group, silently
    algo = GRPO(2, workflow=REF + "TOOL_OR_ROUND_TWO")
    samples = scripted_rollout(algo, PROBLEMS, None, lambda policy, prompt, n: ["ok"] * n)
    assert len({s.episode for s in samples if s.group == ("p0", "critic", 1)}) == 2  # the mixed group
    err = capsys.readouterr().err
    print(err)
    warnings = [line for line in err.splitlines() if line.startswith("warning: grpo:")]
    assert len(warnings) == 1 and "'critic'" in warnings[0] and "turn 1" in warnings[0] and "turn=" in warnings[0]
    scripted_rollout(algo, PROBLEMS, None, lambda policy, prompt, n: ["ok"] * n)
    assert "warning:" not in capsys.readouterr().err  # once per run


def test_grpo_does_not_warn_when_every_group_holds_one_call(capsys):
    scripted_rollout(GRPO(2, workflow=REF + "TWO_STEPS"), PROBLEMS, None, _script)
    scripted_rollout(GRPO(2, workflow=REF + "SOME_WORKERS"), PROBLEMS, None, lambda policy, prompt, n: ["ok"] * n)
    # voting: generator0..2 (one role type, called at once) form one group with each other: one kind of call
    cfg = load_config(None, ["algorithm=grpo", "rollout.group_size=2", "workflow.name=voting", "task.name=math.solve",
                             "task.num_problems=4", "task.test_size=1"])
    task = make_task(cfg.task)
    samples = scripted_rollout(make_algorithm(cfg, task), task.problems()[:1], task, lambda p, prompt, n: ["Answer: 1"] * n)
    assert len({s.role for s in samples if s.role.startswith("generator")}) > 1
    assert "warning:" not in capsys.readouterr().err


async def maybe_workers(ctx, task, problem, settings):
    """A lead that hands the problem to a worker sub-episode only when the problem is 'deep'."""
    plan = await ctx.generate("lead", f"{problem.id} plan")
    if problem.id == "deep":
        await ctx.sub_episode("worker").generate("worker", f"{problem.id} part")
    await ctx.generate("lead", f"{problem.id} answer after {plan}")
    return 1.0


MAYBE_WORKERS = Workflow(maybe_workers, ("lead", "worker"), sub_roles=("worker",))
ALGORITHMS = {"grpo": lambda: GRPO(2, workflow=REF + "MAYBE_WORKERS"),
              "magrpo": lambda: MAGRPO(MAGRPOConfig(), workflow=REF + "MAYBE_WORKERS", group_size=2),
              "at_grpo": lambda: ATGRPO(ATGRPOConfig(), workflow=REF + "MAYBE_WORKERS", k=2)}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_a_workflow_declaring_sub_roles_trains_while_it_opens_no_sub_episode(algorithm):
    # before: refused at config time ("the research environment's sub-episodes") though no sub-episode was ever opened
    cfg = load_config(None, [f"algorithm={algorithm}", f"workflow.name={REF}MAYBE_WORKERS", "task.name=word_count"])
    assert make_algorithm(cfg, make_task(cfg.task)).name == algorithm
    samples = scripted_rollout(ALGORITHMS[algorithm](), PROBLEMS, None, lambda policy, prompt, n: ["ok"] * n)
    assert {s.role for s in samples if s.trainable} == {"lead"}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_opening_a_sub_episode_under_an_algorithm_that_cannot_align_it_is_refused_in_one_line(algorithm):
    # before: the sub-episode ran and its calls were grouped by call position with the lead's, silently
    with pytest.raises(InputError) as refused:
        scripted_rollout(ALGORITHMS[algorithm](), [Problem("deep")], None, lambda policy, prompt, n: ["ok"] * n)
    message = str(refused.value)
    print(message)
    assert "\n" not in message and f"workflow '{REF}MAYBE_WORKERS'" in message and f"algorithm {algorithm}" in message
    assert "ctx.sub_episode('worker')" in message and "algorithm=m_grpo" in message and "research" not in message


def test_the_research_workflow_is_still_refused_before_any_model_loads():
    cfg = load_config(None, ["algorithm=grpo", "task.name=research"])
    with pytest.raises(ConfigError, match=r"algorithm: grpo does not align the sub-agent calls of workflow 'research'"):
        make_algorithm(cfg, make_task(cfg.task))
