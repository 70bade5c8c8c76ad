"""``sokoban``: push every box onto a goal (AT-GRPO), on generated levels or Boxoban files.

Same two roles as ``plan_path``, in this order each turn: ``tool`` writes a Python program
(run in the sandbox after a prelude defining ``grid``, ``player``, ``boxes`` and ``goals``)
whose printed output the planner sees; ``planner`` answers ``Moves: U R R D``, executed with
box pushing (walking into a box pushes it if the cell behind it is free).

Levels, in the usual notation: ``#`` wall, space floor, ``.`` goal, ``$`` box, ``*`` box on a
goal, ``@`` player, ``+`` player on a goal.

- ``source: generated``: a ``height`` x ``width`` room (outer walls, random inner walls, only
  its largest connected part kept), boxes placed on goals, then ``reverse_steps`` random
  reverse moves in which the player may *pull* a box. Every pull undoes a legal push, so the
  level is solvable by construction; levels where a box is still on a goal are drawn again,
  and a BFS solver (:func:`solve`, ``solver_budget`` states) confirms each level and records
  its fewest moves (levels needing fewer than ``min_moves`` are drawn again).
- ``source: boxoban``: levels read by :func:`load_boxoban` from ``path`` (not re-checked; the
  Boxoban sets are solvable, and 4-box BFS would be slow).

Rewards (documented constants below):

planner, summed over one answer's moves
    ``STEP_COST``       -0.01 per executed move (walk or push)
    ``INVALID_MOVE``    -0.1  a move into a wall, or pushing a box into a wall or another box: not
                              executed, and the rest of the answer is dropped
    ``FORMAT_PENALTY``  -0.1  no ``Moves:`` line with at least one move
    ``BOX_ON_GOAL``     +1.0  per push that puts a box onto a goal
    ``BOX_OFF_GOAL``    -1.0  per push that takes a box off a goal (goal to goal: 0)
    ``WIN``             +10.0 every box on a goal (moves after it are ignored)
    ``FAIL``            -1.0  once, when the episode ends unsolved: a push makes a simple corner
                              deadlock (a box off goal between two walls at right angles; the
                              level can no longer be solved, so the episode ends), or the last
                              turn ends without a win
tool
    ``TOOL_SOLVED``      1.0  the program ran and printed moves that solve the level from the
                              current state (planner execution rules)
    ``TOOL_IMPROVED``    0.5  ... that are all legal, deadlock-free, and end with more boxes on
                              goals than now
    ``TOOL_RAN``         0.2  it ran and printed something else
    ``TOOL_FAILED``      0.0  error, timeout, no program, or nothing printed
team
    1.0 when solved, else the fraction of boxes on goals (generated levels start with none on a
    goal, so this measures progress; it is not reset by a deadlock).

Warm start (``teamrl sft``): the tool writes :data:`BFS_PROGRAM` (the same search as
:func:`solve`, so it prints the same fewest-moves solution) and the planner answers
``Moves: ...`` with that solution. A level :func:`solve` cannot solve within ``solver_budget``
states (a hard Boxoban level) has no demonstrations; the program has no budget but the
sandbox's ``wall_seconds``.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

from teamrl.core.config import ConfigError, InputError, InputFileMissing, option
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
from teamrl.tasks.task import Problem

STEP_COST = -0.01
INVALID_MOVE = -0.1
FORMAT_PENALTY = -0.1
BOX_ON_GOAL = 1.0
BOX_OFF_GOAL = -1.0
WIN = 10.0
FAIL = -1.0
TOOL_IMPROVED = 0.5

LEVEL_CHARS = "# .$*@+"
_PULL_CHANCE = 0.75  # in reverse play, how often the player drags a box it walks away from


@dataclass
class SokobanOptions:
    name: str = "sokoban"
    source: str = option(
        "generated", choices=("generated", "boxoban"), doc="generated levels, or Boxoban files at path"
    )
    path: str = option("", doc="source=boxoban: a Boxoban .txt file or a folder of them (read recursively, sorted)")
    num_problems: int = option(64, ge=1, doc="levels to generate, or the first N Boxoban levels")
    height: int = option(7, ge=4, le=16, doc="generated room height, outer walls included")
    width: int = option(7, ge=4, le=16, doc="generated room width, outer walls included")
    min_boxes: int = option(1, ge=1, le=6, doc="fewest boxes in a generated level")
    max_boxes: int = option(2, ge=1, le=6, doc="most boxes in a generated level")
    wall_density: float = option(0.1, ge=0, le=0.4, doc="chance that an inner cell of a generated room is a wall")
    reverse_steps: int = option(
        40, ge=1, doc="random reverse moves (with pulls) that scatter the boxes off their goals"
    )
    min_moves: int = option(3, ge=1, doc="fewest moves a generated level must need (drops trivial levels)")
    solver_budget: int = option(100_000, ge=100, doc="states the BFS solver may visit to confirm a generated level")
    max_turns: int = option(3, ge=1, doc="turns (tool then planner) per episode")
    seed: int = option(0, doc="seed of the level generator")
    wall_seconds: float = option(3.0, gt=0, doc="sandbox wall-clock (and CPU) limit per tool program")


@dataclass(frozen=True)
class Level:
    """The static part of a level, shared by every state of an episode."""

    height: int
    width: int
    walls: frozenset[Pos]
    goals: frozenset[Pos]

    def blocked(self, cell: Pos) -> bool:
        r, c = cell
        return cell in self.walls or not (0 <= r < self.height and 0 <= c < self.width)


def parse_level(lines: tuple[str, ...] | list[str], where: str = "level") -> tuple[Level, Pos, frozenset[Pos]]:
    """(level, player, boxes) from text rows; ``where`` names the level in errors."""
    if not lines:
        raise ValueError(f"{where}: empty level")
    width = max(len(row) for row in lines)
    walls, goals, boxes, players = set(), set(), set(), []
    for r, row in enumerate(lines):
        for c, ch in enumerate(row.ljust(width)):
            if ch not in LEVEL_CHARS:
                raise ValueError(f"{where}: character {ch!r} at row {r}, col {c}; allowed are {LEVEL_CHARS!r}")
            if ch == "#":
                walls.add((r, c))
            if ch in ".*+":
                goals.add((r, c))
            if ch in "$*":
                boxes.add((r, c))
            if ch in "@+":
                players.append((r, c))
    if len(players) != 1:
        raise ValueError(f"{where}: {len(players)} players ('@' or '+'); a level needs exactly one")
    if not boxes or len(boxes) != len(goals):
        raise ValueError(
            f"{where}: {len(boxes)} boxes and {len(goals)} goals; a level needs as many of each, at least one"
        )
    return Level(len(lines), width, frozenset(walls), frozenset(goals)), players[0], frozenset(boxes)


def render_level(level: Level, player: Pos, boxes: frozenset[Pos]) -> tuple[str, ...]:
    """Text rows of a state, in the level notation."""
    rows = []
    for r in range(level.height):
        row = []
        for c in range(level.width):
            cell = (r, c)
            goal = cell in level.goals
            if cell in level.walls:
                row.append("#")
            elif cell == player:
                row.append("+" if goal else "@")
            elif cell in boxes:
                row.append("*" if goal else "$")
            else:
                row.append("." if goal else " ")
        rows.append("".join(row))
    return tuple(rows)


def corner_deadlock(level: Level, box: Pos) -> bool:
    """A box off goal with walls on two sides at right angles can never move to a goal."""
    if box in level.goals:
        return False
    r, c = box
    vertical = level.blocked((r - 1, c)) or level.blocked((r + 1, c))
    horizontal = level.blocked((r, c - 1)) or level.blocked((r, c + 1))
    return vertical and horizontal


def step(level: Level, player: Pos, boxes: frozenset[Pos], move: str) -> tuple[Pos, frozenset[Pos], Pos | None] | None:
    """(player, boxes, where a pushed box went or None) after ``move``; None if it is illegal."""
    dr, dc = DIRS[move]
    nxt = (player[0] + dr, player[1] + dc)
    if level.blocked(nxt):
        return None
    if nxt not in boxes:
        return nxt, boxes, None
    beyond = (nxt[0] + dr, nxt[1] + dc)
    if level.blocked(beyond) or beyond in boxes:
        return None
    return nxt, (boxes - {nxt}) | {beyond}, beyond


@dataclass(frozen=True)
class Outcome:
    """The result of executing a move list (see :func:`play`)."""

    player: Pos
    boxes: frozenset[Pos]
    executed: int
    pushes: int
    invalid: int | None  # index of the illegal move that stopped execution
    on: int  # pushes onto a goal
    off: int  # pushes off a goal
    deadlocked: bool


def play(level: Level, player: Pos, boxes: frozenset[Pos], moves: str) -> Outcome:
    """Execute ``moves``; stops at an illegal move, a corner deadlock, or once solved."""
    executed, pushes, on, off = 0, 0, 0, 0
    for i, m in enumerate(moves):
        if boxes <= level.goals:
            break
        res = step(level, player, boxes, m)
        if res is None:
            return Outcome(player, boxes, executed, pushes, i, on, off, False)
        origin = res[0]  # a pushed box moved from where the player now stands
        player, boxes, pushed = res
        executed += 1
        if pushed is not None:
            pushes += 1
            on += pushed in level.goals and origin not in level.goals
            off += origin in level.goals and pushed not in level.goals
            if corner_deadlock(level, pushed):
                return Outcome(player, boxes, executed, pushes, None, on, off, True)
    return Outcome(player, boxes, executed, pushes, None, on, off, False)


def solve(level: Level, player: Pos, boxes: frozenset[Pos], budget: int = 100_000) -> str | None:
    """A solution with the fewest moves (BFS over player and boxes, corner deadlocks pruned),
    ``""`` if already solved, None if there is none within ``budget`` visited states."""
    if boxes <= level.goals:
        return ""
    start = (player, boxes)
    parent: dict[tuple[Pos, frozenset[Pos]], tuple[tuple[Pos, frozenset[Pos]], str] | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for m in DIRS:
            res = step(level, node[0], node[1], m)
            if res is None or (res[2] is not None and corner_deadlock(level, res[2])):
                continue
            child = (res[0], res[1])
            if child in parent:
                continue
            parent[child] = (node, m)
            if res[1] <= level.goals:
                moves = []
                cur = child
                while parent[cur] is not None:
                    cur, mv = parent[cur]  # type: ignore[misc]
                    moves.append(mv)
                return "".join(reversed(moves))
            if len(parent) >= budget:
                return None
            queue.append(child)
    return None


def _largest_component(floor: set[Pos]) -> set[Pos]:
    best: set[Pos] = set()
    seen: set[Pos] = set()
    for cell in sorted(floor):
        if cell in seen:
            continue
        part, queue = {cell}, deque([cell])
        while queue:
            r, c = queue.popleft()
            for dr, dc in DIRS.values():
                nxt = (r + dr, c + dc)
                if nxt in floor and nxt not in part:
                    part.add(nxt)
                    queue.append(nxt)
        seen |= part
        if len(part) > len(best):
            best = part
    return best


def generate_level(rng: random.Random, height: int, width: int, boxes: int, wall_density: float, reverse_steps: int,
                   budget: int, min_moves: int = 1, tries: int = 500) -> tuple[tuple[str, ...], int]:
    """(level rows, fewest moves to solve): a solvable level with ``boxes`` boxes, none on a
    goal, that needs at least ``min_moves`` moves."""
    for _ in range(tries):
        inner = [(r, c) for r in range(1, height - 1) for c in range(1, width - 1)]
        floor = _largest_component({cell for cell in inner if rng.random() >= wall_density})
        if len(floor) < 2 * boxes + 2:
            continue
        cells = sorted(floor)
        goals = frozenset(rng.sample(cells, boxes))
        placed = set(goals)
        player = rng.choice([c for c in cells if c not in placed])
        for _ in range(reverse_steps):
            dr, dc = DIRS[rng.choice("UDLR")]
            nxt = (player[0] + dr, player[1] + dc)
            if nxt not in floor or nxt in placed:
                continue
            behind = (player[0] - dr, player[1] - dc)
            if behind in placed and rng.random() < _PULL_CHANCE:
                placed.remove(behind)  # the pull: box from behind the player to its old cell
                placed.add(player)
            player = nxt
        if placed & goals:
            continue
        walls = frozenset((r, c) for r in range(height) for c in range(width) if (r, c) not in floor)
        level = Level(height, width, walls, goals)
        solution = solve(level, player, frozenset(placed), budget)
        if solution and len(solution) >= min_moves:
            return render_level(level, player, frozenset(placed)), len(solution)
    raise RuntimeError(f"sokoban: no solvable {height}x{width} level with {boxes} boxes in {tries} tries; "
                       "raise task.reverse_steps or task.solver_budget, or lower task.wall_density or task.min_moves")


def load_boxoban(path: str | Path, limit: int | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """(id, rows) of the levels in a Boxoban file, or in every ``.txt`` under a folder (sorted).

    Levels follow a ``; N`` line and end at a blank line; ids are ``<file, relative to path,
    without .txt>/<N>``. ``limit``: stop after that many levels. Each level is validated.
    """
    root = Path(path)
    if not root.exists():
        raise InputFileMissing(
            f"load_boxoban: {str(path)!r} does not exist; give a Boxoban .txt file or a folder of them"
        )
    files = [root] if root.is_file() else sorted(root.rglob("*.txt"))
    if not files:
        raise InputError(f"load_boxoban: no .txt files under {str(path)!r}")
    levels: list[tuple[str, tuple[str, ...]]] = []
    for f in files:
        stem = f.stem if f == root else f.relative_to(root).with_suffix("").as_posix()
        name: str | None = None
        rows: list[str] = []
        for raw in f.read_text(encoding="utf-8").splitlines() + [""]:
            if raw.startswith(";") or not raw.strip():
                if name is not None and rows:
                    parse_level(rows, f"{f}, level {name}")  # validate now, naming the file
                    levels.append((f"{stem}/{name}", tuple(rows)))
                    if limit is not None and len(levels) >= limit:
                        return levels
                    name, rows = None, []
                if raw.startswith(";"):
                    name, rows = raw[1:].strip(), []
            elif name is not None:
                rows.append(raw.rstrip("\r\n"))
    return levels


# The tool's demonstration (warm start): :func:`solve` written from the prelude's variables (same
# move order and deadlock pruning, so it prints the same solution).
BFS_PROGRAM = """from collections import deque
steps = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
targets = set(map(tuple, goals))

