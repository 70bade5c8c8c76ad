"""Running episodes of a workflow, and branching them by replay.

An episode is a workflow coroutine ``run(ctx, task, problem, settings)`` (see
:mod:`teamrl.workflows.context`). Samplers see it as a function of its context only
(:data:`EpisodeFn`) and get, when it ends, an :class:`EpisodeResult`: what it returned and its
**team return** (the final team reward plus every team reward it reported with ``ctx.reward``).
The final team reward is ``outcome.reward`` for an :class:`EpisodeOutcome` (its ``team_reward``
if set, else 1/0 by correctness), the number itself for a float, 0 for None.

**Branching by replay.** A sampler that branches an episode (AT-GRPO's K candidates, MAGRPO's
joint actions) never copies environment state. A branch copy (:class:`Branch`) is a *fresh run*
of the workflow coroutine through a :class:`ReplayContext` holding a *script*: the recorded
Samples of the episode's first calls, in issue order. The copy's first calls return their
scripted Samples (the same objects, not recorded again); its first unscripted calls pause: they
are the **frontier**. :meth:`Branch.advance` runs the copy until it is blocked, detecting
quiescence as :class:`~teamrl.rollout.scheduler.GenerationScheduler` does (yield until the set
of pending calls and the event log stay unchanged for a few loop iterations, or the coroutine
finished); while it runs, the scheduler holds its flush, so the frontier calls of every problem's
branches are sampled in one batch. The sampler samples the frontier calls through the real
recording context (:meth:`~teamrl.workflows.context.EpisodeContext.sample`) and either resolves
them (:meth:`Branch.resolve`: the copy continues) or extends the script with them
(:meth:`Branch.extend`: a new copy that replays up to and including those answers).

State is rebuilt by the workflow from the texts it receives, so it cannot go stale; this is exact
because a workflow is deterministic given its texts (its randomness comes from ``ctx.rng``, which
a copy reseeds identically). Rewards reported while a copy replays its prefix are recomputed and
ignored: a copy's **segment** is what it logged after its last scripted call returned (or after
:meth:`Branch.resolve`), and only the segment's rewards are credited to the branch.

A **step** is the set of calls pending at once when the episode is blocked: calls issued together
with ``asyncio.gather`` are one step; a sequential workflow has one call per step.

**A workflow that fails.** An exception raised by the user's own code that an episode runs (the
workflow, its task's methods) becomes a :class:`WorkflowError`: one line naming the workflow, the
exception, the file and line where it was raised, the problem, the episode and the role of its last
call (``teamrl`` prints it, exit 2; ``TEAMRL_TRACEBACK=1`` prints the traceback too). A ``run`` that
is not ``async`` is one too. An exception raised inside teamrl's own code keeps its traceback (a bug).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

from teamrl.core.config import InputError
from teamrl.core.sample import Sample
from teamrl.workflows.context import BaseContext, Call, EpisodeContext, RewardEvent, own_rewards, team_rewards, total
from teamrl.workflows.outcome import EpisodeOutcome, own_reward, set_own_reward

EpisodeFn = Callable[[Any], Awaitable[Any]]  # a workflow bound to its task, problem and settings: ctx -> result

QUIET_ITERATIONS = 3  # loop iterations without change before a branch counts as blocked (as the scheduler's settle)

_TEAMRL_DIR = str(Path(__file__).resolve().parents[1]) + os.sep  # the teamrl package
_LIBRARY_DIRS = tuple(sorted({os.path.realpath(sysconfig.get_paths()[k]) + os.sep
                              for k in ("stdlib", "platstdlib", "purelib", "platlib")}))


class WorkflowError(InputError):
    """The user's code in an episode raised (or a workflow's ``run`` is not ``async``); one line naming
    the workflow, the exception, where it was raised, the problem, the episode and the last call's role."""


def _user_frame(tb: Any) -> traceback.FrameSummary | None:
    """The innermost frame of ``tb`` in the user's code: not teamrl's, the standard library's or an installed
    package's. None when the innermost such frame is teamrl's own (a bug in teamrl keeps its traceback)."""
    for frame in reversed(traceback.extract_tb(tb)):
        if frame.filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
            continue
        path = os.path.realpath(frame.filename)
        if path.startswith(_TEAMRL_DIR):
            return None
        if not path.startswith(_LIBRARY_DIRS):
            return frame
    return None


