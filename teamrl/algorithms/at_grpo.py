"""AT-GRPO (Zhao et al., 2025, "Stronger-MAS"): agent- and turn-wise groups from tree sampling.

It runs over any replayable workflow; an :class:`~teamrl.tasks.environment.Environment` runs
through its default adapter ``env`` (:mod:`teamrl.workflows.adapters`). The three places where
algorithms differ:
1. sampling (``grouping: tree``): at each step (the calls pending at once, see
   :mod:`teamrl.workflows.episode`) K candidates are sampled for every frontier call; copy j
   answers every frontier call with its j-th candidate and, by replay, runs to its next frontier
   or the end; each candidate is scored there, one is chosen per call (``select: greedy``, ties
   to the lowest index, or ``random``) and the episode continues from the copy with the chosen
   texts: no state is copied, so none can go stale. With ``env`` every call is its own step: a
   role's K candidates are applied to the state its earlier roles' chosen actions produced and a
   later role observes that state, unless the environment declares its agents ``parallel`` (then
   every role of a turn observes the state before the turn; the calls are still sequential, so a
   later role's candidates are applied after the earlier role's chosen action). When a chosen
   action ends the episode, later roles are never sampled (before the episode protocol their
   candidates were sampled, tagged ``unused``/``no_update`` and not trained).
   ``grouping: trajectory`` (the ablation): K independent episodes per problem.
   ``max_turns`` (a step limit) is passed to a workflow that declares a ``max_turns`` option (``env``).
2. group key: (problem, turn, agent) for the tree: K samples that saw one state and prompt;
   (problem, agent) for trajectory grouping.
3. reward assignment: a candidate's reward is its role's own rewards in its copy's segment plus
   ``alpha *`` the episode's cumulative team reward at the end of the segment (with ``env``: the
   local reward plus ``alpha * team_reward`` of the state it produced); for trajectory grouping a
   sample's own reward plus ``alpha *`` its episode's team return. Where no reward reaches a
   step's role in any candidate's segment (no own reward, no team reward, the episode goes on: an
   early role of a workflow that rewards only its outcome), every candidate's copy is played to the
   end of its episode with one sample per later call (logged, ``tags["rollout"]``, not trained) and
   scored there by the same formula (own rewards + ``alpha *`` the episode's team return), so the
   outcome reaches the early role; its candidates are tagged ``scored_at: "episode_end"``.

Correctness the reference code lacks, each tested: later agents observe the chosen branch's
real state (no stale copies), one group never spans two problems, agents see each other's
output within a turn, and per-role policies update only their own adapter.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Hashable, Sequence

from teamrl.algorithms.base import Algorithm, FinishedEpisode
from teamrl.algorithms.episodes import (
    ContextFactory,
    bind,
    play_out,
    resolve_workflow,
    workflow_roles,
    workflow_options_or_defaults,
)
from teamrl.core.config import option, register_section
from teamrl.core.sample import Sample
from teamrl.tasks.task import Problem, batch_instances
from teamrl.workflows.context import Call, EpisodeContext, RewardEvent
from teamrl.workflows.episode import Branch, EpisodeFn, EpisodeResult, run_episode
from teamrl.workflows.outcome import own_reward

SELECT_MODES = ("greedy", "random")
GROUPINGS = ("tree", "trajectory")


def group_key(sample: Sample) -> Hashable:
    """Tree: the K candidates of one agent at one turn of one problem (they saw one state)."""
    if sample.tags.get("grouping") == "trajectory":
        return (sample.problem_id, sample.role)
    return (sample.problem_id, sample.turn, sample.role)


def _rewarded(copy: Branch, role: str) -> bool:
    """Whether a reward reached ``role`` in a candidate copy's segment: a team reward, one of its own, or the
    episode's end (its final reward)."""
    return copy.done or any(isinstance(e, RewardEvent) and e.role in (None, role) for e in copy.segment)


def select_branch(scores: Sequence[float], mode: str, rng: random.Random) -> int:
    """Index of the branch to continue from: the best (lowest index on ties) or a random one."""
    if mode == "greedy":
        best = max(scores)
        return next(i for i, s in enumerate(scores) if s == best)
    if mode == "random":
        return rng.randrange(len(scores))
    raise ValueError(f"select {mode!r}: choose one of {list(SELECT_MODES)}")


