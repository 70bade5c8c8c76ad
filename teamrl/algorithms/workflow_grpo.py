"""Workflow GRPO: group-relative training of a multi-role workflow (the workflow study).

The three places where algorithms differ:
1. sampling: ``group_size`` independent episodes of the workflow (Eval-Opt, Voting,
   Orch-Workers, or the single-agent baseline) per problem, all in flight together;
2. group key: (problem, role type, turn): a sample is compared with the samples of the same
   role type at the same step of the same problem's episodes (the three voting generators of
   G episodes form one group of 3G);
3. reward assignment: a registered reward (``teamrl.workflows.REWARDS``): ``outcome``, the
   episode's final-outcome reward (1 correct, 0 not) for every sample, or ``per_role``, a role's
   own reward where the workflow defines one (evaluator: its verdict was right; aggregator: it
   picked a correct candidate; voting generators: their own answer) and the outcome elsewhere.

``metrics`` turns the last rollout's episode outcomes into the study's diagnostics.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Awaitable, Callable, Hashable, Sequence

from teamrl.core.config import InputError
from teamrl.core.sample import Sample
from teamrl.policies.router import role_type
from teamrl.tasks.solve import SolveTask
from teamrl.tasks.task import Problem
from teamrl.workflows import REWARDS, WORKFLOWS, EpisodeOutcome, Workflow, WorkflowSettings
from teamrl.workflows.context import EpisodeContext

ContextFactory = Callable[[Problem, int, dict], EpisodeContext]


def group_key(sample: Sample) -> Hashable:
    """Samples are compared within (problem, role type, turn)."""
    return (sample.problem_id, role_type(sample.role), sample.turn)


def assign_rewards(samples: Sequence[Sample], outcome: EpisodeOutcome, mode: str) -> None:
    """Each sample's reward from the registered reward ``mode`` (``outcome``: the outcome reward for
    every sample; ``per_role``: a sample's own reward where it has one)."""
    reward = REWARDS.get_entry(mode, "workflow.reward")
    for s in samples:
        value = reward(s, outcome)
        if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):  # a user's reward: named, as a task's is
            raise InputError(f"workflow.reward {mode!r}: returned {value!r} for a {s.role!r} sample; expected a number")
        s.reward = float(value)