def wall(r, c):
    return not (0 <= r < len(grid) and 0 <= c < len(grid[r])) or grid[r][c] == "#"

def cornered(r, c):  # a box off goal in a corner can never move again
    return (r, c) not in targets and (wall(r - 1, c) or wall(r + 1, c)) and (wall(r, c - 1) or wall(r, c + 1))

start = (tuple(player), frozenset(map(tuple, boxes)))
prev = {start: None}
queue = deque([start])
end = None
while queue and end is None:
    node = queue.popleft()
    (r, c), held = node
    for move, (dr, dc) in steps.items():
        cell, now = (r + dr, c + dc), held
        if wall(*cell):
            continue
        if cell in held:
            push = (cell[0] + dr, cell[1] + dc)
            if wall(*push) or push in held or cornered(*push):
                continue
            now = (held - {cell}) | {push}
        child = (cell, now)
        if child not in prev:
            prev[child] = (node, move)
            if now <= targets:
                end = child
                break
            queue.append(child)
path = []
while end is not None and prev[end] is not None:
    end, move = prev[end]
    path.append(move)
print(" ".join(reversed(path)))
"""


@dataclass(frozen=True)
class SokobanState(TurnState):
    """The level, the player, the boxes, moves executed so far, and whether a deadlock ended it."""

    level: Level
    player: Pos
    boxes: frozenset[Pos]
    moves: int = 0
    deadlocked: bool = False

    @property
    def solved(self) -> bool:
        return self.boxes <= self.level.goals

    @property
    def on_goals(self) -> int:
        return len(self.boxes & self.level.goals)


class Sokoban(ToolPlannerEnvironment):
    """Sokoban with a tool agent and a planner; see the module docstring for levels and rewards."""

    name: ClassVar[str] = "sokoban"
    Options = SokobanOptions
    reference_program: ClassVar[str] = BFS_PROGRAM

    def __init__(self, opts: SokobanOptions | None = None) -> None:
        self.opts = o = opts or SokobanOptions()
        super().__init__(o.max_turns, o.wall_seconds)
        self._problems: list[Problem] = []
        if o.source == "boxoban":
            if not o.path:
                raise ConfigError("task.path: source=boxoban needs a Boxoban .txt file or folder "
                                 "(see docs/data.md)")
            for lid, rows in load_boxoban(o.path, o.num_problems):
                self._problems.append(Problem(f"boxoban/{lid}", {"rows": rows, "optimal": None}))
        elif o.source == "generated":
            if o.min_boxes > o.max_boxes:
                raise ConfigError(f"task.min_boxes={o.min_boxes} > task.max_boxes={o.max_boxes}")
            if (o.height - 2) * (o.width - 2) < 2 * o.max_boxes + 2:
                raise ConfigError(f"task.height={o.height}, task.width={o.width}: too small a room for "
                                 f"task.max_boxes={o.max_boxes}")
            for i in range(o.num_problems):
                rng = random.Random(f"sokoban:{o.seed}:{i}")  # problem i does not depend on num_problems
                n = rng.randint(o.min_boxes, o.max_boxes)
                rows, fewest = generate_level(
                    rng, o.height, o.width, n, o.wall_density, o.reverse_steps, o.solver_budget, o.min_moves
                )
                self._problems.append(Problem(f"sokoban/{o.seed}/{i}", {"rows": rows, "optimal": fewest}))
        else:
            raise ConfigError(f"task.source={o.source!r}: choose 'generated' or 'boxoban'")

    def problems(self) -> list[Problem]:
        return list(self._problems)

    def reset(self, problem: Problem) -> SokobanState:
        level, player, boxes = parse_level(problem.data["rows"], f"problem {problem.id}")
        return SokobanState(level=level, player=player, boxes=boxes)

    # -- text -------------------------------------------------------------------------------

    def rules(self) -> str:
        return ("Task: Sokoban. Push every box onto a goal. Legend: '#' wall, ' ' floor, '.' goal, '$' box, "
                "'*' box on a goal, '@' player, '+' player on a goal. Rows are numbered from 0 at the top, columns "
                "from 0 at the left. Moves: U (row - 1), D (row + 1), L (col - 1), R (col + 1); walking into a box "
                "pushes it one cell if the cell behind it is free. You cannot pull boxes. A move into a wall, or a "
                "push into a wall or another box, is invalid: it is penalised and the rest of that turn's moves are "
                "dropped. A box pushed into a corner off a goal loses the game. Each move costs a little; boxes onto "
                "goals score, boxes off goals cost, solving scores most.")

    def render(self, state: SokobanState) -> str:
        rows = render_level(state.level, state.player, state.boxes)
        return ("Level:\n" + "\n".join(rows) + f"\nPlayer at (row, col) = {state.player}; boxes on goals: "
                f"{state.on_goals} of {len(state.boxes)}; moves made so far: {state.moves}.")

    def tool_ask(self) -> str:
        return ("Write a Python program that finds moves solving the level from the current state (for example a "
                "breadth-first search over player and box positions) and prints them as one line, like `U R R D`. "
                "It starts with these variables already defined: `grid` (list of str, the level rows above), "
                "`player` ((row, col)), `boxes` and `goals` (lists of (row, col)). Reply with the program in a "
                "```python block.")

    def tool_setup(self, state: SokobanState) -> str:
        rows = list(render_level(state.level, state.player, state.boxes))
        return (f"grid = {rows!r}\nplayer = {state.player!r}\nboxes = {sorted(state.boxes)!r}\n"
                f"goals = {sorted(state.level.goals)!r}\n")

    # -- rewards ----------------------------------------------------------------------------

    def score_tool_output(self, state: SokobanState, stdout: str) -> float:
        moves = parse_moves(stdout, label_required=False)
        if moves is None:
            return TOOL_RAN
        out = play(state.level, state.player, state.boxes, moves)
        if out.boxes <= state.level.goals and out.invalid is None:
            return TOOL_SOLVED
        if out.invalid is None and not out.deadlocked and len(out.boxes & state.level.goals) > state.on_goals:
            return TOOL_IMPROVED
        return TOOL_RAN

    def act(self, state: SokobanState, text: str) -> tuple[SokobanState, float, str]:
        last_turn = state.turn + 1 >= self.max_turns
        moves = parse_moves(text)
        if moves is None:
            new, reward, said = state, FORMAT_PENALTY, "the planner gave no `Moves:` line; nothing was executed"
        else:
            out = play(state.level, state.player, state.boxes, moves)
            new = replace(state, player=out.player, boxes=out.boxes, moves=state.moves + out.executed,
                          deadlocked=out.deadlocked)
            reward = STEP_COST * out.executed + BOX_ON_GOAL * out.on + BOX_OFF_GOAL * out.off
            said = f"the planner sent `{show_moves(moves)}`: {out.executed} executed"
            if out.invalid is not None:
                reward += INVALID_MOVE
                said += f", then {moves[out.invalid]} from {out.player} was blocked (invalid; the rest was dropped)"
            said += f"; {out.pushes} pushes, boxes pushed onto goals: {out.on}, off goals: {out.off}"
            if new.solved:
                reward += WIN
                said += "; every box is on a goal: solved"
            elif out.deadlocked:
                reward += FAIL
                said += "; a box was pushed into a corner off its goal: the level cannot be solved any more"
        if last_turn and not new.solved and not new.deadlocked:
            reward += FAIL
            said += "; out of turns"
        return new, reward, said + "."

    def finished(self, state: SokobanState) -> bool:
        return state.solved or state.deadlocked

    def team_reward(self, state: SokobanState) -> float:
        return 1.0 if state.solved else state.on_goals / len(state.boxes)

    def reference(self, state: SokobanState) -> tuple[str, str] | None:
        """Warm start: :data:`BFS_PROGRAM` prints :func:`solve`'s solution; the planner answers
        ``Moves:`` with it. None when :func:`solve` finds none within ``solver_budget`` states."""
        moves = solve(state.level, state.player, state.boxes, self.opts.solver_budget)
        if not moves:
            return None
        shown = " ".join(moves)
        return shown, f"Moves: {shown}"
