"""Algorithms: each is a sampler + a group key + a reward assignment. ``make_algorithm`` picks one."""

from __future__ import annotations

from teamrl.algorithms.at_grpo import ATGRPO, ATGRPOSettings
from teamrl.algorithms.grpo import GRPO
from teamrl.algorithms.m_grpo import MGRPO, MGRPOSettings
from teamrl.algorithms.magrpo import MAGRPO, MAGRPOSettings
from teamrl.algorithms.grpo import WorkflowGRPO
from teamrl.core.config import Config, ConfigError, build_dataclass
from teamrl.workflows import WORKFLOWS, WorkflowSettings
from teamrl.tasks.environment import Environment
from teamrl.tasks.solve import SolveTask
from teamrl.tasks.research import ResearchEnv
from teamrl.tasks.task import Task, TeamTask

ALGORITHMS = ("grpo", "magrpo", "at_grpo", "m_grpo")


def make_algorithm(cfg: Config, task: Task | TeamTask | Environment | ResearchEnv) -> GRPO | MAGRPO | ATGRPO | MGRPO | WorkflowGRPO:
    """The configured algorithm, checked against the kind of task it needs."""
    if (cfg.algorithm == "m_grpo") != isinstance(task, ResearchEnv):
        raise ConfigError(f"algorithm: m_grpo runs on the research environment (task.name=research); got algorithm "
                          f"{cfg.algorithm!r} with task {task.name!r}")
    if cfg.algorithm == "m_grpo":
        m = cfg.m_grpo
        return MGRPO(MGRPOSettings(k=cfg.rollout.group_size, d_max=m.d_max, sub_agent=m.sub_agent, agents=m.agents,
                                   sub_reward=m.sub_reward, seed=cfg.seed))
    if cfg.workflow.name:
        spec = WORKFLOWS.get_entry(cfg.workflow.name, "workflow.name")  # validated here: core names no workflow
        if not isinstance(task, SolveTask):
            raise ConfigError(f"workflow.name: {cfg.workflow.name!r} runs on a task with one verifiable answer "
                              f"(math.solve, code.solve); {task.name!r} is not one")
        w = cfg.workflow
        if spec.options is not None:  # the workflow's own options, validated like a task's
            settings = build_dataclass(spec.options, w.options, "workflow.options.")
        elif w.options:
            raise ConfigError(f"workflow.options: workflow {w.name!r} declares no options of its own; got {sorted(w.options)} "
                              "(its settings are workflow.max_iterations, num_generators, max_subtasks)")
        else:
            settings = WorkflowSettings(max_iterations=w.max_iterations, num_generators=w.num_generators,
                                        max_subtasks=w.max_subtasks)
        return GRPO(cfg.rollout.group_size, greedy_baseline=cfg.train.advantage == "max", workflow=w.name, settings=settings,
                    reward=w.reward)
    if cfg.algorithm == "grpo":
        return GRPO(cfg.rollout.group_size, greedy_baseline=cfg.train.advantage == "max")
    if cfg.algorithm == "magrpo":
        if not isinstance(task, TeamTask):
            raise ConfigError(f"algorithm: magrpo needs a team task (roles acting together); {task.name!r} is not one (see teamrl.tasks.TASKS)")
        m = cfg.magrpo
        return MAGRPO(MAGRPOSettings(group_size=cfg.rollout.group_size, joint_mode=m.joint_mode, num_turns=m.num_turns,
                                     gamma=m.gamma, termination_threshold=m.termination_threshold))
    if cfg.algorithm == "at_grpo":
        if not isinstance(task, Environment):
            raise ConfigError(f"algorithm: at_grpo needs a multi-turn environment (plan_path, sokoban, sudoku, ...); {task.name!r} is not one")
        a = cfg.at_grpo
        return ATGRPO(ATGRPOSettings(k=cfg.rollout.group_size, alpha=a.alpha, select=a.select, grouping=a.grouping,
                                     max_turns=a.max_turns or None, seed=cfg.seed))
    raise ConfigError(f"algorithm: {cfg.algorithm!r} is not known; choose one of {list(ALGORITHMS)}")


__all__ = ["ALGORITHMS", "ATGRPO", "ATGRPOSettings", "GRPO", "MAGRPO", "MAGRPOSettings", "MGRPO", "MGRPOSettings",
           "WorkflowGRPO", "make_algorithm"]
