"""``code``: the coder + tester team of ``code.coder_tester`` as a multi-turn environment (AT-GRPO).

Two roles act each turn, in this order:

- ``coder`` writes the function. It sees the problem and, from turn 2 on, the tester's last
  asserts and what running them on its current code gave (the first failure);
- ``tester`` writes ``assert`` statements. It sees the problem and the coder's current code.

After the tester acts, its asserts run (in the sandbox) on the coder's code, and the turn
ends. The episode ends when the code passes every hidden test, or after ``max_turns`` turns.

Rewards are those of :class:`~teamrl.tasks.code_tester.CoderTester` (its ``_scores``; nothing
is re-implemented here):

- coder (local): the fraction of the problem's hidden tests its code passes;
- tester (local): the mean of validity (share of its asserts the reference solution passes)
  and discrimination (share a known-wrong program fails), scored against the coder's current
  code as the joint action;
- team: the hidden-test pass fraction of the current code (0 before the coder has written
  any); ``success``: it passes them all.

Every program (the coder's, the reference and the known-wrong one under the tester's
asserts) runs only in the sandbox.

The problems are those of ``code.coder_tester``, held-out split included (``split``,
``test_size``, ``num_problems``: see :mod:`teamrl.tasks.code_team`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from teamrl.core.config import ConfigError, option
from teamrl.tasks.code_data import CodeProblem, extract_code
from teamrl.tasks.code_tester import CoderTester, CoderTesterOptions, assertions
from teamrl.tasks.environment import Environment
from teamrl.tasks.task import Problem
from teamrl.tasks.tool_planner import truncate

FEEDBACK_CHARS = 600  # of the first failure shown to the coder


@dataclass
class CodeEnvOptions(CoderTesterOptions):
    """The coder + tester task's options (the held-out split included), plus the turn limit."""

    name: str = "code"
    max_turns: int = option(2, ge=1, doc="turns (coder then tester) per episode")


@dataclass(frozen=True)
class CodeState:
    """One episode: the problem, the coder's current code and its hidden-test pass fraction,
    the tester's last asserts (source) and what running them on the code gave. Frozen, and
    every field is immutable (the problem is shared, read-only), so a clone is a shallow copy."""

    problem: Problem
    turn: int = 0
    code: str = ""
    passed: float = 0.0  # hidden-test pass fraction of ``code``
    coded: bool = False  # the coder has answered at least once
    tests: str = ""  # the tester's last asserts, as it wrote them (setup + asserts)
    test_report: str = ""  # the result of running them on the code, as the coder sees it


_INTRO = {
    "coder": "You are the coder of a two-agent team: you write the function, a tester writes asserts for it, and "
             "hidden tests decide the score.",
    "tester": "You are the tester of a two-agent team: the coder writes the function, you write `assert` statements "
              "that a correct solution passes and a wrong one fails.",
}


class CodeEnv(Environment):
    """Coder + tester over turns; rewards from :class:`CoderTester` (see the module docstring)."""

    name: ClassVar[str] = "code"
    roles: ClassVar[tuple[str, ...]] = ("coder", "tester")
    parallel: ClassVar[bool] = False
    max_reward: ClassVar[float] = 1.0
    Options = CodeEnvOptions

    def __init__(self, opts: CodeEnvOptions | None = None) -> None:
        self.opts = opts or CodeEnvOptions()
        if isinstance(self.opts.max_turns, bool) or not isinstance(self.opts.max_turns, int) or self.opts.max_turns < 1:
            raise ConfigError(f"task.max_turns={self.opts.max_turns!r}: must be an int >= 1")
        self.max_turns = self.opts.max_turns
        self.scorer = CoderTester(CoderTesterOptions(name=self.opts.name, source=self.opts.source, path=self.opts.path,
                                                     num_problems=self.opts.num_problems, split=self.opts.split,
                                                     test_size=self.opts.test_size,
                                                     wall_seconds=self.opts.wall_seconds, workers=self.opts.workers))

    def problems(self) -> list[Problem]:
        return self.scorer.problems()

    def reset(self, problem: Problem) -> CodeState:
        return CodeState(problem=problem)

    def close(self) -> None:
        """Stop the sandbox pool (if it was started)."""
        if self.scorer._pool is not None:
            self.scorer.pool.close()

    def _check_role(self, role: str) -> None:
        if role not in self.roles:
            raise ValueError(f"role {role!r}: {self.name} has roles {list(self.roles)}")

    def observe(self, state: CodeState, role: str) -> list[dict[str, str]]:
        self._check_role(role)
        c: CodeProblem = state.problem.data["code"]
        parts = [
            _INTRO[role],
            f"Problem:\n{c.prompt}",
            f"Turn {min(state.turn + 1, self.max_turns)} of {self.max_turns}.",
        ]
        if role == "coder":
            if state.coded:
                parts.append(f"Your current code:\n```python\n{state.code}\n```")
            if state.tests:
                parts.append(f"The tester's last asserts:\n```python\n{state.tests}\n```\n"
                             f"Run on your current code: {state.test_report}")
            parts.append(self.scorer.request(c, "coder"))
        else:
            shown = state.code if state.code else "(no code yet)"
            parts.append(f"The coder's current code:\n```python\n{shown}\n```")
            parts.append(self.scorer.request(c, "tester"))
        return [{"role": "user", "content": "\n\n".join(parts)}]

    def apply(self, state: CodeState, role: str, text: str) -> tuple[CodeState, float]:
        """(new state, local reward); a no-op with reward 0 once the episode is over. The
        tester's answer ends the turn. ``state`` is frozen and never changed."""
        self._check_role(role)
        if not isinstance(text, str):
            raise ValueError(f"code.apply: text must be a str, got {type(text).__name__}")
        if self.done(state):
            return self.clone(state), 0.0
        if role == "coder":
            s = self.scorer._scores(state.problem, [{"coder": text, "tester": ""}])[0]
            return replace(state, code=extract_code(text), passed=float(s["coder"]), coded=True), float(s["coder"])
        s = self.scorer._scores(state.problem, [{"coder": state.code, "tester": text}])[0]
        setup, asserts = assertions(text)
        tests = "\n".join(([setup] if setup else []) + asserts)
        return replace(state, turn=state.turn + 1, tests=tests, test_report=self._report(state.code, setup, asserts)), \
            float(s["tester"])

    def _report(self, code: str, setup: str, asserts: list[str]) -> str:
        """What running the tester's asserts on ``code`` gave, for the coder (sandboxed)."""
        if not asserts:
            return "the tester wrote no top-level `assert` statements."
        if not code:
            return "there was no code to run them on."
        r = self.scorer.pool.submit(code, asserts, setup=setup).result()
        said = f"{r.tests_passed} of {len(asserts)} passed"
        if r.status != "ok":
            said += f" ({r.status}); first failure: {r.first_failure or 'no details'}"
        return truncate(said, FEEDBACK_CHARS)

    def team_reward(self, state: CodeState) -> float:
        return state.passed

    def done(self, state: CodeState) -> bool:
        return state.passed >= 1.0 or state.turn >= self.max_turns

    def clone(self, state: CodeState) -> CodeState:
        return replace(state)
