"""Workflows: roles and their turn structure, written as plain Python against :class:`EpisodeContext`.

``WORKFLOWS`` is a :class:`~teamrl.core.registry.Registry` of workflows in the one episode protocol
(:mod:`teamrl.workflows.context`, docs/episodes.md): every algorithm trains any of them. Shipped: the
task kinds' defaults ``single``, ``team``, ``env``, ``research`` (``research_single``)
(:func:`default_workflow`, :mod:`teamrl.workflows.adapters`) and the study workflows ``eval_opt``,
``voting`` and ``orch_workers`` (on a :class:`~teamrl.tasks.solve.SolveTask`); add your own with
``@register_workflow("name", roles=(...))``. Each entry gives the episode function and its role types
(instances such as ``generator0`` share their type's policy) and, optionally, its ``summary``: the
function that turns a batch of its episodes' outcomes into its own statistics (the study workflows'
diagnostics), read through :func:`outcome_metrics` by the algorithms and ``teamrl eval``, which
name no workflow.

:func:`eval_baselines` declares, per workflow, the baselines ``teamrl eval`` compares a run of it
with (the one place that does).

``REWARDS`` holds how an episode's outcome becomes each sample's reward (``workflow.reward``):
``outcome`` and ``per_role`` are shipped; add your own with ``@register_reward("name")``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from teamrl.core.config import ConfigError, InputError, register_moved_key
from teamrl.core.registry import Registry
from teamrl.core.sample import Sample
from teamrl.tasks.environment import Environment
from teamrl.tasks.research import ResearchEnv
from teamrl.tasks.solve import SolveTask
from teamrl.tasks.task import Task, TeamTask
from teamrl.workflows import adapters, eval_opt as eval_opt_module, orch_workers as orch_workers_module, team_baselines
from teamrl.workflows import voting as voting_module
from teamrl.workflows.eval_opt import eval_opt
from teamrl.workflows.orch_workers import orch_workers
from teamrl.workflows.outcome import EpisodeOutcome, Summary, StudyOptions, own_reward
from teamrl.workflows.research_team import research, research_solo
from teamrl.workflows.voting import voting


@dataclass(frozen=True)
class Workflow:
    """A workflow: its episode coroutine ``run(ctx, task, problem, settings)`` and the role types it uses.

    ``options``: the workflow's own options dataclass; ``workflow.options`` in the config is
    validated against it and passed as ``settings`` (the study workflows share :class:`StudyOptions`:
    ``max_iterations``, ``num_generators``, ``max_subtasks``). Without one, ``settings`` is None.
    ``role_types`` empty: the roles are the task's (the default adapters). ``sub_roles``: the roles
    that act in nested sub-episodes (``ctx.sub_episode``; M-GRPO needs one). ``replayable`` False:
    its episodes cannot be branched by replay (a black box that is not deterministic given its
    texts), so the branching algorithms (magrpo, at_grpo) refuse it. ``summary``: its own statistics
    over a batch of its episodes' outcomes (metric name -> number), logged beside the accuracy by
    GRPO's step metrics and evaluations and shown by ``teamrl eval`` (:func:`outcome_metrics`);
    None: ``teamrl eval`` shows the mean of each numeric ``stats`` entry instead. ``formats``: what
    ``teamrl eval`` counts as a valid reply of a role that does not give the task's answer (role
    type -> ``check(text) -> bool``, or None for a free-text role that is not judged); every role not
    named is judged by the task's own ``valid`` hook (:func:`~teamrl.tasks.task.reply_valid`).
    ``demonstrations``: ``(task, problem, settings) -> [(role type, messages, completion)]``, the warm start
    (``teamrl sft``) in the workflow's own prompts and formats; None: the task's own demonstrations.
    """

    run: Callable[..., Awaitable[Any]]
    role_types: tuple[str, ...]
    options: type | None = None
    sub_roles: tuple[str, ...] = ()
    replayable: bool = True
    task_kind: type | None = None  # the task class it runs on (None: any)
    summary: Summary | None = None
    demonstrations: Callable[..., list[Any]] | None = None
    # roles that do not give the task's answer (teamrl eval's valid replies): role -> check of a reply, None = free text
    # a dict: not hashed
    formats: Mapping[str, Callable[[str], bool] | None] | None = field(default=None, compare=False)

    def roles_for(self, task: Any) -> tuple[str, ...]:
        """The role types acting on ``task``: the workflow's own, or (default adapters) the task's."""
        return self.role_types or tuple(task.roles)


def _workflow(obj: Any) -> Workflow:
    """What a ``workflow.name: package.module:object`` reference names: a Workflow or a decorated function."""
    found = obj if isinstance(obj, Workflow) else getattr(obj, "teamrl_workflow", None)
    if not isinstance(found, Workflow):
        raise ConfigError(f"workflow.name: {obj!r} is not a workflow; decorate the episode function with "
                          "@register_workflow(name, roles=(...))")
    return found


WORKFLOWS: Registry[Workflow] = Registry("workflow", convert=_workflow)
WORKFLOWS.register("single", Workflow(adapters.single, ("agent",), task_kind=Task))
WORKFLOWS.register("team", Workflow(adapters.team, (), options=adapters.TeamOptions, task_kind=TeamTask))
WORKFLOWS.register("env", Workflow(adapters.env, (), options=adapters.EnvOptions, task_kind=Environment))
WORKFLOWS.register("research", Workflow(research, ("main", "sub"), sub_roles=("sub",), task_kind=ResearchEnv))
WORKFLOWS.register("research_single", Workflow(research_solo, ("main",), task_kind=ResearchEnv))
WORKFLOWS.register("eval_opt", Workflow(eval_opt, ("generator", "evaluator"), options=StudyOptions, task_kind=SolveTask,
                                        summary=eval_opt_module.summary, formats=eval_opt_module.FORMATS,
                                        demonstrations=eval_opt_module.demonstrations))
WORKFLOWS.register("voting", Workflow(voting, ("generator", "aggregator"), options=StudyOptions, task_kind=SolveTask,
                                      summary=voting_module.summary, formats=voting_module.FORMATS,
                                      demonstrations=voting_module.demonstrations))
# the study workflows' options were top-level workflow keys before: a config that gives one fails, naming its place
for _key in ("max_iterations", "num_generators", "max_subtasks"):
    register_moved_key(f"workflow.{_key}", f"workflow.options.{_key}")
WORKFLOWS.register(
    "orch_workers",
    Workflow(
        orch_workers,
        ("orchestrator", "worker", "synthesizer"),
        options=StudyOptions,
        task_kind=SolveTask,
        summary=orch_workers_module.summary,
        formats=orch_workers_module.FORMATS,
    ),
)

TASK_KINDS = {Task: "a one-role task", TeamTask: "a team task (roles acting together)",
              Environment: "a multi-turn environment (plan_path, sokoban, sudoku, ...)",
              ResearchEnv: "the research environment (task.name=research)",
              SolveTask: "a task with one verifiable answer (math.solve, code.solve)"}


def check_task(name: str, spec: Workflow, task: Any) -> None:
    """Refuse a workflow on a task it cannot run on (its ``task_kind``), naming both."""
    if spec.task_kind is not None and not isinstance(task, spec.task_kind):
        kind = TASK_KINDS.get(spec.task_kind, spec.task_kind.__name__)
        raise ConfigError(f"workflow.name: {name!r} runs on {kind}; task {getattr(task, 'name', task)!r} is not one")


def register_workflow(name: str, roles: tuple[str, ...], options: type | None = None, sub_roles: tuple[str, ...] = (),
                      replayable: bool = True, summary: Summary | None = None,
                      formats: Mapping[str, Callable[[str], bool] | None] | None = None,
                      demonstrations: Callable[..., list[Any]] | None = None) -> Callable:
    """Decorator: register an ``async def run(ctx, task, problem, settings) -> EpisodeOutcome | float | None``
    as ``workflow.name: <name>`` with its role types (and its options dataclass, if it has one; the
    roles of its sub-episodes; ``replayable=False`` if it is not deterministic given its texts;
    ``summary(outcomes) -> {metric: number}``, its own statistics over a batch of its outcomes;
    ``formats``, the roles that do not give the task's answer, as :class:`Workflow` documents;
    ``demonstrations(task, problem, settings) -> [(role type, messages, completion)]``, its warm start).
    The function is returned unchanged, with the :class:`Workflow` in ``fn.teamrl_workflow``."""
    if isinstance(roles, str) or not roles or not all(isinstance(r, str) and r for r in roles):
        raise ConfigError(f"register_workflow {name!r}: roles must be a tuple of role names, got {roles!r}")
    if formats is not None and (
        not isinstance(formats, Mapping)
        or not all(isinstance(r, str) and (c is None or callable(c)) for r, c in formats.items())
    ):
        raise ConfigError(f"register_workflow {name!r}: formats must map role names to a check(text) -> bool or None, "
                          f"got {formats!r}")
    if demonstrations is not None and not callable(demonstrations):
        raise ConfigError(f"register_workflow {name!r}: demonstrations must be callable (task, problem, settings) -> "
                          f"[(role, messages, completion)] or None, got {demonstrations!r}")
    if summary is not None and not callable(summary):
        raise ConfigError(
            f"register_workflow {name!r}: summary must be callable (outcomes -> {{metric: number}}) or None, "
            f"got {summary!r}"
        )

    def add(fn: Callable[..., Awaitable[EpisodeOutcome]]) -> Callable[..., Awaitable[EpisodeOutcome]]:
        # a plain def would fail only at the first episode (EpisodeOutcome can't be used in 'await' expression);
        # a decorator that keeps functools.wraps' __wrapped__ of an async def is fine
        if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(inspect.unwrap(fn))):
            raise ConfigError(
                f"register_workflow {name!r}: {getattr(fn, '__qualname__', fn)!r} is not a coroutine "
                "function; write it as async def run(ctx, task, problem, settings) and await ctx.generate"
            )
        spec = Workflow(fn, tuple(roles), options, tuple(sub_roles), replayable, summary=summary, formats=formats,
                        demonstrations=demonstrations)
        fn.teamrl_workflow = WORKFLOWS.register(name, spec)  # type: ignore[attr-defined]
        return fn

    return add


def outcome_metrics(workflow: str | Workflow, outcomes: Sequence[EpisodeOutcome]) -> dict[str, float]:
    """A batch of one workflow's episode outcomes as metrics: ``accuracy`` (the share correct),
    ``episodes_dropped`` where episodes report ``stats["dropped"]`` (gateway episodes without a reward
    in time), then the workflow's registered ``summary``. ``workflow``: a :class:`Workflow` or its
    name (an unregistered name: no summary). No outcomes: no metrics."""
    n = len(outcomes)
    if not n:
        return {}
    out: dict[str, float] = {"accuracy": sum(o.correct for o in outcomes) / n}
    if any("dropped" in o.stats for o in outcomes):
        out["episodes_dropped"] = sum(bool(o.stats["dropped"]) for o in outcomes)
    spec = workflow if isinstance(workflow, Workflow) else _lookup(workflow)
    if spec is not None and spec.summary is not None:
        summary = spec.summary(outcomes)
        if not isinstance(summary, Mapping) or not all(isinstance(k, str) and isinstance(v, (bool, int, float))
                                                       for k, v in summary.items()):
            name = workflow if isinstance(workflow, str) else getattr(workflow.run, "__qualname__", repr(workflow.run))
            raise InputError(f"workflow {name!r}: its summary returned {summary!r}; "
                             "expected a dict of name -> number")
        for k, v in summary.items():
            out.setdefault(k, float(v))  # accuracy stays the episodes' own
    return out


def _lookup(name: str) -> Workflow | None:
    """The workflow registered as ``name`` (or named by ``package.module:object``); None for any other name."""
    if ":" in name:
        return WORKFLOWS.get_entry(name, "workflow.name")
    return WORKFLOWS.get(name)


def default_workflow(task: Any) -> str:
    """The workflow that runs ``task`` when ``workflow.name`` is empty: the one place that tells task kinds apart."""
    if isinstance(task, ResearchEnv):
        return "research"
    if isinstance(task, Environment):
        return "env"
    if isinstance(task, TeamTask):
        return "team"
    if isinstance(task, Task):
        return "single"
    raise ConfigError(f"task {getattr(task, 'name', task)!r}: not a Task, TeamTask, Environment or ResearchEnv; "
                      "name a workflow with workflow.name")


@dataclass(frozen=True)
class Baseline:
    """A ``teamrl eval`` method besides the run's own workflow on its trained (``team``) or base
    (``untrained``) weights: the workflow it runs (None: the run's own) and the weights its roles
    use: ``base`` (adapters off) or ``swapped`` (each role the next role's trained policy).
    ``widen``: the one agent writing every part gets the whole team's token budget. ``by_default``:
    run when no ``--method`` is given (False where it repeats ``untrained``)."""

    name: str  # the workflow's name, for its statistics and messages
    workflow: Workflow | None
    weights: str = "base"
    widen: bool = False
    by_default: bool = True
    doc: str = ""


_SINGLE = Baseline("single", WORKFLOWS.get("single"), doc="one agent answers the task's prompt, base model")
_BASELINES: dict[str, dict[str, Baseline]] = {
    "single": {
        "single": Baseline("single", WORKFLOWS.get("single"), by_default=False, doc="the untrained agent itself")
    },
    "team": {
        "single": Baseline(
            "single",
            Workflow(team_baselines.scored(team_baselines.single), (), task_kind=TeamTask),
            widen=True,
            doc="one agent writes every part in one answer (the task splits it), the team's token budget",
        ),
        "concat": Baseline(
            "concat",
            Workflow(team_baselines.scored(team_baselines.parallel), (), task_kind=TeamTask),
            by_default=False,
            doc="the roles answer at once without coordination (the untrained team of one turn)",
        ),
        "sequential": Baseline(
            "sequential",
            Workflow(team_baselines.scored(team_baselines.sequential), (), task_kind=TeamTask),
            doc="the roles answer in order, each seeing the earlier roles' outputs",
        ),
        "discussion": Baseline(
            "discussion",
            Workflow(team_baselines.scored(team_baselines.discussion), (), task_kind=TeamTask),
            doc="parallel drafts, then each role revises after seeing the others'",
        ),
    },
    "env": {
        "single": Baseline(
            "single",
            Workflow(adapters.env_last_role, (), task_kind=Environment),
            doc="only the environment's last role acts (one agent doing the task alone)",
        ),
        "swapped": Baseline("env", None, weights="swapped", doc="each role acts with the next role's trained policy"),
    },
    "research": {
        "single": Baseline("research_single", WORKFLOWS.get("research_single"), doc="one agent with the tools")
    },
    "research_single": {
        "single": Baseline(
            "research_single", WORKFLOWS.get("research_single"), by_default=False, doc="the untrained agent itself"
        )
    },
}


def eval_baselines(workflow: str) -> dict[str, Baseline]:
    """The baselines ``teamrl eval`` runs for a run of ``workflow`` (method -> :class:`Baseline`): a team
    task's prompt baselines, an environment's last role alone and the swapped team, research's single
    agent with the tools; any other workflow (the study workflows, users'): the ``single`` workflow."""
    return _BASELINES.get(workflow, {"single": _SINGLE})


RewardFn = Callable[[Sample, EpisodeOutcome], float]
REWARDS: Registry[RewardFn] = Registry("reward")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn(sample, outcome) -> float`` as ``workflow.reward: <name>``."""
    return REWARDS.register(name)


@register_reward("outcome")
def outcome_reward(sample: Sample, outcome: EpisodeOutcome) -> float:
    """Every sample gets the final answer's correctness (1 or 0)."""
    return outcome.reward


@register_reward("per_role")
def per_role_reward(sample: Sample, outcome: EpisodeOutcome) -> float:
    """A sample's own reward where the workflow set one (``sample.role_reward``), else the outcome."""
    own = own_reward(sample)
    return own if own is not None else outcome.reward


__all__ = [
    "REWARDS",
    "WORKFLOWS",
    "Baseline",
    "EpisodeOutcome",
    "Workflow",
    "StudyOptions",
    "check_task",
    "default_workflow",
    "eval_baselines",
    "outcome_metrics",
    "register_reward",
    "register_workflow",
]
