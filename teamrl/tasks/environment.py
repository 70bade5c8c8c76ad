"""The Environment interface: a cloneable state machine that roles act on in turn (AT-GRPO).

Each turn, the roles act in ``roles`` order (or all on the same state when ``parallel``):
``observe(state, role)`` gives a role its local prompt; ``apply(state, role, text)`` returns a
NEW state and the role's local reward (it must never change the state it was given, so a
sampler can branch one state K ways); ``team_reward(state)`` scores the shared outcome;
``done(state)`` ends the episode (the trainer also stops at ``max_turns``).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from teamrl.tasks.task import Problem


class Environment(ABC):
    """A multi-role, multi-turn environment over cloneable states."""

    name: ClassVar[str]
    roles: ClassVar[tuple[str, ...]]
    parallel: ClassVar[bool] = False  # True: every role of a turn observes the same state
    max_reward: ClassVar[float] = 1.0  # the largest team_reward, for the normalised return
    max_turns: int = 4

    @abstractmethod
    def problems(self) -> list[Problem]:
        """The problems (seeded, reproducible)."""

    @abstractmethod
    def reset(self, problem: Problem) -> Any:
        """The initial state of ``problem``."""

    @abstractmethod
    def observe(self, state: Any, role: str) -> list[dict[str, str]]:
        """The chat messages ``role`` sees in ``state``."""

    @abstractmethod
    def apply(self, state: Any, role: str, text: str) -> tuple[Any, float]:
        """(new state, local reward of ``role``) after ``role`` says ``text``; ``state`` is left unchanged."""

    @abstractmethod
    def team_reward(self, state: Any) -> float:
        """The shared reward of ``state``."""

    @abstractmethod
    def done(self, state: Any) -> bool:
        """Whether the episode is over (solved, failed or out of moves)."""

    def clone(self, state: Any) -> Any:
        """An independent copy of ``state`` (override with something cheaper than deepcopy)."""
        return copy.deepcopy(state)

    def success(self, state: Any) -> bool:
        """Whether ``state`` counts as solved (evaluation success rate)."""
        return self.team_reward(state) >= 1.0
