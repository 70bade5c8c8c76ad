"""The episode protocol's context additions and branching by replay (teamrl.workflows.episode)."""

from __future__ import annotations

import asyncio

import pytest

from teamrl.core.config import InputError
from teamrl.rollout.engine import SamplingParams
from teamrl.rollout.scheduler import GenerationScheduler
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.episode import Branch, run_episode
from tests.scripted import TOK, ScriptedEngine


def _ctx(script=lambda policy, prompt, n: [f"{policy}{i}" for i in range(n)]):
    sched = GenerationScheduler(ScriptedEngine(script))
    return sched, EpisodeContext(sched, lambda role: role, TOK, SamplingParams(max_new_tokens=8), "p0", 0,
                                 seed=7, workflow="toy")


async def sequential(ctx):
    """a -> b -> a, each seeing the previous text; a team reward per call, local rewards; random draws."""
    draw = ctx.rng.randrange(1000)
    x = await ctx.generate("a", f"start {draw}")
    ctx.reward(1.0)
    ctx.reward(0.25, role="a")
    y = await ctx.generate("b", f"after {x}")
    ctx.reward(2.0)
    ctx.reward(0.5, role="b")
    z = await ctx.generate("a", f"after {y}")
    ctx.reward(0.125, role="a")
    return 4.0 if z else 0.0


async def concurrent(ctx):
    """Two calls at once (one step), then one."""
    x, y = await asyncio.gather(ctx.generate("a", "left"), ctx.generate("b", "right"))
    ctx.reward(len(x) + len(y))
    return float(len(await ctx.generate("c", f"{x}+{y}")))


def test_turn_defaults_to_call_position_and_rewards_are_attributed():
    sched, ctx = _ctx()
    (result,) = sched.run([run_episode(sequential, ctx)])
    assert [(c.index, c.role, c.turn) for c in ctx.calls] == [(0, "a", 0), (1, "b", 0), (2, "a", 1)]
    assert result.final_reward == 4.0 and result.team_return == 7.0  # 1 + 2 reported, 4 final
    assert [s.role_reward for s in ctx.samples] == [0.25, 0.5, 0.125]


def test_rng_is_seeded_by_seed_problem_and_episode():
    draws = [_ctx()[1].rng.random() for _ in range(2)]
    assert draws[0] == draws[1]
    sched = GenerationScheduler(ScriptedEngine(lambda *a: ["x"]))
    other = EpisodeContext(sched, str, TOK, SamplingParams(), "p0", 1, seed=7)
    assert other.rng.random() != draws[0]


def test_bad_reward_names_workflow_and_role():
    sched, ctx = _ctx()

    async def bad(ctx):
        await ctx.generate("a", "q")
        ctx.reward("0.5", role="a")

    with pytest.raises(InputError, match=r"workflow 'toy': ctx.reward for role 'a' got '0.5'"):
        sched.run([bad(ctx)])


def test_full_script_replays_exactly_without_new_samples():
    sched, ctx = _ctx()

    async def record_then_replay():
        result = await run_episode(sequential, ctx)
        copy = Branch(sequential, ctx, [c.samples for c in ctx.calls])
        assert await copy.advance() == []
        return result, copy

    ((result, copy),) = sched.run([record_then_replay()])
    assert copy.result.team_return == result.team_return == 7.0
    assert [c.messages for c in copy.ctx.calls] == [c.messages for c in ctx.calls]  # same rng draw, same texts
    assert len(ctx.samples) == 3  # nothing recorded again


