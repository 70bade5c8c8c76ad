"""Algorithms: samplers over the episode protocol, each with a group key and a reward assignment.

``ALGORITHMS`` is a :class:`~teamrl.core.registry.Registry` of :class:`AlgorithmEntry`: how to
build the algorithm from a config and which workflows it cannot train (:func:`refusal`).
``make_algorithm`` builds the configured one, after checking the (algorithm, workflow) pair:
it is called before any model loads, so a pair that cannot work is refused with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from teamrl.algorithms.at_grpo import ATGRPO, ATGRPOConfig
from teamrl.algorithms.base import Algorithm
from teamrl.algorithms.grpo import GRPO, WorkflowGRPO
from teamrl.algorithms.m_grpo import MGRPO, MGRPOConfig
from teamrl.algorithms.magrpo import MAGRPO, MAGRPOConfig
from teamrl.core.config import Config, ConfigError, build_dataclass, register_check, register_choices
from teamrl.core.registry import Registry
from teamrl.workflows import WORKFLOWS, Workflow, check_task, default_workflow
from teamrl.workflows.research_team import research


@dataclass(frozen=True)
class AlgorithmEntry:
    """A registered algorithm: ``build(cfg, workflow, options)`` (workflow None: the task's default;
    options None: the workflow's defaults), ``refuse(workflow_name, workflow, cfg)``: the reason
    it cannot train that workflow, or None, and ``credit``: how it credits the rewards a workflow
    reports when it does not apply ``workflow.reward`` (None: it applies it)."""

    build: Callable[[Config, str | None, Any], Algorithm]
    refuse: Callable[[str, Workflow, Config], str | None] = lambda name, spec, cfg: None
    # how it turns the rewards a workflow reports into each sample's reward, where it does not apply ``workflow.reward``
    # (None: it applies it, as grpo does); a workflow.reward other than ``outcome`` is refused, naming this
    credit: str | None = "it credits the rewards the workflow reports by its own rule"


def _one_call(algorithm: str, needs: str) -> Callable[[str, Workflow, Config], str | None]:
    """Branching algorithms: refuse black-box workflows, the one-call ``single`` workflow and research's sub-agents
    (another workflow's sub-episodes are refused when it opens one: ``EpisodeContext.refuse_sub_episodes``)."""
    def refuse(name: str, spec: Workflow, cfg: Config) -> str | None:  # sub-episodes of other workflows: when opened
        if not spec.replayable:
            return (f"{algorithm} branches episodes by replaying their calls; workflow {name!r} is registered with "
                    "replayable=False (not deterministic given its texts): use algorithm=grpo")
        if name == "single":
            return (f"{algorithm} needs {needs}; workflow 'single' is one agent's one call (branching it is GRPO): "
                    "use algorithm=grpo")
        if spec.run is research:
            return (f"{algorithm} does not train the sub-agents of workflow {name!r} (its sub-episodes need m_grpo's "
                    "alignment and rewards flowing down): use algorithm=m_grpo")
        return None
    return refuse


def _grpo_refuse(name: str, spec: Workflow, cfg: Config) -> str | None:
    # The research team exists to call its sub-agent: refused before any model loads. Any other workflow is refused
    # only if it opens a sub-episode (ctx.sub_episode refuses then): declaring sub_roles alone trains.
    if spec.run is research:
        return (
            f"grpo does not align the sub-agent calls of workflow {name!r} (the research environment's sub-episodes): "
            "use algorithm=m_grpo (m_grpo.agents=single for one agent with the tools)"
        )
    return None


def _m_grpo_refuse(name: str, spec: Workflow, cfg: Config) -> str | None:
    if cfg.section(MGRPOConfig).agents == "team" and not spec.sub_roles:
        return (f"m_grpo runs on the research environment (task.name=research) or a workflow with sub-episodes "
                f"(registered with sub_roles=...); workflow {name!r} opens none")
    return None


def _build_grpo(cfg: Config, workflow: str | None, options: Any) -> Algorithm:
    return GRPO(
        cfg.rollout.group_size,
        greedy_baseline=cfg.train.advantage == "max",
        workflow=workflow,
        options=options,
        reward=cfg.workflow.reward,
    )


def _build_magrpo(cfg: Config, workflow: str | None, options: Any) -> Algorithm:
    return MAGRPO(cfg.section(MAGRPOConfig), workflow, options, group_size=cfg.rollout.group_size)


def _build_at_grpo(cfg: Config, workflow: str | None, options: Any) -> Algorithm:
    return ATGRPO(cfg.section(ATGRPOConfig), workflow, options, k=cfg.rollout.group_size, seed=cfg.seed)


def _build_m_grpo(cfg: Config, workflow: str | None, options: Any) -> Algorithm:
    return MGRPO(cfg.section(MGRPOConfig), workflow, options, k=cfg.rollout.group_size, seed=cfg.seed)


ALGORITHMS: Registry[AlgorithmEntry] = Registry("algorithm")
ALGORITHMS.register("grpo", AlgorithmEntry(_build_grpo, _grpo_refuse, credit=None))
ALGORITHMS.register("magrpo", AlgorithmEntry(
    _build_magrpo, _one_call("magrpo", "a team task or a workflow of several calls"),
    credit="it credits a joint action with the team rewards of the episodes it leads to"))
ALGORITHMS.register("at_grpo", AlgorithmEntry(
    _build_at_grpo, _one_call("at_grpo", "a multi-turn environment or a workflow of several calls"),
    credit="it scores a candidate with its role's own rewards + at_grpo.alpha x the team rewards"))
ALGORITHMS.register("m_grpo", AlgorithmEntry(
    _build_m_grpo, _m_grpo_refuse,
    credit="it credits the main agent with its rollout's team return and the sub-agent with m_grpo.sub_reward of it"))
register_choices("algorithm", lambda: sorted(ALGORITHMS))


@register_check
def _greedy_baseline_is_grpo(cfg: Config) -> None:
    if cfg.train.advantage == "max" and cfg.algorithm != "grpo":  # only GRPO runs the greedy baseline rollouts
        raise ConfigError(f"train.advantage: max (greedy baseline) is run by algorithm grpo, not {cfg.algorithm!r}; "
                          "choose one of ['group', 'mean', 'batch', 'none', 'rloo']")


@register_check
def _reward_is_applied(cfg: Config) -> None:
    """``workflow.reward`` means one thing: a registered reward(sample, outcome) of each sample. An algorithm that
    credits rewards its own way (``AlgorithmEntry.credit``) refuses any other than ``outcome`` rather than ignore it."""
    entry = ALGORITHMS.get(cfg.algorithm)
    if cfg.workflow.reward == "outcome" or entry is None or entry.credit is None:
        return
    raise ConfigError(
        f"workflow.reward: {cfg.workflow.reward!r} is not applied by algorithm {cfg.algorithm} ({entry.credit}): "
        "use workflow.reward=outcome and report that reward from the workflow (ctx.reward(value) or "
        "EpisodeOutcome(team_reward=...)), which every algorithm reads, or algorithm=grpo, which applies it"
    )


def workflow_name(cfg: Config, task: Any) -> str:
    """The workflow a config runs: ``workflow.name``, else the task's default (M-GRPO's single-agent baseline:
    ``research_single``)."""
    if cfg.workflow.name:
        return cfg.workflow.name
    if cfg.algorithm == "m_grpo" and cfg.section(MGRPOConfig).agents == "single":
        return "research_single"
    return default_workflow(task)


def refusal(cfg: Config, task: Any) -> str | None:
    """Why the configured algorithm cannot train the configured workflow on ``task`` (None: it can)."""
    name = workflow_name(cfg, task)
    spec = WORKFLOWS.get_entry(name, "workflow.name")
    check_task(name, spec, task)
    return ALGORITHMS.get_entry(cfg.algorithm, "algorithm").refuse(name, spec, cfg)


def make_algorithm(cfg: Config, task: Any) -> Algorithm:
    """The configured algorithm, its (algorithm, workflow) pair checked: called before any model loads."""
    entry = ALGORITHMS.get_entry(cfg.algorithm, "algorithm")
    reason = refusal(cfg, task)
    if reason:
        raise ConfigError(f"algorithm: {reason}")
    if not cfg.workflow.name:
        if cfg.workflow.options:
            raise ConfigError(f"workflow.options: no workflow.name is set; got {sorted(cfg.workflow.options)}")
        return entry.build(cfg, None, None)
    return entry.build(cfg, cfg.workflow.name, configured_workflow_options(cfg))


def configured_workflow_options(cfg: Config) -> Any:
    """What the configured ``workflow.name``'s ``run`` receives: its ``workflow.options`` validated against its own
    options dataclass, or None for a workflow that declares none."""
    w = cfg.workflow
    spec = WORKFLOWS.get_entry(w.name, "workflow.name")
    if spec.options is not None:  # the workflow's own options, validated like a task's
        return build_dataclass(spec.options, w.options, "workflow.options.")
    if w.options:
        raise ConfigError(
            f"workflow.options: workflow {w.name!r} declares no options of its own; got {sorted(w.options)}"
        )
    return None


__all__ = [
    "ALGORITHMS",
    "ATGRPO",
    "ATGRPOConfig",
    "MAGRPOConfig",
    "MGRPOConfig",
    "Algorithm",
    "AlgorithmEntry",
    "GRPO",
    "MAGRPO",
    "MGRPO",
    "WorkflowGRPO",
    "configured_workflow_options",
    "make_algorithm",
    "refusal",
    "workflow_name",
]
