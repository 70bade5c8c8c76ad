"""``sudoku``: fill a 4x4 or 9x9 Sudoku (AT-GRPO).

Same two roles as ``plan_path``, in this order each turn: ``tool`` writes a Python program
(run in the sandbox after a prelude defining ``grid`` (list of rows of int, 0 = empty), ``n``
and ``box``) whose printed output the planner sees, typically a solver's answer; ``planner``
answers with cell fills, one per line, ``r1c2=3`` (row and column from 1 at the top left), or
with the whole grid as ``n`` lines of ``n`` digits (``.`` or ``0`` for empty), which it may
copy from the tool.

Puzzles: a full grid by seeded randomised backtracking, then cells emptied in random order
until ``empty_fraction`` of them are empty. With ``unique: true`` (default) an emptying is kept
only if the puzzle still has exactly one solution (a solution count capped at 2), so a puzzle
may end with fewer holes than asked; with ``unique: false`` every emptying is kept (still
solvable: the generating grid solves it) and cells are scored against that grid.

Fills are executed in order. A fill is rejected (and penalised) when the cell or value is out
of range, when it would change a given, or when the value already stands in the cell's row,
column or box; so the grid never holds a conflict, and a full grid is a solution. Writing a
given's own value, or a cell's current value, is ignored. The planner may overwrite its own
earlier fills.

Rewards (documented constants below; ``holes`` = the puzzle's empty cells):

planner, per answer
    progress      change in (correct - wrong) / holes over the holes, where wrong means filled
                  with a value other than the solution's (so all holes right adds ``CORRECT_CELLS``
                  = 1.0 in total, and a guess that is wrong costs as much as a right one earns)
    ``CONFLICT``        -0.2 per fill rejected for a row/column/box conflict
    ``GIVEN_OVERWRITE`` -0.2 per fill that tries to change a given
    ``INVALID_FILL``    -0.2 per fill with a row, column or value outside 1..n
    ``FORMAT_PENALTY``  -0.1 no fill could be read from the answer
    ``SOLVED``          +1.0 when the grid becomes full
tool
    ``TOOL_SOLVED`` 1.0 the program ran and printed fills (or a grid) that solve the puzzle from
    the current state under the rules above; ``TOOL_RAN`` 0.2 it printed something else;
    ``TOOL_FAILED`` 0.0 error, timeout, no program, or nothing printed
team
    1.0 when solved, else the fraction of holes filled with the solution's value.

Warm start (``teamrl sft``): the tool writes :data:`SOLVER_PROGRAM` (backtracking; prints one
``rRcC=V`` line per empty cell) and the planner answers with the puzzle's solution in the same
lines. With ``unique: false`` the program may print another solution than the one shown to the
planner; both solve the puzzle.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace
from math import isqrt
from typing import ClassVar

from teamrl.core.config import ConfigError, option
from teamrl.tasks.tool_planner import TOOL_RAN, TOOL_SOLVED, ToolPlannerEnvironment, TurnState
from teamrl.tasks.task import Problem

CORRECT_CELLS = 1.0
CONFLICT = -0.2
GIVEN_OVERWRITE = -0.2
INVALID_FILL = -0.2
FORMAT_PENALTY = -0.1
SOLVED = 1.0
MAX_FILLS = 200  # fills read from one answer

@dataclass
class SudokuOptions:
    name: str = "sudoku"
    size: int = option(4, choices=(4, 9), doc="grid side: 4 (2x2 boxes) or 9 (3x3 boxes)")
    num_problems: int = option(64, ge=1, doc="how many puzzles to generate")
    empty_fraction: float = option(0.5, gt=0, le=0.8, doc="share of cells to empty (fewer when uniqueness stops it)")
    unique: bool = option(True, doc="keep only emptyings that leave exactly one solution")
    max_turns: int = option(3, ge=1, doc="turns (tool then planner) per episode")
    seed: int = option(0, doc="seed of the puzzle generator")
    wall_seconds: float = option(3.0, gt=0, doc="sandbox wall-clock (and CPU) limit per tool program")


def _unit_of(i: int, n: int, b: int) -> tuple[int, int, int]:
    r, c = divmod(i, n)
    return r, c, (r // b) * b + c // b


def count_solutions(
    cells: list[int], n: int, limit: int = 2, rng: random.Random | None = None
) -> tuple[int, list[int] | None]:
    """(number of solutions up to ``limit``, the first one found) of a grid of ints (0 = empty),
    by backtracking on the most constrained cell; ``rng`` shuffles the values tried."""
    b = isqrt(n)
    full = (1 << (n + 1)) - 2
    rows, cols, boxes = [0] * n, [0] * n, [0] * n
    grid = list(cells)
    empties = []
    for i, v in enumerate(grid):
        if v:
            r, c, k = _unit_of(i, n, b)
            bit = 1 << v
            if (rows[r] | cols[c] | boxes[k]) & bit:
                return 0, None  # the givens already conflict
            rows[r] |= bit
            cols[c] |= bit
            boxes[k] |= bit
        else:
            empties.append(i)
    units = {i: _unit_of(i, n, b) for i in empties}
    found: list[list[int]] = []
    count = 0

    def search() -> bool:
        nonlocal count
        best, best_mask, best_n = -1, 0, n + 1
        for i in empties:
            if grid[i]:
                continue
            r, c, k = units[i]
            mask = full & ~(rows[r] | cols[c] | boxes[k])
            m = mask.bit_count()
            if m < best_n:
                best, best_mask, best_n = i, mask, m
                if m <= 1:
                    break
        if best < 0:
            count += 1
            if not found:
                found.append(list(grid))
            return count >= limit
        if best_n == 0:
            return False
        values = [v for v in range(1, n + 1) if best_mask >> v & 1]
        if rng is not None:
            rng.shuffle(values)
        r, c, k = units[best]
        for v in values:
            bit = 1 << v
            grid[best] = v
            rows[r] |= bit
            cols[c] |= bit
            boxes[k] |= bit
            stop = search()
            grid[best] = 0
            rows[r] &= ~bit
            cols[c] &= ~bit
            boxes[k] &= ~bit
            if stop:
                return True
        return False

    search()
    return count, (found[0] if found else None)


def generate_puzzle(rng: random.Random, n: int, empty_fraction: float, unique: bool = True) -> tuple[str, str]:
    """(puzzle, solution) as strings of ``n * n`` characters, ``.`` for an empty cell."""
    _, solution = count_solutions([0] * (n * n), n, limit=1, rng=rng)
    assert solution is not None  # an empty grid always has a solution
    puzzle = list(solution)
    order = list(range(n * n))
    rng.shuffle(order)
    target, holes = round(empty_fraction * n * n), 0
    for i in order:
        if holes >= target:
            break
        v, puzzle[i] = puzzle[i], 0
        if unique and count_solutions(puzzle, n, limit=2)[0] != 1:
            puzzle[i] = v  # emptying it would admit a second solution
        else:
            holes += 1
    return "".join(str(v) if v else "." for v in puzzle), "".join(map(str, solution))


# The tool's demonstration (warm start): backtracking over the empty cells in reading order.
SOLVER_PROGRAM = """holes = [(r, c) for r in range(n) for c in range(n) if grid[r][c] == 0]

