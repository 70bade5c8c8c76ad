"""Algorithms: each is a sampler + a group key + a reward assignment. ``make_algorithm`` picks one."""

from __future__ import annotations

from teamrl.algorithms.grpo import GRPO
from teamrl.algorithms.magrpo import MAGRPO, MAGRPOSettings
from teamrl.core.config import Config, ConfigError
from teamrl.tasks.task import Task, TeamTask

ALGORITHMS = ("grpo", "magrpo")


def make_algorithm(cfg: Config, task: Task | TeamTask) -> GRPO | MAGRPO:
    """The configured algorithm, checked against the kind of task it needs."""
    if cfg.algorithm == "grpo":
        if not isinstance(task, Task):
            raise ConfigError(f"algorithm: grpo trains one agent but task {task.name!r} has roles {list(task.roles)}; use algorithm=magrpo")
        return GRPO(cfg.rollout.group_size, greedy_baseline=cfg.train.advantage == "max")
    if cfg.algorithm == "magrpo":
        if not isinstance(task, TeamTask):
            raise ConfigError(f"algorithm: magrpo needs a team task (roles acting together); {task.name!r} is single-agent; use algorithm=grpo")
        m = cfg.magrpo
        return MAGRPO(MAGRPOSettings(group_size=cfg.rollout.group_size, joint_mode=m.joint_mode, num_turns=m.num_turns,
                                     gamma=m.gamma, termination_threshold=m.termination_threshold))
    raise ConfigError(f"algorithm: {cfg.algorithm!r} is not known; choose one of {list(ALGORITHMS)}")


__all__ = ["ALGORITHMS", "GRPO", "MAGRPO", "MAGRPOSettings", "make_algorithm"]
