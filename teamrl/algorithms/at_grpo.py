"""AT-GRPO (Zhao et al., 2025, "Stronger-MAS"): agent- and turn-wise groups from tree sampling.

The three places where algorithms differ:
1. sampling (``grouping: tree``): per problem, per turn, per agent in turn order, K candidates
   are sampled from the same state; each is applied to its own clone of the state and scored;
   every branch then continues from the chosen candidate's state (``select: greedy``, ties to
   the lowest index, or ``random``). Within a turn agent i+1 observes the state after agent
   i's chosen action, unless the environment declares its agents ``parallel``, in which case
   every agent of the turn observes the same state (the one before the turn) and generates at
   once; the candidates are still applied in role order, each role's to the state its earlier
   roles' chosen actions produced, so a candidate is scored on the state it really leads to and
   the episode continues from that very state. When an earlier role's chosen action ends the
   episode, the later roles' candidates of that turn never act: they are logged, tagged
   ``unused``, not ``trainable`` (reward 0), and not trained. ``grouping: trajectory`` (the ablation): K
   independent episodes per problem, one sample per agent per turn.
2. group key: (problem, turn, agent) for the tree: K samples that saw one state and prompt;
   (problem, agent) for trajectory grouping.
3. reward assignment: a candidate's reward is its agent's local reward plus
   ``alpha * team_reward`` of the state it produced (tree); for trajectory grouping the team
   term is the episode's final team reward.

Correctness the reference code lacks, each tested: later agents observe the chosen branch's
real state (no stale copies), one group never spans two problems, agents see each other's
output within a turn, and per-role policies update only their own adapter.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Hashable, Sequence

from teamrl.core.sample import Sample
from teamrl.tasks.environment import Environment
from teamrl.tasks.task import Problem, batch_instances
from teamrl.workflows.context import EpisodeContext

SELECT_MODES = ("greedy", "random")
GROUPINGS = ("tree", "trajectory")
ContextFactory = Callable[[Problem, int, dict], EpisodeContext]


def group_key(sample: Sample) -> Hashable:
    """Tree: the K candidates of one agent at one turn of one problem (they saw one state)."""
    if sample.tags.get("grouping") == "trajectory":
        return (sample.problem_id, sample.role)
    return (sample.problem_id, sample.turn, sample.role)


def select_branch(scores: Sequence[float], mode: str, rng: random.Random) -> int:
    """Index of the branch to continue from: the best (lowest index on ties) or a random one."""
    if mode == "greedy":
        best = max(scores)
        return next(i for i, s in enumerate(scores) if s == best)
    if mode == "random":
        return rng.randrange(len(scores))
    raise ValueError(f"select {mode!r}: choose one of {list(SELECT_MODES)}")


@dataclass
class ATGRPOSettings:
    k: int = 4
    alpha: float = 1.0
    select: str = "greedy"
    grouping: str = "tree"
    max_turns: int | None = None  # None: the environment's max_turns
    seed: int = 0


class ATGRPO:
    """Sampler + group key + reward assignment for AT-GRPO over an :class:`Environment`."""

    name = "at_grpo"
    group_key = staticmethod(group_key)

    def __init__(self, settings: ATGRPOSettings) -> None:
        if settings.select not in SELECT_MODES:
            raise ValueError(f"select {settings.select!r}: choose one of {list(SELECT_MODES)}")
        if settings.grouping not in GROUPINGS:
            raise ValueError(f"grouping {settings.grouping!r}: choose one of {list(GROUPINGS)}")
        self.s = settings
        self.calls = 0  # rollouts so far: seeds the branch-choice RNG of the next one

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint must hold for a resumed run to draw the same random branch choices."""
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict` (on resume)."""
        self.calls = int(state["calls"])

    def rollout(self, problems: Sequence[Problem], env: Environment, make_ctx: ContextFactory,
                run: Callable[[list[Awaitable]], list]) -> list[Sample]:
        """Run every problem's episodes together; return all samples with rewards and groups set."""
        self.calls += 1
        rng = random.Random(hash((self.s.seed, self.calls)) & 0xFFFFFFFF)
        instances = batch_instances(problems)  # a problem drawn twice: two instances, never one group
        if self.s.grouping == "tree":
            ctxs = [make_ctx(inst, 0, {"grouping": "tree"}) for inst in instances]
            finals = run([self._tree(c, env, p, rng) for c, p in zip(ctxs, problems)])
        else:
            jobs = [(p, make_ctx(inst, e, {"grouping": "trajectory"})) for p, inst in zip(problems, instances)
                    for e in range(self.s.k)]
            ctxs = [c for _, c in jobs]
            finals = run([self._trajectory(c, env, p) for p, c in jobs])
        samples = []
        for ctx, final in zip(ctxs, finals):
            for s in ctx.samples:
                s.group = self.group_key(s)
                s.tags["solved"] = bool(env.success(final))
            samples += ctx.samples
        return samples

    def _turns(self, env: Environment) -> int:
        return self.s.max_turns or env.max_turns

    async def _tree(self, ctx: EpisodeContext, env: Environment, problem: Problem, rng: random.Random) -> Any:
        state = env.reset(problem)
        for turn in range(self._turns(env)):
            if env.done(state):
                break
            groups: list[list[Sample]] = []
            if env.parallel:  # every role of the turn observes the state before it
                groups = await asyncio.gather(*[ctx.generate_group(r, env.observe(state, r), n=self.s.k, turn=turn)
                                                for r in env.roles])
            for i, role in enumerate(env.roles):
                if env.done(state):  # parallel: the later roles' candidates never acted; nothing to learn from them
                    for s in (s for g in groups[i:] for s in g):
                        s.reward = 0.0
                        s.tags["unused"], s.trainable = True, False
                    break
                group = groups[i] if env.parallel else await ctx.generate_group(role, env.observe(state, role),
                                                                                n=self.s.k, turn=turn)
                # scored on the state after the roles before it in this turn (parallel or not) ...
                branches, j = self._score_and_choose(env, state, role, group, rng)
                state = branches[j]  # ... and continued from exactly the scored state of the chosen one
        return state

    def _score_and_choose(self, env: Environment, state: Any, role: str, group: list[Sample],
                          rng: random.Random) -> tuple[list[Any], int]:
        branches, scores = [], []
        for s in group:
            new_state, local = env.apply(env.clone(state), role, s.text)
            score = float(local) + self.s.alpha * float(env.team_reward(new_state))
            s.reward = score
            s.tags.update(local_reward=float(local), team_reward=float(env.team_reward(new_state)))
            branches.append(new_state)
            scores.append(score)
        j = select_branch(scores, self.s.select, rng)
        group[j].tags["chosen"] = True
        return branches, j

    async def _trajectory(self, ctx: EpisodeContext, env: Environment, problem: Problem) -> Any:
        state = env.reset(problem)
        mine: list[Sample] = []
        for turn in range(self._turns(env)):
            if env.done(state):
                break
            base = state
            for role in env.roles:
                (s,) = await ctx.generate_group(role, env.observe(base if env.parallel else state, role), n=1, turn=turn)
                state, local = env.apply(state, role, s.text)
                s.tags["local_reward"] = float(local)
                mine.append(s)
                if env.done(state):
                    break
            if env.done(state):
                break
        team = float(env.team_reward(state))
        for s in mine:
            s.reward = s.tags["local_reward"] + self.s.alpha * team
            s.tags["team_reward"] = team
        return state

    @staticmethod
    def metrics(samples: Sequence[Sample]) -> dict[str, float]:
        """Per role and turn: mean reward, advantage std, share of zero-variance groups; success, turns to solve."""
        out: dict[str, float] = {}
        keys = sorted({(s.role, s.turn) for s in samples}, key=lambda x: (x[1], x[0]))
        for role, turn in keys:
            own = [s for s in samples if s.role == role and s.turn == turn]
            adv = [s.advantage or 0.0 for s in own]
            mean_adv = sum(adv) / len(adv)
            out[f"reward/{role}/turn{turn}"] = sum(s.reward for s in own) / len(own)
            out[f"adv_std/{role}/turn{turn}"] = (sum((a - mean_adv) ** 2 for a in adv) / len(adv)) ** 0.5
            groups: dict[Hashable, list[float]] = {}
            for s in own:
                groups.setdefault(s.group, []).append(s.reward)
            out[f"zero_var_groups/{role}/turn{turn}"] = sum(max(g) == min(g) for g in groups.values()) / len(groups)
        episodes: dict[Hashable, tuple[bool, int]] = {}
        for s in samples:
            key = (s.problem_id, s.episode)
            solved, turns = episodes.get(key, (False, 0))
            episodes[key] = (solved or s.tags.get("solved", False), max(turns, s.turn + 1))
        out["success_rate"] = sum(v[0] for v in episodes.values()) / max(1, len(episodes))
        solved_turns = [t for ok, t in episodes.values() if ok]
        out["turns_to_solve"] = sum(solved_turns) / len(solved_turns) if solved_turns else float("nan")
        return out