@dataclass
class ATGRPOConfig:
    """The ``at_grpo:`` config section."""

    alpha: float = option(1.0, ge=0, doc="a candidate's reward = its local reward + alpha * team reward")
    select: str = option("greedy", choices=SELECT_MODES, doc="which of the K branches every later step continues from")
    grouping: str = option(
        "tree",
        choices=GROUPINGS,
        doc="tree: groups of K candidates per (problem, turn, agent); trajectory: K independent episodes (ablation)",
    )
    max_turns: int = option(
        0,
        ge=0,
        doc="turn limit (for a workflow with a max_turns option, e.g. env); 0 = the environment's own max_turns",
    )


register_section("at_grpo", ATGRPOConfig)


class ATGRPO(Algorithm):
    """Sampler + group key + reward assignment for AT-GRPO over any replayable workflow (default: ``env``)."""

    name = "at_grpo"
    group_key = staticmethod(group_key)

    def __init__(
        self,
        config: ATGRPOConfig,
        workflow: str | None = None,
        workflow_options: Any = None,
        *,
        k: int = 4,
        seed: int = 0,
    ) -> None:
        """``workflow``: a registered name (None: the task's default, ``env`` for an environment);
        ``workflow_options``: what its ``run`` receives (None: its defaults, ``max_turns`` from its config)."""
        if config.select not in SELECT_MODES:
            raise ValueError(f"select {config.select!r}: choose one of {list(SELECT_MODES)}")
        if config.grouping not in GROUPINGS:
            raise ValueError(f"grouping {config.grouping!r}: choose one of {list(GROUPINGS)}")
        self.config = config
        self.k = k
        self.seed = seed
        self.workflow = workflow
        self.workflow_options = workflow_options
        self.calls = 0  # rollouts so far: seeds the branch-choice RNG of the next one

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint must hold for a resumed run to draw the same random branch choices."""
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict` (on resume)."""
        self.calls = int(state["calls"])

    @property
    def roles(self) -> tuple[str, ...] | None:
        """The role types of the named workflow (None: the task's)."""
        return workflow_roles(self.workflow)

    def rollout(self, problems: Sequence[Problem], task: Any, make_ctx: ContextFactory,
                run: Callable[[list[Awaitable]], list]) -> list[Sample]:
        """Run every problem's episodes together; return all samples with rewards and groups set."""
        self.calls += 1
        rng = random.Random(hash((self.seed, self.calls)) & 0xFFFFFFFF)
        name, spec = resolve_workflow(self.workflow, task)
        options = workflow_options_or_defaults(spec, self.workflow_options, max_turns=self.config.max_turns)
        instances = batch_instances(problems)  # a problem drawn twice: two instances, never one group
        if self.config.grouping == "tree":
            ctxs = [make_ctx(inst, 0, {"grouping": "tree"}) for inst in instances]
            for c in ctxs:
                c.workflow = name
                c.refuse_sub_episodes = self.name  # its candidates cannot align sub-agent calls (m_grpo does)
            results = run([self._tree(c, bind(spec, task, p, options), rng) for c, p in zip(ctxs, problems)])
        else:
            jobs = [(p, make_ctx(inst, e, {"grouping": "trajectory"})) for p, inst in zip(problems, instances)
                    for e in range(self.k)]
            ctxs = [c for _, c in jobs]
            for c in ctxs:
                c.workflow = name
                c.refuse_sub_episodes = self.name  # its candidates cannot align sub-agent calls (m_grpo does)
            results = run([run_episode(bind(spec, task, p, options), c) for p, c in jobs])
            for ctx, result in zip(ctxs, results):
                self._trajectory_rewards(ctx, result)
        self.finished = [FinishedEpisode(c.problem_id, c.episode, r) for c, r in zip(ctxs, results)]
        samples = []
        for ctx, result in zip(ctxs, results):
            solved = bool(result.outcome.correct) if result.outcome is not None else False
            for s in ctx.samples:
                if s.group is None:  # a played-out sample keeps its own (it is not trained)
                    s.group = self.group_key(s)
                s.tags["solved"] = solved
            samples += ctx.samples
        return samples

    async def _tree(self, real: EpisodeContext, start: EpisodeFn, rng: random.Random) -> EpisodeResult:
        """K candidates per frontier call; copy j answers every frontier call with its j-th candidate and runs to
        its next frontier; each candidate is scored on its copy's segment; the episode goes on from the chosen texts."""
        branch = Branch(start, real)
        frontier = await branch.advance()
        while frontier:
            groups = await asyncio.gather(*[real.sample(c.role, c.messages, self.k, c.turn, 0, c.params, c.tags,
                                                        tools=c.tools) for c in frontier])
            copies = [branch.extend([[g[j]] for g in groups]) for j in range(self.k)]
            await asyncio.gather(*[c.advance() for c in copies])
            played = any(not any(_rewarded(c, call.role) for c in copies) for call in frontier)
            if played:  # a role no reward reached yet: each candidate's episode is played out, to credit its outcome
                await asyncio.gather(*[play_out(real, c, {}) for c in copies])
            chosen = [self._score_and_choose(call, group, copies, rng, played) for call, group in zip(frontier, groups)]
            branch.cancel()
            if len(set(chosen)) == 1 and not played:  # one copy holds every chosen text: it stands at the next frontier
                branch = copies[chosen[0]]
            else:
                branch = branch.extend([[g[j]] for g, j in zip(groups, chosen)])
                await branch.advance()
            for c in copies:
                if c is not branch:
                    c.cancel()
            frontier = branch.frontier if not branch.done else []
        assert branch.result is not None
        return branch.result

    def _score_and_choose(self, call: Call, group: list[Sample], copies: list[Branch], rng: random.Random,
                          played: bool = False) -> int:
        """Score each candidate of ``call`` (its role's own rewards after it + alpha * the episode's cumulative team
        reward, at the end of its copy's segment, or of its played-out episode) and choose one."""
        scores = []
        for j, s in enumerate(group):
            local, team = copies[j].own_reward(call.index), copies[j].cumulative_team_reward()
            s.reward = local + self.config.alpha * team
            s.tags.update(local_reward=local, team_reward=team, **({"scored_at": "episode_end"} if played else {}))
            scores.append(s.reward)
        j = select_branch(scores, self.config.select, rng)
        group[j].tags["chosen"] = True
        return j

    def _trajectory_rewards(self, ctx: EpisodeContext, result: EpisodeResult) -> None:
        """Trajectory grouping: a sample's own reward + alpha * its episode's team return."""
        for s in ctx.samples:
            local = own_reward(s) or 0.0
            s.reward = local + self.config.alpha * result.team_return
            s.tags.update(local_reward=local, team_reward=result.team_return)

    @staticmethod
    def metrics(samples: Sequence[Sample]) -> dict[str, float]:
        """Per role and turn: mean reward, its own (local) part, advantage std, share of zero-variance groups;
        success, turns to solve."""
        out: dict[str, float] = {}
        keys = sorted({(s.role, s.turn) for s in samples}, key=lambda x: (x[1], x[0]))
        for role, turn in keys:
            own = [s for s in samples if s.role == role and s.turn == turn]
            adv = [s.advantage or 0.0 for s in own]
            mean_adv = sum(adv) / len(adv)
            rewards = [float(s.reward) for s in own if s.reward is not None]  # every trained sample has one
            out[f"reward/{role}/turn{turn}"] = sum(rewards) / len(own)
            # the role's own reward, without the team's share (plan_path's tool: 1 when its program printed a
            # solving path)
            out[f"local_reward/{role}/turn{turn}"] = sum(float(s.tags.get("local_reward", 0.0)) for s in own) / len(own)
            out[f"adv_std/{role}/turn{turn}"] = (sum((a - mean_adv) ** 2 for a in adv) / len(adv)) ** 0.5
            groups: dict[Hashable, list[float]] = {}
            for s in own:
                if s.reward is not None:
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