class WorkflowGRPO:
    """Sampler + group key + reward assignment for a study workflow on a :class:`SolveTask`."""

    name = "grpo"
    group_key = staticmethod(group_key)

    def __init__(self, workflow: str, group_size: int, settings: Any, reward: str = "outcome") -> None:
        """``workflow`` and ``reward``: registered names (or ``package.module:object``); ``settings``:
        what the workflow's ``run`` receives (:class:`WorkflowSettings`, or its own options)."""
        self.spec: Workflow = WORKFLOWS.get_entry(workflow, "workflow.name")
        REWARDS.get_entry(reward, "workflow.reward")
        self.workflow = workflow
        self.roles = self.spec.role_types
        self.group_size = group_size
        self.settings = settings
        self.reward_mode = reward
        self.outcomes: list[EpisodeOutcome] = []  # of the last rollout

    def episodes(self, problems: Sequence[Problem], task: SolveTask, make_ctx: ContextFactory,
                 run: Callable[[list[Awaitable]], list], episodes_per_problem: int) -> tuple[list[EpisodeContext], list[EpisodeOutcome]]:
        """Run ``episodes_per_problem`` episodes of every problem together; (contexts, outcomes)."""
        fn = self.spec.run
        ctxs = [make_ctx(p, e, {}) for p in problems for e in range(episodes_per_problem)]
        probs = [p for p in problems for _ in range(episodes_per_problem)]
        outcomes = run([fn(ctx, task, p, self.settings) for p, ctx in zip(probs, ctxs)])
        return ctxs, outcomes

    def rollout(self, problems: Sequence[Problem], task: SolveTask, make_ctx: ContextFactory,
                run: Callable[[list[Awaitable]], list]) -> list[Sample]:
        """Run G episodes per problem (one engine batch per policy per step) and return the samples."""
        ctxs, self.outcomes = self.episodes(problems, task, make_ctx, run, self.group_size)
        if all(o.stats.get("dropped") for o in self.outcomes):  # gateway episodes: none reported a reward in time
            raise InputError(f"workflow {self.workflow!r}: all {len(self.outcomes)} episodes of this step were dropped (no reward "
                             "within workflow.options.reward_timeout_s); nothing to train on")
        samples: list[Sample] = []
        for ctx, outcome in zip(ctxs, self.outcomes):
            assign_rewards(ctx.samples, outcome, self.reward_mode)
            for s in ctx.samples:
                s.group = self.group_key(s)
                s.tags["correct"] = outcome.correct
            samples += ctx.samples
        return samples

    def evaluate(self, problems: Sequence[Problem], task: SolveTask, make_ctx: ContextFactory,
                 run: Callable[[list[Awaitable]], list]) -> dict[str, float]:
        """One episode per problem (the caller's contexts decide the sampling, e.g. greedy);
        accuracy and the workflow's diagnostics. Trains nothing and keeps no state."""
        _, outcomes = self.episodes(problems, task, make_ctx, run, 1)
        return outcome_metrics(self.workflow, outcomes)

    def metrics(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Episode correctness and the workflow's diagnostics over the last rollout."""
        return outcome_metrics(self.workflow, self.outcomes)


def outcome_metrics(workflow: str, outcomes: Sequence[EpisodeOutcome]) -> dict[str, float]:
    """Accuracy plus, per workflow: Eval-Opt evaluator confusion (rates over all evaluations),
    first-attempt vs final accuracy and iterations used; Voting generator agreement, oracle
    any-correct, aggregator misses and recoveries; Orch-Workers subtasks per plan and the
    over-limit rate."""
    n = len(outcomes)
    if not n:
        return {}
    out: dict[str, Any] = {"accuracy": sum(o.correct for o in outcomes) / n}
    if any("dropped" in o.stats for o in outcomes):  # gateway episodes: those without a reward in time
        out["episodes_dropped"] = sum(bool(o.stats["dropped"]) for o in outcomes)
    if workflow == "eval_opt":
        out["first_attempt_accuracy"] = sum(o.stats["first_correct"] for o in outcomes) / n
        out["iterations_mean"] = sum(o.stats["iterations"] for o in outcomes) / n
        judged = [(v, c) for o in outcomes for v, c in o.stats["verdicts"]]
        if judged:
            m = len(judged)
            out["evaluator/true_correct"] = sum(bool(v) and c for v, c in judged) / m
            out["evaluator/false_correct"] = sum(bool(v) and not c for v, c in judged) / m
            out["evaluator/true_incorrect"] = sum(not v and not c for v, c in judged) / m
            out["evaluator/false_incorrect"] = sum(not v and c for v, c in judged) / m
            out["evaluator/unparsed"] = sum(v is None for v, _ in judged) / m
    elif workflow == "voting":
        agreement = Counter(o.stats["agreement"] for o in outcomes)
        for k in ("all_right", "all_wrong", "split"):
            out[f"voting/{k}"] = agreement[k] / n
        out["voting/oracle_accuracy"] = sum(o.stats["oracle"] for o in outcomes) / n
        out["voting/aggregator_miss"] = sum(o.stats["miss"] for o in outcomes) / n
        out["voting/aggregator_recovery"] = sum(o.stats["recovery"] for o in outcomes) / n
        out["voting/choice_parsed"] = sum(o.stats["choice_source"] == "parsed" for o in outcomes) / n
    elif workflow == "orch_workers":
        out["orch/subtasks_mean"] = sum(o.stats["subtasks"] for o in outcomes) / n
        out["orch/over_limit"] = sum(o.stats["over_limit"] for o in outcomes) / n
    return out
