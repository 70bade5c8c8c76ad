"""The Task interface: problems, the prompt a role sees, and the reward of an answer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Mapping, Sequence

from teamrl.core.config import ConfigError, InputError


@dataclass(frozen=True)
class Problem:
    """One problem: a stable id and the task's own fields."""

    id: str
    data: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


SPLITS = ("train", "test")


def split_problems(problems: list[Problem], split: str, test_size: int, what: str) -> list[Problem]:
    """The train part (all but the last ``test_size``) or the test part (the last ``test_size``) of
    ``problems``; ``what`` names them in the error of a ``test_size`` that leaves no training problem."""
    if split not in SPLITS:
        raise ConfigError(f"task.split={split!r}: choose one of {list(SPLITS)}")
    if not 0 <= test_size < len(problems):
        raise ConfigError(f"task.test_size={test_size}: must be >= 0 and below the {len(problems)} problems of {what}")
    if split == "test":
        return problems[len(problems) - test_size:] if test_size else []
    return problems[:len(problems) - test_size]


def checked_reward(task_name: str, call: str, value: Any) -> float:
    """``value``, one reward a task's ``call`` returned, as a float; anything but a number (None, a
    string, a list) is an :class:`InputError` naming the task, the call and the value (``float``
    would turn the string "0.5" into 0.5 silently, and fail on None deep inside the trainer)."""
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        raise InputError(
            f"task {task_name!r}: {call} returned {value!r} ({type(value).__name__}); expected a number (int or float)"
        )
    try:
        return float(value)
    except (TypeError, ValueError) as e:  # e.g. a tensor of several values
        raise InputError(
            f"task {task_name!r}: {call} returned {value!r}; expected a number (int or float): {e}"
        ) from None


def checked_rewards(task_name: str, call: str, values: Any, expected: int, per: str = "answer") -> list[float]:
    """``values``, the rewards a task's ``call`` returned for ``expected`` items (``per`` names one), as
    floats; a count other than ``expected`` or a value that is not a number is an :class:`InputError`
    naming the task."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise InputError(
            f"task {task_name!r}: {call} returned {values!r}; expected a list of {expected} numbers, one per {per}"
        )
    if len(values) != expected:
        raise InputError(f"task {task_name!r}: {call} returned {len(values)} values for {expected} {per}s; "
                         f"expected {expected}, one per {per}, in order")
    return [checked_reward(task_name, f"{call}[{i}]", v) for i, v in enumerate(values)]


def reply_valid(task: Any, problem: Problem, text: str, role: str | None = None,
                formats: Mapping[str, Callable[[str], bool] | None] | None = None) -> bool | None:
    """Whether ``text`` is a reply in the format its role must give; None when that is unknown.

    ``formats`` (a workflow's :attr:`~teamrl.workflows.Workflow.formats`) names the roles that do not
    give the task's answer: role (or role type: ``worker0`` -> ``worker``) -> its own check of a reply,
    or None for a free-text role (not judged: None). Every other role gives the task's answer and is
    judged by the task's optional hook ``valid(problem, text) -> bool`` (an answer it can read, an
    action it can parse); None when the task has no such hook. Anything but a bool or None from the
    task's hook is an :class:`InputError`."""
    if role is not None and formats:
        from teamrl.policies.router import role_type  # imported here: teamrl.policies imports the tasks

        kind = role if role in formats else role_type(role)
        if kind in formats:
            check = formats[kind]
            return None if check is None else bool(check(text))
    hook = getattr(task, "valid", None)
    if hook is None:
        return None
    value = hook(problem, text)
    if value is not None and not isinstance(value, bool):
        raise InputError(
            f"task {task.name!r}: valid(problem {problem.id!r}) returned {value!r}; expected True, False or None"
        )
    return value


def batch_instances(problems: Sequence[Problem]) -> list[Problem]:
    """The problems of one batch, each with an id no other instance has: a problem drawn again
    gets ``<id>#2``, ``<id>#3``, ... (same data). Algorithms key groups and outcomes by the
    samples' problem id, so two copies of a problem in one batch never share a group."""
    taken = {p.id for p in problems}
    seen: dict[str, int] = {}
    out = []
    for p in problems:
        if p.id not in seen:
            seen[p.id] = 2  # the number of its next copy
            out.append(p)
            continue
        n = seen[p.id]
        while f"{p.id}#{n}" in taken:
            n += 1
        seen[p.id] = n + 1
        taken.add(f"{p.id}#{n}")
        out.append(replace(p, id=f"{p.id}#{n}"))
    return out


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


class TeamTask(ABC):
    """A task solved by a team of ``roles`` acting in parallel (MAGRPO), scored jointly.

    Subclasses declare ``name``, ``roles``, ``max_reward`` (for the normalised return
    ``reward / max_reward``) and an ``Options`` dataclass. Multi-turn: after each turn the
    trainer calls :meth:`feedback` and passes the history of joint outputs to :meth:`prompt`.
    """

    name: ClassVar[str]
    roles: ClassVar[tuple[str, ...]]
    max_reward: ClassVar[float] = 1.0

    @abstractmethod
    def problems(self) -> list[Problem]:
        """The problems, in a fixed order."""

    @abstractmethod
    def prompt(self, problem: Problem, role: str, turn: int = 0, history: Sequence[dict[str, str]] = (),
               feedback: str = "") -> list[dict[str, str]]:
        """The local prompt of ``role`` at ``turn``; ``history`` holds the earlier joint outputs."""

    @abstractmethod
    def reward(self, problem: Problem, outputs: dict[str, str]) -> float:
        """The shared reward of one joint action (role -> text), in [0, max_reward]."""

    def rewards(self, problem: Problem, joint: Sequence[dict[str, str]]) -> list[float]:
        """Rewards of many joint actions of one problem; override to vectorise."""
        return [self.reward(problem, o) for o in joint]

    def role_rewards(self, problem: Problem, outputs: dict[str, str]) -> dict[str, float]:
        """Each role's own (local) reward for a joint action; algorithms that mix local and team
        rewards (AT-GRPO: local + alpha * team) use it. Default: no local rewards (all 0)."""
        return {r: 0.0 for r in self.roles}

    def feedback(self, problem: Problem, outputs: dict[str, str], reward: float) -> str:
        """What the agents are told about their joint output before the next turn."""
        return f"Your joint answer scored {reward / self.max_reward:.2f} of 1. Improve it."

    def single_prompt(self, problem: Problem) -> list[dict[str, str]]:
        """Baseline ``single``: one agent writes every role's part in one answer."""
        raise NotImplementedError(f"task {self.name} has no single-agent baseline prompt")

    def split_single(self, text: str) -> dict[str, str]:
        """Split a ``single`` baseline answer into the role outputs the reward expects."""
        raise NotImplementedError(f"task {self.name} has no single-agent baseline split")
