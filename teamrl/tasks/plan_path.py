"""``plan_path``: move an agent across a grid with walls from its start to the goal (AT-GRPO).

Two roles act each turn, in this order:

- ``tool`` writes a Python program. It runs in the sandbox (never in this process) after a
  prelude that defines ``grid`` (list of str, ``#`` wall, ``.`` free), ``start`` (the agent's
  current ``(row, col)``) and ``goal``; what it prints is shown to the planner.
- ``planner`` answers with a move list, ``Moves: U R R D`` (U = row - 1, D = row + 1,
  L = col - 1, R = col + 1), which the environment executes from the current cell.

Grids are square, ``min_size`` to ``max_size`` cells a side, with random walls; start and goal
are free cells at least ``max(2, size // 2)`` moves apart, and a BFS confirms the goal is
reachable (the grid is drawn again otherwise), so every problem is solvable.

Rewards (documented constants below):

planner, summed over one answer's moves
    ``STEP_COST``       -0.01 per executed move
    ``INVALID_MOVE``    -0.1  a move into a wall or off the grid: it is not executed and the
                              rest of the answer is dropped, since those moves were planned from
                              a cell the agent never reached
    ``FORMAT_PENALTY``  -0.1  no ``Moves:`` line with at least one move (nothing is executed)
    ``GOAL``            +1.0  reaching the goal (moves after it are ignored)
    ``OPTIMAL_BONUS``   +0.5  also, when the whole path since the start (executed moves of every
                              turn) is as short as the BFS distance; invalid moves are not part
                              of the path (they were already penalised)
tool
    ``TOOL_SOLVED``      1.0  the program ran and printed moves that reach the goal from the
                              current cell (same execution rules as the planner's)
    ``TOOL_RAN``         0.2  it ran and printed something else
    ``TOOL_FAILED``      0.0  error, timeout, no program, or nothing printed
team (normalised to [0, 1])
    (``GOAL`` + ``OPTIMAL_BONUS`` if optimal) / ``TEAM_MAX`` once the goal is reached, so 1.0
    for a shortest path, 2/3 for a longer one, 0 before; ``success`` is "goal reached".

The tool-then-planner turn structure it shares with ``sokoban`` and ``sudoku`` is in
:mod:`teamrl.tasks.tool_planner`.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, replace
from typing import ClassVar

from teamrl.core.config import ConfigError, option
from teamrl.tasks.task import Problem
from teamrl.tasks.tool_planner import (
    DIRS,
    TOOL_RAN,
    TOOL_SOLVED,
    Pos,
    ToolPlannerEnvironment,
    TurnState,
    parse_moves,
    show_moves,
)

# --- plan_path ---------------------------------------------------------------------------------

STEP_COST = -0.01
INVALID_MOVE = -0.1
FORMAT_PENALTY = -0.1
GOAL = 1.0
OPTIMAL_BONUS = 0.5
TEAM_MAX = GOAL + OPTIMAL_BONUS


@dataclass
class PlanPathOptions:
    name: str = "plan_path"
    num_problems: int = option(64, ge=1, doc="how many grids to generate")
    min_size: int = option(4, ge=2, le=16, doc="smallest grid side (cells)")
    max_size: int = option(6, ge=2, le=16, doc="largest grid side (cells)")
    wall_density: float = option(0.25, ge=0, le=0.6, doc="chance that a cell is a wall")
    max_turns: int = option(3, ge=1, doc="turns (tool then planner) per episode")
    seed: int = option(0, doc="seed of the grid generator")
    wall_seconds: float = option(3.0, gt=0, doc="sandbox wall-clock (and CPU) limit per tool program")
    agents: str = option("tool,planner", choices=("tool,planner", "planner"),
                         doc="who acts: the team, or the planner alone (the single-agent baseline)")


@dataclass(frozen=True)
class PlanPathState(TurnState):
    """The grid (``#`` wall, ``.`` free), start, goal, the agent's cell, the BFS distance from
    start to goal, and the moves executed since the start."""

    grid: tuple[str, ...]
    start: Pos
    goal: Pos
    pos: Pos
    shortest: int
    path: str = ""

    @property
    def reached(self) -> bool:
        return self.pos == self.goal

    @property
    def optimal(self) -> bool:
        return self.reached and len(self.path) == self.shortest


def _free(grid: tuple[str, ...], cell: Pos) -> bool:
    r, c = cell
    return 0 <= r < len(grid) and 0 <= c < len(grid[0]) and grid[r][c] != "#"


def bfs_distances(grid: tuple[str, ...], start: Pos) -> dict[Pos, int]:
    """Moves from ``start`` to every reachable free cell."""
    dist = {start: 0}
    queue = deque([start])
    while queue:
        r, c = queue.popleft()
        for dr, dc in DIRS.values():
            nxt = (r + dr, c + dc)
            if nxt not in dist and _free(grid, nxt):
                dist[nxt] = dist[(r, c)] + 1
                queue.append(nxt)
    return dist


def shortest_path(grid: tuple[str, ...], start: Pos, goal: Pos) -> str | None:
    """A shortest move string from ``start`` to ``goal`` (``""`` if equal), None if unreachable."""
    parent: dict[Pos, tuple[Pos, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            moves = []
            while parent[cell] is not None:
                cell, m = parent[cell]  # type: ignore[misc]
                moves.append(m)
            return "".join(reversed(moves))
        for m, (dr, dc) in DIRS.items():
            nxt = (cell[0] + dr, cell[1] + dc)
            if nxt not in parent and _free(grid, nxt):
                parent[nxt] = (cell, m)
                queue.append(nxt)
    return None


def walk(grid: tuple[str, ...], pos: Pos, goal: Pos, moves: str) -> tuple[Pos, str, int | None]:
    """Execute ``moves`` from ``pos``: (end cell, executed moves, index of the first invalid move
    or None). Stops at the first invalid move and on reaching ``goal``."""
    done: list[str] = []
    for i, m in enumerate(moves):
        if pos == goal:
            break
        dr, dc = DIRS[m]
        nxt = (pos[0] + dr, pos[1] + dc)
        if not _free(grid, nxt):
            return pos, "".join(done), i
        pos = nxt
        done.append(m)
    return pos, "".join(done), None


def generate_grid(
    rng: random.Random, size: int, wall_density: float, tries: int = 1000
) -> tuple[tuple[str, ...], Pos, Pos, int]:
    """(grid, start, goal, BFS distance): a ``size`` x ``size`` grid whose goal is reachable,
    at least ``max(2, size // 2)`` moves from the start."""
    min_dist = max(2, size // 2)
    for _ in range(tries):
        grid = tuple("".join("#" if rng.random() < wall_density else "." for _ in range(size)) for _ in range(size))
        free = [(r, c) for r in range(size) for c in range(size) if grid[r][c] == "."]
        if len(free) < 2:
            continue
        start = rng.choice(free)
        dist = bfs_distances(grid, start)
        far = sorted(p for p, d in dist.items() if d >= min_dist)
        if far:
            goal = rng.choice(far)
            return grid, start, goal, dist[goal]
    raise RuntimeError(
        f"plan_path: no {size}x{size} grid with a start and goal {min_dist}+ moves apart in {tries} tries "
        f"at wall_density={wall_density}; lower task.wall_density"
    )


# The tool's demonstration (warm start): a breadth-first search from the prelude's variables.
BFS_PROGRAM = """from collections import deque
steps = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
prev = {tuple(start): None}
queue = deque([tuple(start)])
while queue:
    cell = queue.popleft()
    if cell == tuple(goal):
        break
    for move, (dr, dc) in steps.items():
        r, c = cell[0] + dr, cell[1] + dc
        if 0 <= r < len(grid) and 0 <= c < len(grid[r]) and grid[r][c] != "#" and (r, c) not in prev:
            prev[(r, c)] = (cell, move)
            queue.append((r, c))
path, cell = [], tuple(goal)
while prev.get(cell):
    cell, move = prev[cell]
    path.append(move)
print(" ".join(reversed(path)))
"""


class PlanPath(ToolPlannerEnvironment):
    """Grid path planning with a tool agent and a planner; see the module docstring for rewards."""

    name: ClassVar[str] = "plan_path"
    Options = PlanPathOptions
    reference_program: ClassVar[str] = BFS_PROGRAM

    def __init__(self, opts: PlanPathOptions | None = None) -> None:
        self.opts = opts or PlanPathOptions()
        if self.opts.min_size > self.opts.max_size:
            raise ConfigError(f"task.min_size={self.opts.min_size} > task.max_size={self.opts.max_size}")
        super().__init__(self.opts.max_turns, self.opts.wall_seconds)
        self.roles = tuple(self.opts.agents.split(","))  # the planner alone never sees tool output
        self._problems = []
        for i in range(self.opts.num_problems):
            # One generator per problem: problem i does not depend on num_problems.
            rng = random.Random(f"plan_path:{self.opts.seed}:{i}")
            size = rng.randint(self.opts.min_size, self.opts.max_size)
            grid, start, goal, dist = generate_grid(rng, size, self.opts.wall_density)
            self._problems.append(Problem(f"plan_path/{self.opts.seed}/{i}",
                                          {"grid": grid, "start": start, "goal": goal, "shortest": dist}))

    def problems(self) -> list[Problem]:
        return list(self._problems)

    def reset(self, problem: Problem) -> PlanPathState:
        d = problem.data
        return PlanPathState(grid=tuple(d["grid"]), start=tuple(d["start"]), goal=tuple(d["goal"]),
                             pos=tuple(d["start"]), shortest=int(d["shortest"]))

    # -- text -------------------------------------------------------------------------------

    def rules(self) -> str:
        return ("Task: move the agent A on the grid to the goal G. '#' is a wall, '.' is free; rows are numbered from "
                "0 at the top, columns from 0 at the left. Moves: U (row - 1), D (row + 1), L (col - 1), R (col + 1). "
                "A move into a wall or off the grid is invalid: it is penalised and the rest of that turn's moves are "
                "dropped. Each move costs a little; reaching G scores, and more if the whole path is a shortest one.")

    def render(self, state: PlanPathState) -> str:
        rows = []
        for r, line in enumerate(state.grid):
            cells = list(line)
            gr, gc = state.goal
            if r == gr:
                cells[gc] = "G"
            if r == state.pos[0]:
                cells[state.pos[1]] = "A"
            rows.append("".join(cells))
        return ("Grid:\n" + "\n".join(rows) + f"\nAgent A at (row, col) = {state.pos}; goal G at {state.goal}; "
                f"moves made so far: {len(state.path)}.")

    def tool_ask(self) -> str:
        return ("Write a Python program that finds a shortest path from the agent to the goal and prints it as one "
                "line of moves, like `U R R D`. It starts with these variables already defined: `grid` (list of str, "
                "'#' wall, '.' free), `start` (the agent's (row, col)), `goal` ((row, col)). Reply with the program "
                "in a ```python block.")

    def tool_setup(self, state: PlanPathState) -> str:
        return f"grid = {list(state.grid)!r}\nstart = {state.pos!r}\ngoal = {state.goal!r}\n"

    # -- rewards ----------------------------------------------------------------------------

    def score_tool_output(self, state: PlanPathState, stdout: str) -> float:
        moves = parse_moves(stdout, label_required=False)
        if moves is None:
            return TOOL_RAN
        end, _, invalid = walk(state.grid, state.pos, state.goal, moves)
        return TOOL_SOLVED if end == state.goal and invalid is None else TOOL_RAN

    def act(self, state: PlanPathState, text: str) -> tuple[PlanPathState, float, str]:
        moves = parse_moves(text)
        if moves is None:
            return state, FORMAT_PENALTY, "the planner gave no `Moves:` line; nothing was executed."
        end, done, invalid = walk(state.grid, state.pos, state.goal, moves)
        new = replace(state, pos=end, path=state.path + done)
        reward = STEP_COST * len(done)
        said = f"the planner sent `{show_moves(moves)}`: {len(done)} executed"
        if invalid is not None:
            reward += INVALID_MOVE
            said += f", then {moves[invalid]} from {end} was blocked (invalid; the rest was dropped)"
        if new.reached:
            reward += GOAL + (OPTIMAL_BONUS if new.optimal else 0.0)
            said += f"; the goal was reached in {len(new.path)} moves (shortest: {state.shortest})"
        else:
            said += f"; the agent is at {end}"
        return new, reward, said + "."

    def finished(self, state: PlanPathState) -> bool:
        return state.reached

    def team_reward(self, state: PlanPathState) -> float:
        if not state.reached:
            return 0.0
        return (GOAL + (OPTIMAL_BONUS if state.optimal else 0.0)) / TEAM_MAX

    def success(self, state: PlanPathState) -> bool:
        """The goal was reached (by any path; the team reward also prices optimality)."""
        return state.reached

    def reference(self, state: PlanPathState) -> tuple[str, str] | None:
        """Warm start: the BFS program prints a shortest path; the planner answers ``Moves:`` with it."""
        moves = shortest_path(state.grid, state.pos, state.goal)
        if not moves:
            return None
        shown = " ".join(moves)
        return shown, f"Moves: {shown}"
