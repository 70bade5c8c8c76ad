"""The Task interface: problems, the prompt a role sees, and the reward of an answer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence


@dataclass(frozen=True)
class Problem:
    """One problem: a stable id and the task's own fields."""

    id: str
    data: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


class Task(ABC):
    """A data set plus a verifier. Subclasses declare ``name``, ``roles`` and an ``Options`` dataclass."""

    name: ClassVar[str]
    roles: ClassVar[tuple[str, ...]] = ("agent",)

    @abstractmethod
    def problems(self) -> list[Problem]:
        """The training problems, in a fixed order (the trainer shuffles them by seed)."""

    @abstractmethod
    def prompt(self, problem: Problem) -> list[dict[str, str]]:
        """The chat messages the agent sees for ``problem``."""

    @abstractmethod
    def reward(self, problem: Problem, text: str) -> float:
        """The reward of answer ``text`` to ``problem``."""

    def rewards(self, problems: Sequence[Problem], texts: Sequence[str]) -> list[float]:
        """Rewards for many answers at once; override to vectorise."""
        return [self.reward(p, t) for p, t in zip(problems, texts)]
