"""What the tool/planner environments share (plan_path, sokoban, sudoku).

Each turn the ``tool`` writes Python code, run in the sandbox with the state given as
variables; its printed output is shown to the ``planner``, whose answer the environment
executes. :class:`ToolPlannerEnvironment` holds that turn logic, the warm-start
demonstrations and the format check; a concrete environment supplies the rendering, the tool's
check, the planner's move execution and a reference solution.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from teamrl.core.config import ConfigError
from teamrl.sandbox import ExecutionResult, SandboxLimits, run_program
from teamrl.tasks.code_data import extract_code, fenced_code
from teamrl.tasks.environment import Environment
from teamrl.tasks.task import Problem


Pos = tuple[int, int]

# --- shared by the tool/planner environments -------------------------------------------------

TOOL_SOLVED = 1.0
TOOL_RAN = 0.2
TOOL_FAILED = 0.0
TOOL_OUTPUT_CHARS = 600  # of the tool's stdout shown to the planner
MAX_MOVES = 200  # moves read from one answer; the rest is ignored (keeps a runaway answer cheap)

DIRS: dict[str, Pos] = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
_MOVE_WORDS = {"u": "U", "up": "U", "d": "D", "down": "D", "l": "L", "left": "L", "r": "R", "right": "R"}
_MOVES_LABEL = re.compile(r"(?i)\bmoves?\b[*_`\s]*[:=][*_`]*[ \t]*(.*)")
_TOKEN_STRIP = "[](){}'\"`.*_!?"


def _tokens_to_moves(line: str) -> str:
    """The leading run of move tokens in ``line``: ``U R R``, ``URR``, ``['U', 'R']``, ``up, right``."""
    moves: list[str] = []
    for tok in re.split(r"[\s,;]+", line):
        tok = tok.strip(_TOKEN_STRIP).lower()
        if not tok:
            continue
        if tok in _MOVE_WORDS:
            moves.append(_MOVE_WORDS[tok])
        elif set(tok) <= set("udlr"):
            moves.extend(tok.upper())
        else:
            break  # prose after the moves ("U R (reaches the goal)") ends the list
        if len(moves) >= MAX_MOVES:
            break
    return "".join(moves[:MAX_MOVES])


def parse_moves(text: str, *, label_required: bool = True) -> str | None:
    """The moves of an answer as a string over ``UDLR``, or None when there are none.

    Reads the last ``Moves: ...`` line (markdown emphasis and a list on the next line are
    accepted). Without such a line: None when ``label_required`` (the planner's format), else
    the last non-empty line (a program's printed output: ``U R R``, ``URR`` or ``['U', 'R']``,
    after any ``label:`` prefix). At most :data:`MAX_MOVES` moves are kept.
    """
    if not isinstance(text, str):
        raise ValueError(f"parse_moves: expected a str, got {type(text).__name__}")
    labels = list(_MOVES_LABEL.finditer(text))
    if labels:
        last = labels[-1]
        line = last.group(1)
        if not line.strip():  # "Moves:\nU R R"
            rest = [ln for ln in text[last.end():].splitlines() if ln.strip()]
            line = rest[0] if rest else ""
    elif label_required:
        return None
    else:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if not lines:
            return None
        line = lines[-1].rsplit(":", 1)[-1]
    moves = _tokens_to_moves(line)
    return moves or None


def truncate(text: str, limit: int = TOOL_OUTPUT_CHARS) -> str:
    """``text`` cut to about ``limit`` characters, keeping the start and (mostly) the end."""
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]}\n... [{len(text) - limit} characters cut] ...\n{text[-(limit - head):]}"


def show_moves(moves: str, limit: int = 40) -> str:
    """``moves`` spaced out for a summary line, cut after ``limit`` moves."""
    shown = " ".join(moves[:limit])
    return shown + (f" ... ({len(moves)} moves)" if len(moves) > limit else "")


def describe_result(result: ExecutionResult) -> str:
    """What the planner is shown of a run: its stdout (truncated), or the failure."""
    out = result.stdout.strip()
    if result.status == "ok":
        return truncate(out) if out else "(the program printed nothing)"
    msg = f"The program failed ({result.status}): {result.first_failure or 'no details'}"
    if out:
        msg += f"\nIt printed before failing:\n{out}"
    return truncate(msg)


@dataclass(frozen=True, kw_only=True)
class TurnState:
    """What every tool/planner state holds: the turn (a turn ends when the planner acts), the
    tool's output of the current turn as the planner will see it, and one line per past turn
    saying what the planner did and what came of it. Subclasses are frozen too: every field is
    immutable, so a clone is a shallow copy."""

    turn: int = 0
    tool_output: str = ""
    history: tuple[str, ...] = ()


_ROLE_INTRO = {
    "tool": ("You are the tool agent of a two-agent team. You write a Python program; it runs, and what it prints is "
             "shown to the planner agent, who then decides the moves that are executed."),
    "planner": ("You are the planner agent of a two-agent team. The tool agent wrote a program whose output is shown "
                "below (it may be wrong); you decide the moves, and they are executed."),
    "solo": "You solve the task alone: you decide the moves, and they are executed.",
}


class ToolPlannerEnvironment(Environment):
    """Two roles per turn, ``tool`` then ``planner``, over frozen :class:`TurnState` states.

    Subclasses supply the task text (:meth:`rules`, :meth:`render`, :meth:`tool_ask`,
    :meth:`planner_ask`), the tool program's prelude (:meth:`tool_setup`), the tool's reward
    for a program's output (:meth:`score_tool_output`), the planner's action (:meth:`act`),
    :meth:`finished`, and for the warm start a short program that solves a state
    (:attr:`reference_program`) with what it prints and the planner's answer (:meth:`reference`).
    The tool's program runs only in the sandbox.
    """

    roles: ClassVar[tuple[str, ...]] = ("tool", "planner")
    parallel: ClassVar[bool] = False
    reference_program: ClassVar[str]  # the tool's demonstration, run after tool_setup(state)

    def __init__(self, max_turns: int, wall_seconds: float) -> None:
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ConfigError(f"task.max_turns={max_turns!r}: must be an int >= 1")
        self.max_turns = max_turns
        self.limits = SandboxLimits(wall_seconds=float(wall_seconds), cpu_seconds=float(wall_seconds))

    # -- subclass hooks ---------------------------------------------------------------------

    @abstractmethod
    def rules(self) -> str:
        """The task's rules and legend (the same for both roles)."""

    @abstractmethod
    def render(self, state: Any) -> str:
        """A compact text picture of ``state``."""

    @abstractmethod
    def tool_ask(self) -> str:
        """What the tool should write: the variables its program starts with and what to print."""

    def planner_ask(self) -> str:
        """The planner's answer format (a move line, read by :func:`parse_moves`, unless overridden)."""
        return "End your answer with one line of moves, like `Moves: U R R D`."

    @abstractmethod
    def tool_setup(self, state: Any) -> str:
        """Python source run before the tool's program, defining the state as variables."""

    @abstractmethod
    def score_tool_output(self, state: Any, stdout: str) -> float:
        """The tool's reward for a program that ran cleanly and printed ``stdout`` (non-empty)."""

    @abstractmethod
    def act(self, state: Any, text: str) -> tuple[Any, float, str]:
        """(new state, planner reward, one-line summary) for the planner's answer ``text``; the
        base class then advances the turn, clears the tool output and records the summary."""

    def planner_well_formed(self, state: Any, text: str) -> bool:
        """Whether ``text`` is in the planner's answer format, good moves or not (a ``Moves:``
        line read by :func:`parse_moves`; an environment whose :meth:`planner_ask` asks for
        another format overrides this)."""
        return parse_moves(text) is not None

    @abstractmethod
    def finished(self, state: Any) -> bool:
        """Solved or lost before the turns ran out."""

    @abstractmethod
    def reference(self, state: Any) -> tuple[str, str] | None:
        """(what :attr:`reference_program` prints for ``state``, a planner answer that solves
        ``state``), or None when no solution is known."""

    # -- Environment ------------------------------------------------------------------------

    def _check_role(self, role: str) -> None:
        if role not in self.roles:
            raise ValueError(f"role {role!r}: {self.name} has roles {list(self.roles)}")

    def observe(self, state: Any, role: str) -> list[dict[str, str]]:
        self._check_role(role)
        solo = "tool" not in self.roles  # the planner alone: no team, no tool output
        parts = [
            _ROLE_INTRO["solo" if solo else role],
            self.rules(),
            f"Turn {min(state.turn + 1, self.max_turns)} of {self.max_turns}.",
            self.render(state),
        ]
        if state.history:
            parts.append(f"Last turn: {state.history[-1]}")
        if role == "tool":
            parts.append(self.tool_ask())
        else:
            if not solo:
                parts.append("Output of the tool agent's program this turn:\n"
                             + (state.tool_output or "(no program output this turn)"))
            parts.append(self.planner_ask())
        return [{"role": "user", "content": "\n\n".join(parts)}]

    def apply(self, state: Any, role: str, text: str) -> tuple[Any, float]:
        """(new state, local reward). On a finished state this is a no-op with reward 0.

        The tool's answer changes only ``tool_output``; the planner's answer is executed and
        ends the turn. ``state`` itself is never changed (states are frozen).
        """
        self._check_role(role)
        if not isinstance(text, str):
            raise ValueError(f"{self.name}.apply: text must be a str, got {type(text).__name__}")
        if self.done(state):
            return self.clone(state), 0.0
        if role == "tool":
            output, reward = self.run_tool(state, text)
            return replace(state, tool_output=output), reward
        new, reward, summary = self.act(state, text)
        return replace(new, turn=state.turn + 1, tool_output="", history=state.history + (summary,)), float(reward)

    def run_tool(self, state: Any, text: str) -> tuple[str, float]:
        """(what the planner will see, tool reward) for the tool's answer ``text``: its code runs
        in the sandbox after :meth:`tool_setup`; never raises because of what the code does."""
        code = extract_code(text)
        if not code:
            return "(the tool agent wrote no program)", TOOL_FAILED
        result = run_program(code, limits=self.limits, setup=self.tool_setup(state))
        shown = describe_result(result)
        out = result.stdout.strip()
        if result.status != "ok" or not out:
            return shown, TOOL_FAILED
        return shown, float(self.score_tool_output(state, out))

    def done(self, state: Any) -> bool:
        return state.turn >= self.max_turns or self.finished(state)

    def valid(self, problem: Problem, text: str) -> bool:
        """Format validity (``teamrl eval``): ``text`` is a planner answer in the format
        :meth:`act` reads (good moves or not) or, when ``tool`` is a role, a program in a fenced
        block (:meth:`run_tool` also runs unfenced text; that is leniency, not the format)."""
        if "tool" in self.roles and fenced_code(text):
            return True
        return self.planner_well_formed(self.reset(problem), text)

    def demonstrations(self, problem: Problem) -> list[tuple[str, list[dict[str, str]], str]]:
        """Warm start (``teamrl sft``): the first turn solved, with the environment's own prompts.
        When ``tool`` is a role it writes :attr:`reference_program` and the planner is shown what
        that prints; the planner answers with :meth:`reference`'s solution. Empty for a problem
        without a known solution."""
        state = self.reset(problem)
        ref = self.reference(state)
        if ref is None:
            return []
        printed, answer = ref
        out = []
        if "tool" in self.roles:
            out.append(("tool", self.observe(state, "tool"), f"```python\n{self.reference_program}```"))
            state = replace(state, tool_output=truncate(printed))  # as run_tool shows a clean run
        out.append(("planner", self.observe(state, "planner"), answer))
        return out

    def clone(self, state: Any) -> Any:
        # Every field is immutable, so a shallow copy is fully independent.
        return replace(state)


