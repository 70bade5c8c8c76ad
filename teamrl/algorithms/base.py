"""The Algorithm protocol: what the trainer may ask of any algorithm (no ``hasattr`` probes)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, ClassVar, Hashable, Protocol, Sequence

from teamrl.algorithms.episodes import ContextFactory
from teamrl.core.config import ConfigError
from teamrl.core.sample import Sample
from teamrl.tasks.task import Problem
from teamrl.workflows.episode import EpisodeResult


@dataclass
class FinishedEpisode:
    """An episode of the last rollout that ran to its end: which one (``where``: e.g. MAGRPO's ``path``
    of joint actions) and its result. The trainer logs the workflow's statistics over them."""

    problem_id: Hashable
    episode: int
    result: EpisodeResult
    where: dict[str, Any] = field(default_factory=dict)


def warn_once(owner: Any, key: str, message: str) -> None:
    """Print ``warning: <message>`` (one line, on stderr, between progress bars) the first time ``owner`` warns
    about ``key``: an algorithm's warnings come once per run (the trainer builds one algorithm per run)."""
    warned: set[str] = owner.__dict__.setdefault("_warned", set())
    if key in warned:
        return
    warned.add(key)
    from tqdm import tqdm

    tqdm.write(f"warning: {message}", file=sys.stderr)


class Algorithm(Protocol):
    """A sampler over the episode protocol + a group key + a reward assignment.

    Subclass it to inherit the defaults: no metrics, no state to checkpoint, the task's roles, no
    evaluation during training (``can_evaluate`` False), no finished episodes reported.
    """

    name: ClassVar[str]
    can_evaluate: ClassVar[bool] = False
    # the episodes of the last rollout that ran to their end (GRPO: every episode but the greedy baselines;
    # MAGRPO: every leaf of the tree; AT-GRPO: the chosen episode, or each trajectory; M-GRPO: every rollout)
    finished: Sequence[FinishedEpisode] = ()

    def rollout(self, problems: Sequence[Problem], task: Any, make_ctx: ContextFactory,
                run: Callable[[list[Awaitable]], list]) -> list[Sample]:
        """Every sample of one step's episodes, with reward and group set."""
        ...

    @staticmethod
    def group_key(sample: Sample) -> Hashable:
        """The comparison group of a sample."""
        ...

    @property
    def roles(self) -> tuple[str, ...] | None:
        """The role types that act (None: the task's)."""
        return None

    def metrics(self, samples: Sequence[Sample]) -> dict[str, float]:
        """The algorithm's own statistics of the last rollout."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold for a resumed run to draw the same random choices."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (on resume)."""
        return None

    def evaluate(self, problems: Sequence[Problem], task: Any, make_ctx: ContextFactory,
                 run: Callable[[list[Awaitable]], list]) -> dict[str, float]:
        """Greedy accuracy and diagnostics on held-out problems (only where ``can_evaluate``)."""
        raise ConfigError(f"algorithm {self.name!r}: evaluation during training needs algorithm grpo on a workflow "
                          "that returns EpisodeOutcome (a study workflow on math.solve or code.solve)")