def test_branch_pauses_at_frontier_and_credits_only_its_segment():
    sched, ctx = _ctx(lambda policy, prompt, n: [f"{policy}-{prompt[-7:]}-{i}" for i in range(n)])

    async def branch_at_b():
        root = Branch(sequential, ctx)
        (first,) = await root.advance()
        assert (first.index, first.role) == (0, "a")
        (a,) = await ctx.sample(first.role, first.messages, 1, first.turn, 0, first.params, first.tags)
        copies = []
        root2 = root.extend([[a]])
        (call_b,) = await root2.advance()
        assert (call_b.index, call_b.role, call_b.messages) == (1, "b", f"after {a.text}")
        assert root2.segment_team_reward() == 1.0 and root2.own_reward(0) == 0.25
        candidates = await ctx.sample("b", call_b.messages, 3, call_b.turn, 0, call_b.params, call_b.tags)
        for c in candidates:
            copies.append(root2.extend([[c]]))
        fronts = await asyncio.gather(*[c.advance() for c in copies])
        return root2, candidates, copies, fronts

    ((root2, candidates, copies, fronts),) = sched.run([branch_at_b()])
    for cand, copy, front in zip(candidates, copies, fronts):
        (call,) = front
        assert (call.index, call.role, call.messages) == (2, "a", f"after {cand.text}")
        assert copy.segment_team_reward() == 2.0  # the replayed prefix's team reward (1.0) is not credited again
        assert copy.cumulative_team_reward() == 3.0
        assert copy.own_reward(1) == 0.5
    # the three copies' next calls were issued together: one engine batch for all of them later
    assert len(ctx.samples) == 4  # a, and b's three candidates: replays record nothing


def test_concurrent_calls_are_one_step_and_resolve_runs_to_the_end():
    sched, ctx = _ctx()

    async def go():
        root = Branch(concurrent, ctx)
        front = await root.advance()
        assert [(c.index, c.role) for c in front] == [(0, "a"), (1, "b")]  # gather: both pending at once
        answers = await asyncio.gather(*[ctx.sample(c.role, c.messages, 1, c.turn, 0, c.params, c.tags) for c in front])
        root.resolve(answers)
        (last,) = await root.advance()
        assert last.role == "c" and root.segment_team_reward() == len("a0") + len("b0")
        root.resolve([await ctx.sample(last.role, last.messages, 1, last.turn, 0, last.params, last.tags)])
        assert await root.advance() == []
        return root

    (root,) = sched.run([go()])
    assert root.done and root.result.final_reward == len("c0")
    assert root.segment_team_reward() == len("c0")  # the segment after the last resolve: the final reward only


def test_sub_episode_tags_parent_and_slot():
    sched, ctx = _ctx()

    async def with_subs(ctx):
        await ctx.generate("main", "q")
        for _ in range(2):
            sub = ctx.sub_episode("sub")
            await sub.generate("sub", "s")
            await sub.generate("sub", "t")

    sched.run([with_subs(ctx)])
    subs = [s for s in ctx.samples if s.role == "sub"]
    assert [(s.tags["parent_episode"], s.tags["call"], s.turn) for s in subs] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]


def test_nondeterministic_workflow_is_named_on_replay():
    sched, ctx = _ctx()
    flips = iter([True, False])

    async def flaky(ctx):
        await ctx.generate("a" if next(flips) else "b", "q")

    async def go():
        await run_episode(flaky, ctx)
        copy = Branch(flaky, ctx, [c.samples for c in ctx.calls])
        await copy.advance()

    with pytest.raises(InputError, match="not deterministic given its texts"):
        sched.run([go()])


def test_memo_is_shared_by_an_episode_and_its_replay_copies():
    sched, ctx = _ctx()
    computed = []

    async def memoised(ctx):
        x = await ctx.generate("a", "q")
        ctx.reward(ctx.memo(("score", x), lambda: computed.append(x) or len(x)))
        await ctx.generate("b", f"after {x}")

    async def go():
        root = Branch(memoised, ctx)
        (call,) = await root.advance()
        candidates = await ctx.sample(call.role, call.messages, 3, call.turn, 0, call.params, call.tags)
        copies = [root.extend([[c]]) for c in candidates]
        await asyncio.gather(*[c.advance() for c in copies])
        again = [Branch(memoised, ctx, c.ctx.script) for c in copies]  # replay the same prefixes once more
        await asyncio.gather(*[c.advance() for c in again])
        return copies

    (copies,) = sched.run([go()])
    assert computed == ["a0", "a1", "a2"]  # once per distinct text, not once per copy
    assert [c.segment_team_reward() for c in copies] == [2.0, 2.0, 2.0]