def _where(ctx: BaseContext) -> str:
    """(problem, episode, the role of the last call) of an episode, for its errors."""
    calls = ctx.calls
    last = f"last call: role {calls[-1].role!r}" if calls else "before any ctx.generate call"
    return f"problem {ctx.problem_id!r}, episode {ctx.episode}, {last}"


async def run_workflow(start: EpisodeFn, ctx: BaseContext) -> Any:
    """Run the episode ``start(ctx)`` and return what it returned; an error in the user's code is a
    :class:`WorkflowError` (see the module docstring), anything else propagates unchanged."""
    name = ctx.workflow or "?"
    try:
        episode = start(ctx)
        if not inspect.isawaitable(episode):
            raise WorkflowError(f"workflow {name!r}: its run returned {type(episode).__name__} instead of a coroutine "
                                f"({_where(ctx)}); write it as async def run(ctx, task, problem, settings)")
        return await episode
    except InputError:
        raise
    except Exception as e:
        frame = _user_frame(e.__traceback__)
        if frame is None:
            raise
        message = " ".join(str(e).split())
        raise WorkflowError(f"workflow {name!r} raised {type(e).__name__}{': ' + message if message else ''} at "
                            f"{frame.filename}:{frame.lineno} in {frame.name} ({_where(ctx)}); fix it there, or set "
                            "TEAMRL_TRACEBACK=1 to see the traceback") from e


@dataclass
class EpisodeResult:
    """A finished episode: what the workflow returned, its final team reward and its team return."""

    returned: Any
    final_reward: float
    team_return: float

    @property
    def outcome(self) -> EpisodeOutcome | None:
        """The workflow's :class:`EpisodeOutcome`, when it returned one."""
        return self.returned if isinstance(self.returned, EpisodeOutcome) else None


def final_reward(returned: Any, workflow: str) -> float:
    """The final team reward of what a workflow returned (EpisodeOutcome, a number or None)."""
    if returned is None:
        return 0.0
    if isinstance(returned, EpisodeOutcome):
        return returned.reward
    if isinstance(returned, (str, bytes)) or not hasattr(type(returned), "__float__"):
        raise InputError(
            f"workflow {workflow or '?'!r}: returned {returned!r} ({type(returned).__name__}); expected an "
            "EpisodeOutcome, a number (the final team reward) or None (rewards reported with ctx.reward)"
        )
    return float(returned)


def finish(ctx: BaseContext, returned: Any) -> EpisodeResult:
    """The :class:`EpisodeResult` of an episode that returned ``returned`` through ``ctx``."""
    final = final_reward(returned, ctx.workflow)
    return EpisodeResult(returned, final, total([team_rewards(ctx.events), final]))


def record_own_rewards(ctx: BaseContext) -> None:
    """Give every sample whose role reported rewards after its call (before the role's next call)
    that sum as its own reward, unless the workflow set one directly."""
    owns = own_rewards(ctx.events)
    for call in ctx.calls:
        if call.index in owns:
            for s in call.samples:
                if own_reward(s) is None:
                    set_own_reward(s, owns[call.index])


async def run_episode(start: EpisodeFn, ctx: EpisodeContext) -> EpisodeResult:
    """Run one episode to its end through the recording context; own rewards recorded on its samples."""
    result = finish(ctx, await run_workflow(start, ctx))
    record_own_rewards(ctx)
    return result


class ReplayContext(BaseContext):
    """The context of a branch copy: scripted answers for its first calls, pending futures after them."""

    def __init__(self, real: EpisodeContext, script: Sequence[list[Sample]]) -> None:
        super().__init__(real.problem_id, real.episode, real.tags, real.params, seed=real.seed, workflow=real.workflow)
        self.cache = real.cache  # a copy reuses what the episode's other copies computed from the same texts
        self.refuse_sub_episodes = real.refuse_sub_episodes
        self.real = real
        self.script = list(script)
        self.pending: list[tuple[Call, asyncio.Future]] = []
        self.segment_start = 0  # index into events where the copy's own segment begins

    async def _answer(self, call: Call, branch: int) -> list[Sample]:
        if call.index < len(self.script):
            samples = self.script[call.index]
            if samples and (samples[0].role != call.role or len(samples) != call.n):
                raise InputError(
                    f"workflow {self.workflow or '?'!r} is not deterministic given its texts: on replay its call "
                    f"{call.index} asked role {call.role!r} for {call.n} completion(s), the recorded call was "
                    f"{samples[0].role!r} with {len(samples)}; draw randomness from ctx.rng only"
                )
            if call.index == len(self.script) - 1:
                self.segment_start = len(self.events)
            return samples
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.pending.append((call, future))
        return await future