def fits(r, c, v):
    if v in grid[r] or any(grid[k][c] == v for k in range(n)):
        return False
    r0, c0 = r - r % box, c - c % box
    return all(grid[r0 + i][c0 + j] != v for i in range(box) for j in range(box))

def fill(k):
    if k == len(holes):
        return True
    r, c = holes[k]
    for v in range(1, n + 1):
        if fits(r, c, v):
            grid[r][c] = v
            if fill(k + 1):
                return True
    grid[r][c] = 0
    return False

fill(0)
for r, c in holes:
    print(f"r{r + 1}c{c + 1}={grid[r][c]}")
"""

_FILL = re.compile(r"(?i)\br\s*(\d+)\s*c\s*(\d+)\s*[=:]\s*(\d+)")
_GRID_NOISE = re.compile(r"[\s|,+\-\[\]()]")


def parse_grid(text: str, n: int) -> list[int] | None:
    """The last ``n`` x ``n`` grid written in ``text`` (rows of digits with ``.``/``0``/``_`` for
    empty; spaces, ``|``, commas and brackets ignored; or one row of ``n * n``), 0 = empty."""
    rows = []
    for line in text.splitlines():
        cleaned = _GRID_NOISE.sub("", line)
        if len(cleaned) in (n, n * n) and all(ch.isdigit() or ch in "._" for ch in cleaned):
            rows.append(cleaned)
    if rows and len(rows[-1]) == n * n:
        flat = rows[-1]
    else:
        last = [r for r in rows if len(r) == n][-n:]
        if len(last) < n:
            return None
        flat = "".join(last)
    return [int(ch) if ch.isdigit() else 0 for ch in flat]


def parse_fills(text: str, n: int) -> list[tuple[int, int, int]] | None:
    """(row, col, value) fills as written (1-based): ``rRcC=V`` items, else a whole grid's
    non-empty cells; None if there are neither. At most :data:`MAX_FILLS` are kept."""
    if not isinstance(text, str):
        raise ValueError(f"parse_fills: expected a str, got {type(text).__name__}")
    fills = [(int(r), int(c), int(v)) for r, c, v in _FILL.findall(text)]
    if not fills:
        grid = parse_grid(text, n)
        if grid is None:
            return None
        fills = [(i // n + 1, i % n + 1, v) for i, v in enumerate(grid) if v]
    return fills[:MAX_FILLS] or None


@dataclass(frozen=True)
class SudokuState(TurnState):
    """The puzzle (``.`` = empty; the others are givens), its solution, and the current cells."""

    n: int
    puzzle: str
    solution: str
    cells: str

    @property
    def holes(self) -> int:
        return self.puzzle.count(".")

    @property
    def solved(self) -> bool:
        return "." not in self.cells

    def correct(self) -> int:
        return sum(1 for p, c, s in zip(self.puzzle, self.cells, self.solution) if p == "." and c == s)

    def wrong(self) -> int:
        return sum(1 for p, c, s in zip(self.puzzle, self.cells, self.solution) if p == "." and c not in (".", s))


@dataclass(frozen=True)
class FillResult:
    """What executing a list of fills did (see :meth:`Sudoku.fill`)."""

    cells: str
    placed: int
    conflicts: int
    givens: int
    invalid: int


class Sudoku(ToolPlannerEnvironment):
    """Sudoku with a tool agent and a planner; see the module docstring for puzzles and rewards."""

    name: ClassVar[str] = "sudoku"
    Options = SudokuOptions
    reference_program: ClassVar[str] = SOLVER_PROGRAM

    def __init__(self, opts: SudokuOptions | None = None) -> None:
        self.opts = o = opts or SudokuOptions()
        if o.size not in (4, 9):
            raise ConfigError(f"task.size={o.size!r}: choose 4 or 9")
        super().__init__(o.max_turns, o.wall_seconds)
        self._problems = []
        for i in range(o.num_problems):
            rng = random.Random(f"sudoku:{o.seed}:{i}")  # problem i does not depend on num_problems
            puzzle, solution = generate_puzzle(rng, o.size, o.empty_fraction, o.unique)
            self._problems.append(Problem(f"sudoku/{o.size}/{o.seed}/{i}", {"puzzle": puzzle, "solution": solution}))

    def problems(self) -> list[Problem]:
        return list(self._problems)

    def reset(self, problem: Problem) -> SudokuState:
        puzzle, solution = problem.data["puzzle"], problem.data["solution"]
        n = isqrt(len(puzzle))
        if n * n != len(puzzle) or n not in (4, 9) or len(solution) != len(puzzle):
            raise ValueError(f"problem {problem.id}: puzzle of {len(puzzle)} cells; expected 16 or 81")
        return SudokuState(n=n, puzzle=puzzle, solution=solution, cells=puzzle)

    # -- rules ------------------------------------------------------------------------------

    def fill(self, state: SudokuState, fills: list[tuple[int, int, int]]) -> FillResult:
        """Execute ``fills`` in order under the module's rules; ``state`` is not changed."""
        n, b = state.n, isqrt(state.n)
        cells = list(state.cells)
        placed = conflicts = givens = invalid = 0
        for r, c, v in fills:
            if not (1 <= r <= n and 1 <= c <= n and 1 <= v <= n):
                invalid += 1
                continue
            i, digit = (r - 1) * n + c - 1, str(v)
            if state.puzzle[i] != ".":
                givens += state.puzzle[i] != digit
                continue
            if cells[i] == digit:
                continue
            r0, c0 = (r - 1) // b * b, (c - 1) // b * b
            peers = {(r - 1) * n + k for k in range(n)} | {k * n + c - 1 for k in range(n)}
            peers |= {(r0 + dr) * n + c0 + dc for dr in range(b) for dc in range(b)}
            peers.discard(i)
            if any(cells[j] == digit for j in peers):
                conflicts += 1
                continue
            cells[i] = digit
            placed += 1
        return FillResult("".join(cells), placed, conflicts, givens, invalid)

    # -- text -------------------------------------------------------------------------------

    def rules(self) -> str:
        n = self.opts.size
        b = isqrt(n)
        return (f"Task: {n}x{n} Sudoku. Fill every empty cell '.' with a digit 1-{n} so that each row, each column and "
                f"each {b}x{b} box holds every digit once. Rows are numbered 1-{n} from the top, columns 1-{n} from "
                "the left. Given digits cannot change; your own earlier fills can. A fill that repeats a digit in its "
                "row, column or box, changes a given, or is out of range is rejected and penalised. Correct fills "
                "score, wrong ones cost, a full grid scores most.")

    def render(self, state: SudokuState) -> str:
        n, b = state.n, isqrt(state.n)

        def line(values: list[str]) -> str:
            return " | ".join(" ".join(values[k:k + b]) for k in range(0, n, b))

        head = "    " + line([str(c + 1) for c in range(n)])
        rule = "    " + "-+-".join("-" * (2 * b - 1) for _ in range(b))
        rows = [head]
        for r in range(n):
            if r and r % b == 0:
                rows.append(rule)
            rows.append(f"r{r + 1}  " + line(list(state.cells[r * n:(r + 1) * n])))
        fills = [f"r{i // n + 1}c{i % n + 1}={ch}" for i, (p, ch) in enumerate(zip(state.puzzle, state.cells))
                 if p == "." and ch != "."]
        text = "Grid (columns numbered on top):\n" + "\n".join(rows)
        text += f"\nEmpty cells left: {state.cells.count('.')} of {state.holes}."
        if fills:
            text += f" The team's fills so far: {' '.join(fills)}."
        return text

    def tool_ask(self) -> str:
        return ("Write a Python program that solves the puzzle (for example by backtracking) and prints the answer as "
                "one line per empty cell, like `r1c2=3`, or as the full solved grid. It starts with these variables "
                "already defined: `grid` (list of rows, each a list of int, 0 = empty), `n` (the side) and `box` (the "
                "side of a box). Reply with the program in a ```python block.")

    def planner_well_formed(self, state: SudokuState, text: str) -> bool:
        """Whether ``text`` holds fills :func:`parse_fills` reads (``rRcC=V`` lines or a whole grid)."""
        return parse_fills(text, state.n) is not None

    def planner_ask(self) -> str:
        return ("Answer with one line per cell you fill, like `r1c2=3` (row 1, column 2, digit 3); fill as many cells "
                "as you are sure of.")

    def tool_setup(self, state: SudokuState) -> str:
        n = state.n
        grid = [[int(ch) if ch != "." else 0 for ch in state.cells[r * n:(r + 1) * n]] for r in range(n)]
        return f"grid = {grid!r}\nn = {n}\nbox = {isqrt(n)}\n"

    # -- rewards ----------------------------------------------------------------------------

    def _progress(self, state: SudokuState) -> float:
        return CORRECT_CELLS * (state.correct() - state.wrong()) / max(1, state.holes)

    def score_tool_output(self, state: SudokuState, stdout: str) -> float:
        fills = parse_fills(stdout, state.n)
        if fills is None:
            return TOOL_RAN
        return TOOL_SOLVED if "." not in self.fill(state, fills).cells else TOOL_RAN

    def act(self, state: SudokuState, text: str) -> tuple[SudokuState, float, str]:
        fills = parse_fills(text, state.n)
        if fills is None:
            return state, FORMAT_PENALTY, "the planner gave no fills; nothing changed."
        res = self.fill(state, fills)
        new = replace(state, cells=res.cells)
        reward = (self._progress(new) - self._progress(state) + CONFLICT * res.conflicts
                  + GIVEN_OVERWRITE * res.givens + INVALID_FILL * res.invalid)
        said = (f"the planner sent {len(fills)} fills: {res.placed} placed, {res.conflicts} rejected for a conflict, "
                f"{res.givens} tried to change a given, {res.invalid} out of range")
        if new.solved:
            reward += SOLVED
            said += "; the grid is full: solved"
        return new, reward, said + "."

    def finished(self, state: SudokuState) -> bool:
        return state.solved

    def team_reward(self, state: SudokuState) -> float:
        return 1.0 if state.solved else state.correct() / max(1, state.holes)

    def reference(self, state: SudokuState) -> tuple[str, str] | None:
        """Warm start: one ``rRcC=V`` line per empty cell with the solution's digit, as
        :data:`SOLVER_PROGRAM` prints it, and the planner's answer, the same lines."""
        n = state.n
        fills = "\n".join(f"r{i // n + 1}c{i % n + 1}={digit}"
                          for i, (cell, digit) in enumerate(zip(state.cells, state.solution)) if cell == ".")
        return (fills, fills) if fills else None