class Branch:
    """One copy of an episode, replayed from a script (see the module docstring)."""

    def __init__(self, start: EpisodeFn, real: EpisodeContext, script: Sequence[list[Sample]] = ()) -> None:
        self.start = start
        self.real = real
        self.ctx = ReplayContext(real, script)
        self.result: EpisodeResult | None = None
        self._task: asyncio.Future | None = None

    @property
    def done(self) -> bool:
        """Whether the episode ended."""
        return self.result is not None

    @property
    def frontier(self) -> list[Call]:
        """The pending calls, in issue order."""
        return sorted((c for c, _ in self.ctx.pending), key=lambda c: c.index)

    async def advance(self) -> list[Call]:
        """Run the copy until it is blocked on its frontier (returned) or finished (``[]``; see :attr:`result`)."""
        scheduler = self.real.scheduler
        if self._task is None:
            self._task = asyncio.ensure_future(run_workflow(self.start, self.ctx))
        scheduler.holds += 1
        try:
            still, last = 0, None
            while True:
                await asyncio.sleep(0)
                if self._task.done():
                    self.result = finish(self.ctx, self._task.result())  # re-raises the workflow's error
                    record_own_rewards(self.ctx)
                    return []
                state = (len(self.ctx.events), len(self.ctx.pending))
                still, last = (still + 1 if state == last else 0), state
                if still < QUIET_ITERATIONS:
                    continue
                if self.ctx.pending:
                    return self.frontier
                scheduler.holds -= 1  # it waits on something else (a sandbox run): the others may generate meanwhile
                try:
                    await asyncio.wait({self._task}, timeout=0.01)
                finally:
                    scheduler.holds += 1
                still = 0
        finally:
            scheduler.holds -= 1

    def resolve(self, answers: Sequence[list[Sample]]) -> None:
        """Answer the frontier (one list of Samples per frontier call, in issue order); the copy goes on
        with a new segment at its next :meth:`advance`."""
        pending = sorted(self.ctx.pending, key=lambda cf: cf[0].index)
        if len(answers) != len(pending):
            raise ValueError(f"resolve: {len(answers)} answers for {len(pending)} frontier calls")
        self.ctx.pending = []
        self.ctx.segment_start = len(self.ctx.events)
        for (call, future), samples in zip(pending, answers):
            self.ctx.script.append(samples)
            future.set_result(samples)

    def extend(self, answers: Sequence[list[Sample]]) -> "Branch":
        """A new copy that replays this one's calls and answers its frontier with ``answers`` (issue order)."""
        frontier = self.frontier
        if len(answers) != len(frontier):
            raise ValueError(f"extend: {len(answers)} answers for {len(frontier)} frontier calls")
        return Branch(self.start, self.real, self.ctx.script + list(answers))

    def cancel(self) -> None:
        """Stop the copy's coroutine (a branch not continued)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()

    # ---- rewards ---------------------------------------------------------------------
    @property
    def segment(self) -> list[Call | RewardEvent]:
        """What the copy logged since its branch point."""
        return self.ctx.events[self.ctx.segment_start:]

    def segment_team_reward(self) -> float:
        """The team rewards of the segment, plus the final team reward if the episode ended in it."""
        final = self.result.final_reward if self.result else 0.0
        return total([team_rewards(self.segment), final])

    def cumulative_team_reward(self) -> float:
        """Every team reward of the episode so far, plus the final team reward if it ended."""
        final = self.result.final_reward if self.result else 0.0
        return total([team_rewards(self.ctx.events), final])

    def own_reward(self, call_index: int) -> float:
        """The rewards the role of call ``call_index`` reported after it (and before its next call), so far."""
        return own_rewards(self.ctx.events).get(call_index, 0.0)
