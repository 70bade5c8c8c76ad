"""The AT-GRPO tool/planner environments: plan_path, sokoban, sudoku.

Seeded loops stand in for property tests (hypothesis is not a dependency yet). Tool programs
run through the real sandbox.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import random
from collections import deque
from pathlib import Path

import pytest

from teamrl.core.config import ConfigError, build_dataclass
from teamrl.tasks import plan_path as pp
from teamrl.tasks import sokoban as sk
from teamrl.tasks import sudoku as sd
from teamrl.tasks import tool_planner as tp
from teamrl.tasks.plan_path import PlanPath, PlanPathOptions
from teamrl.tasks.tool_planner import parse_moves
from teamrl.tasks.sokoban import Sokoban, SokobanOptions, load_boxoban, parse_level, play, render_level, solve
from teamrl.tasks.sudoku import Sudoku, SudokuOptions, count_solutions, parse_fills
from teamrl.tasks.task import Problem

BOXOBAN = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "boxoban"


def planner(moves: str) -> str:
    return f"Let me think.\nMoves: {' '.join(moves)}"


def fenced(code: str) -> str:
    return f"Here is my program:\n```python\n{code}\n```"


# A tool program as a model might write it: BFS over the grid from `start` to `goal`.
PATH_BFS = """
from collections import deque
D = {'U': (-1, 0), 'D': (1, 0), 'L': (0, -1), 'R': (0, 1)}
prev = {start: None}
q = deque([start])
while q:
    cell = q.popleft()
    if cell == goal:
        break
    for m, (dr, dc) in D.items():
        r, c = cell[0] + dr, cell[1] + dc
        if 0 <= r < len(grid) and 0 <= c < len(grid[0]) and grid[r][c] != '#' and (r, c) not in prev:
            prev[(r, c)] = (cell, m)
            q.append((r, c))
path = []
cell = goal
while prev[cell] is not None:
    cell, m = prev[cell]
    path.append(m)
print(' '.join(reversed(path)))
"""

SOKOBAN_BFS = """
from collections import deque
D = {'U': (-1, 0), 'D': (1, 0), 'L': (0, -1), 'R': (0, 1)}
walls = {(r, c) for r, row in enumerate(grid) for c, ch in enumerate(row) if ch == '#'}
goal_set = set(goals)
start = (tuple(player), frozenset(map(tuple, boxes)))
prev = {start: None}
q = deque([start])
while q:
    node = q.popleft()
    p, bx = node
    if bx <= goal_set:
        break
    for m, (dr, dc) in D.items():
        n = (p[0] + dr, p[1] + dc)
        if n in walls:
            continue
        nb = bx
        if n in bx:
            b2 = (n[0] + dr, n[1] + dc)
            if b2 in walls or b2 in bx:
                continue
            nb = (bx - {n}) | {b2}
        child = (n, nb)
        if child not in prev:
            prev[child] = (node, m)
            q.append(child)
moves = []
while prev[node] is not None:
    node, m = prev[node]
    moves.append(m)
print(''.join(reversed(moves)))
"""

SUDOKU_SOLVER = """
def ok(g, r, c, v):
    if v in g[r] or any(g[k][c] == v for k in range(n)):
        return False
    r0, c0 = r // box * box, c // box * box
    return all(g[r0 + i][c0 + j] != v for i in range(box) for j in range(box))

def solve(g):
    for r in range(n):
        for c in range(n):
            if g[r][c] == 0:
                for v in range(1, n + 1):
                    if ok(g, r, c, v):
                        g[r][c] = v
                        if solve(g):
                            return True
                        g[r][c] = 0
                return False
    return True

solve(grid)
for row in grid:
    print(''.join(map(str, row)))
"""


@pytest.fixture(scope="module")
def envs():
    return {
        "plan_path": PlanPath(PlanPathOptions(num_problems=24, min_size=4, max_size=10)),
        "sokoban": Sokoban(SokobanOptions(num_problems=16)),
        "sudoku4": Sudoku(SudokuOptions(size=4, num_problems=16)),
        "sudoku9": Sudoku(SudokuOptions(size=9, num_problems=4)),
    }


# --- generators ---------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda seed: PlanPath(PlanPathOptions(num_problems=6, min_size=4, max_size=10, seed=seed)),
    lambda seed: Sokoban(SokobanOptions(num_problems=6, seed=seed)),
    lambda seed: Sudoku(SudokuOptions(size=4, num_problems=6, seed=seed)),
    lambda seed: Sudoku(SudokuOptions(size=9, num_problems=2, seed=seed)),
])
def test_generators_are_reproducible_per_seed(make):
    def data(env):
        return [(p.id, p.data) for p in env.problems()]

    a, b, other = make(3), make(3), make(4)
    assert data(a) == data(b)
    assert [d for _, d in data(a)] != [d for _, d in data(other)]
    # problem i does not depend on how many problems there are
    env = make(3)
    first = type(env)(dataclasses.replace(env.opts, num_problems=1))
    assert data(first) == data(a)[:1]


def _bfs_len(grid, start, goal):
    """An independent BFS (not the module's) for the generator check."""
    dist, q = {start: 0}, deque([start])
    while q:
        r, c = q.popleft()
        for nr, nc in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
            if 0 <= nr < len(grid) and 0 <= nc < len(grid[0]) and grid[nr][nc] != "#" and (nr, nc) not in dist:
                dist[(nr, nc)] = dist[(r, c)] + 1
                q.append((nr, nc))
    return dist.get(goal)


def test_plan_path_grids_are_solvable_and_sized(envs):
    sizes = set()
    for p in envs["plan_path"].problems():
        grid, start, goal = p.data["grid"], p.data["start"], p.data["goal"]
        n = len(grid)
        sizes.add(n)
        assert 4 <= n <= 10 and all(len(row) == n for row in grid)
        assert grid[start[0]][start[1]] == "." and grid[goal[0]][goal[1]] == "."
        assert _bfs_len(grid, start, goal) == p.data["shortest"] >= max(2, n // 2)
        assert len(pp.shortest_path(grid, start, goal)) == p.data["shortest"]
    assert len(sizes) >= 3  # the size range is really used
    with pytest.raises(ValueError, match="min_size"):
        PlanPath(PlanPathOptions(min_size=8, max_size=5))


def test_sokoban_levels_are_solvable(envs):
    env = envs["sokoban"]
    counts = set()
    for p in env.problems():
        level, player, boxes = parse_level(p.data["rows"])
        counts.add(len(boxes))
        assert not boxes & level.goals  # nothing starts solved
        solution = solve(level, player, boxes)
        assert solution is not None and len(solution) == p.data["optimal"] >= env.opts.min_moves
        # the solution really solves the level under the environment's own rules
        state, reward = env.apply(env.reset(p), "planner", planner(solution))
        assert state.solved and env.team_reward(state) == 1.0 and env.done(state) and env.success(state)
        assert reward == pytest.approx(sk.STEP_COST * len(solution) + sk.BOX_ON_GOAL * len(boxes) + sk.WIN)
    assert counts == {1, 2}


def _valid_sudoku(grid: str, n: int) -> bool:
    b = int(n ** 0.5)
    rows = [grid[r * n:(r + 1) * n] for r in range(n)]
    cols = ["".join(row[c] for row in rows) for c in range(n)]
    boxes = ["".join(rows[r0 + i][c0 + j] for i in range(b) for j in range(b)) for r0 in range(0, n, b) for c0 in range(0, n, b)]
    want = sorted("".join(map(str, range(1, n + 1))))
    return all(sorted(unit) == want for unit in rows + cols + boxes)


def test_sudoku_puzzles_have_valid_unique_solutions(envs):
    for key, n in (("sudoku4", 4), ("sudoku9", 9)):
        for p in envs[key].problems():
            puzzle, solution = p.data["puzzle"], p.data["solution"]
            assert _valid_sudoku(solution, n)
            assert all(a in (".", b) for a, b in zip(puzzle, solution))
            assert puzzle.count(".") == round(0.5 * n * n)
            cells = [0 if ch == "." else int(ch) for ch in puzzle]
            assert count_solutions(cells, n) == (1, [int(ch) for ch in solution])
    # brute force (independent of the solver) on a few 4x4 puzzles: exactly one completion
    for p in envs["sudoku4"].problems()[:1]:
        puzzle = p.data["puzzle"]
        holes = [i for i, ch in enumerate(puzzle) if ch == "."]
        completions = 0
        for values in itertools.product("1234", repeat=len(holes)):
            grid = list(puzzle)
            for i, v in zip(holes, values):
                grid[i] = v
            completions += _valid_sudoku("".join(grid), 4)
        assert completions == 1


# --- state discipline ---------------------------------------------------------------------------


def _garbage(rng: random.Random) -> str:
    pieces = ["Moves: U R", "moves: left up", "r1c1=1", "r9c9=9 r0c1=3", "1234\n3412\n2143\n4321", "```python\n", "",
              "Moves:", "UUDDLRLR", "\x00\ud7ff", "print(1)", "Moves: X Y", "r1c2:4", "#@$.", "🙂" * 3]
    chars = "UDLRudlr rc=:0123456789#@$.*+\n`'\"[](),"
    if rng.random() < 0.5:
        return rng.choice(pieces) + "".join(rng.choice(chars) for _ in range(rng.randint(0, 40)))
    return "".join(rng.choice(chars) for _ in range(rng.randint(0, 80)))


@pytest.mark.parametrize("key", ["plan_path", "sokoban", "sudoku4", "sudoku9"])
def test_apply_never_mutates_and_clones_are_independent(envs, key):
    env = envs[key]
    rng = random.Random(7)
    tool_runs = 0
    for p in env.problems()[:4]:
        state = env.reset(p)
        while not env.done(state):
            for role in env.roles:
                snapshot = copy.deepcopy(state)
                twin = env.clone(state)
                assert twin == state and twin is not state
                # the sandbox costs ~40 ms a run: garbage tool answers on a few states only
                texts = [_garbage(rng) for _ in range(6 if role == "planner" else (2 if tool_runs < 6 else 0))]
                for text in texts:
                    tool_runs += role == "tool"
                    new, reward = env.apply(state, role, text)
                    assert state == snapshot and twin == snapshot
                    assert new is not state and isinstance(reward, float) and reward == reward
                    assert 0.0 <= env.team_reward(new) <= 1.0
                    assert new.turn == state.turn + (role == "planner")
                with pytest.raises(dataclasses.FrozenInstanceError):
                    twin.turn = 99  # states are frozen, so a clone cannot be changed behind a branch's back
                state, _ = env.apply(state, role, _garbage(rng) if role == "planner" else "")
                if env.done(state):
                    break
        assert state.turn <= env.max_turns
    with pytest.raises(ValueError, match="has roles"):
        env.apply(env.reset(env.problems()[0]), "critic", "x")
    with pytest.raises(ValueError, match="has roles"):
        env.observe(env.reset(env.problems()[0]), "critic")


# --- parsing ------------------------------------------------------------------------------------


def test_parse_moves():
    assert parse_moves("Moves: U R R D") == "URRD"
    assert parse_moves("**Moves:** `U, R`") == "UR"
    assert parse_moves("moves = up right Down") == "URD"
    assert parse_moves("Moves:\nURD\n") == "URD"
    assert parse_moves("Moves: U R (this reaches the goal)") == "UR"
    assert parse_moves("Moves: L\nOn second thought:\nMoves: R R") == "RR"  # the last line counts
    assert parse_moves("go right twice") is None and parse_moves("Moves: none") is None and parse_moves("Moves:") is None
    assert parse_moves("U R", label_required=False) == "UR"
    assert parse_moves("thinking...\n['U', 'R', 'D']\n", label_required=False) == "URD"
    assert parse_moves("path: ULL", label_required=False) == "ULL"
    assert parse_moves("no path found", label_required=False) is None
    assert len(parse_moves("Moves: " + "U" * 1000)) == tp.MAX_MOVES


def test_parse_fills():
    assert parse_fills("r1c2=3\nR4C4 = 1, r2c1:2", 4) == [(1, 2, 3), (4, 4, 1), (2, 1, 2)]
    assert parse_fills("1 2 | 3 4\n3 4 | 1 2\n----+----\n2 1 | 4 3\n4 3 | . 1", 4)[-1] == (4, 4, 1)
    assert len(parse_fills("[[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]".replace("], [", "]\n["), 4)) == 16
    assert parse_fills("I am not sure.", 4) is None and parse_fills("12\n34", 4) is None


# --- plan_path rewards --------------------------------------------------------------------------

GRID = ("....",
        "##..",
        "....")


def custom_plan_path(max_turns: int = 3) -> tuple[PlanPath, pp.PlanPathState]:
    env = PlanPath(PlanPathOptions(num_problems=1, max_turns=max_turns))
    problem = Problem("custom", {"grid": GRID, "start": (0, 0), "goal": (2, 0), "shortest": 6})
    return env, env.reset(problem)


def test_plan_path_rewards_at_the_boundaries():
    env, s0 = custom_plan_path()
    s, r = env.apply(s0, "planner", planner("D"))  # into a wall
    assert r == pytest.approx(pp.INVALID_MOVE) and s.pos == (0, 0) and s.path == ""
    s, r = env.apply(s0, "planner", planner("U"))  # off the grid
    assert r == pytest.approx(pp.INVALID_MOVE) and s.pos == (0, 0)
    s, r = env.apply(s0, "planner", planner("RDR"))  # R, then D hits a wall: the last R is dropped
    assert r == pytest.approx(pp.STEP_COST + pp.INVALID_MOVE) and s.pos == (0, 1) and "blocked" in s.history[-1]
    s, r = env.apply(s0, "planner", "I would go right.")
    assert r == pp.FORMAT_PENALTY and s.pos == (0, 0) and s.turn == 1

    s, r = env.apply(s0, "planner", planner("RRDDLL" + "RRR"))  # optimal; moves after the goal are ignored
    assert r == pytest.approx(6 * pp.STEP_COST + pp.GOAL + pp.OPTIMAL_BONUS)
    assert s.reached and s.optimal and len(s.path) == 6
    assert env.team_reward(s) == 1.0 and env.done(s) and env.success(s)

    s, r = env.apply(s0, "planner", planner("RRRDDLLL"))  # reaches the goal the long way
    assert r == pytest.approx(8 * pp.STEP_COST + pp.GOAL)
    assert env.team_reward(s) == pytest.approx(pp.GOAL / pp.TEAM_MAX) and env.success(s) and not s.optimal

    s, r1 = env.apply(s0, "planner", planner("RRD"))  # optimal across two turns still earns the bonus
    s, r2 = env.apply(s, "planner", planner("DLL"))
    assert r1 == pytest.approx(3 * pp.STEP_COST) and env.team_reward(s0) == 0.0
    assert r2 == pytest.approx(3 * pp.STEP_COST + pp.GOAL + pp.OPTIMAL_BONUS)


def test_done_at_goal_and_at_max_turns():
    env, s0 = custom_plan_path(max_turns=2)
    s, _ = env.apply(s0, "planner", planner("R"))
    assert not env.done(s) and s.turn == 1
    s, _ = env.apply(s, "planner", planner("R"))
    assert env.done(s) and not s.reached and env.team_reward(s) == 0.0
    again, r = env.apply(s, "planner", planner("DDLL"))  # a finished episode does not move
    assert r == 0.0 and again == s
    for env in (Sokoban(SokobanOptions(num_problems=1, max_turns=2)), Sudoku(SudokuOptions(num_problems=1, max_turns=2))):
        s = env.reset(env.problems()[0])
        for _ in range(2):
            assert not env.done(s)
            s, _ = env.apply(s, "tool", "")
            s, _ = env.apply(s, "planner", "nothing useful")
        assert env.done(s) and s.turn == 2


# --- sokoban rewards ----------------------------------------------------------------------------


def custom_sokoban(rows: tuple[str, ...], max_turns: int = 3) -> tuple[Sokoban, sk.SokobanState]:
    env = Sokoban(SokobanOptions(num_problems=1, max_turns=max_turns))
    return env, env.reset(Problem("custom", {"rows": rows, "optimal": None}))


def test_sokoban_rewards_at_the_boundaries():
    env, s0 = custom_sokoban(("######",
                              "#@$ .#",
                              "#    #",
                              "######"))
    s, r = env.apply(s0, "planner", planner("R"))
    assert r == pytest.approx(sk.STEP_COST) and s.boxes == {(1, 3)} and not env.done(s)
    s, r = env.apply(s0, "planner", planner("RRL"))  # the box reaches the goal: win, the L is ignored
    assert r == pytest.approx(2 * sk.STEP_COST + sk.BOX_ON_GOAL + sk.WIN) and s.moves == 2
    assert s.solved and env.team_reward(s) == 1.0 and env.done(s)
    s, r = env.apply(s0, "planner", planner("UR"))  # into the wall: nothing moves
    assert r == pytest.approx(sk.INVALID_MOVE) and s.player == (1, 1) and s.boxes == s0.boxes

    env, s0 = custom_sokoban(("#######",
                              "#@*  .#",
                              "#  $  #",
                              "#######"))
    assert env.team_reward(s0) == 0.5
    s, r = env.apply(s0, "planner", planner("R"))  # box off its goal
    assert r == pytest.approx(sk.STEP_COST + sk.BOX_OFF_GOAL) and env.team_reward(s) == 0.0
    s, r = env.apply(s0, "planner", planner("RRR"))  # off one goal, onto the other
    assert r == pytest.approx(3 * sk.STEP_COST + sk.BOX_OFF_GOAL + sk.BOX_ON_GOAL) and not s.solved

    env, s0 = custom_sokoban(("#####",
                              "#@$ #",
                              "#  .#",
                              "#####"))
    s, r = env.apply(s0, "planner", planner("RD"))  # the box goes into the corner: deadlock ends it
    assert r == pytest.approx(sk.STEP_COST + sk.FAIL) and s.deadlocked and env.done(s) and s.moves == 1
    assert env.team_reward(s) == 0.0

    env, s0 = custom_sokoban(("#####",
                              "#@$##",
                              "#  .#",
                              "#####"))
    s, r = env.apply(s0, "planner", planner("R"))  # a push into a wall
    assert r == pytest.approx(sk.INVALID_MOVE) and s.boxes == s0.boxes

    env, s0 = custom_sokoban(("######",
                              "#@$ .#",
                              "#    #",
                              "######"), max_turns=1)
    s, r = env.apply(s0, "planner", planner("D"))  # the last turn ends unsolved
    assert r == pytest.approx(sk.STEP_COST + sk.FAIL) and env.done(s)


# --- sudoku rewards -----------------------------------------------------------------------------

SOLUTION = "1234" "3412" "2143" "4321"
PUZZLE = "..34" "...." "2143" "4321"


def custom_sudoku() -> tuple[Sudoku, sd.SudokuState]:
    env = Sudoku(SudokuOptions(num_problems=1))
    return env, env.reset(Problem("custom", {"puzzle": PUZZLE, "solution": SOLUTION}))


def test_sudoku_rewards_at_the_boundaries():
    env, s0 = custom_sudoku()
    assert s0.holes == 6
    s, r = env.apply(s0, "planner", "r1c1=1")
    assert r == pytest.approx(1 / 6) and s.cells[0] == "1" and env.team_reward(s) == pytest.approx(1 / 6)
    s, r = env.apply(s0, "planner", "r1c1=3")  # 3 is already in row 1
    assert r == pytest.approx(sd.CONFLICT) and s.cells == PUZZLE
    s, r = env.apply(s0, "planner", "r1c3=1\nr1c4=4")  # changing a given; restating one is ignored
    assert r == pytest.approx(sd.GIVEN_OVERWRITE) and s.cells == PUZZLE
    s, r = env.apply(s0, "planner", "r5c1=1 r1c1=7")
    assert r == pytest.approx(2 * sd.INVALID_FILL)
    s, r = env.apply(s0, "planner", "r2c1=1")  # consistent but wrong (the solution has 3)
    assert r == pytest.approx(-1 / 6) and env.team_reward(s) == 0.0
    s, r = env.apply(s, "planner", "r2c1=3")  # overwriting its own wrong fill
    assert r == pytest.approx(2 / 6) and env.team_reward(s) == pytest.approx(1 / 6)
    s, r = env.apply(s0, "planner", "Here is the grid:\n1 2 | 3 4\n3 4 | 1 2\n2 1 | 4 3\n4 3 | 2 1")
    assert r == pytest.approx(1.0 + sd.SOLVED) and s.solved and env.team_reward(s) == 1.0 and env.done(s)
    s, r = env.apply(s0, "planner", "I cannot tell.")
    assert r == sd.FORMAT_PENALTY and s.cells == PUZZLE


# --- tool programs through the sandbox ----------------------------------------------------------


def test_tool_output_reaches_the_planner_and_a_correct_path_earns_full_reward():
    env, s0 = custom_plan_path()
    s, r = env.apply(s0, "tool", fenced("print('HELLO-TOOL', start, goal)"))
    assert r == tp.TOOL_RAN
    assert "HELLO-TOOL (0, 0) (2, 0)" in env.observe(s, "planner")[0]["content"]
    assert "HELLO-TOOL" not in env.observe(s, "tool")[0]["content"]

    s, r = env.apply(s0, "tool", fenced(PATH_BFS))
    assert r == tp.TOOL_SOLVED and s.tool_output == "R R D D L L"
    seen = env.observe(s, "planner")[0]["content"]
    assert "R R D D L L" in seen and "Moves:" in seen
    s, r = env.apply(s, "planner", planner(parse_moves(s.tool_output, label_required=False)))
    assert s.optimal and env.team_reward(s) == 1.0 and s.tool_output == ""
    # the next observation tells what the planner did
    env2, t0 = custom_plan_path()
    t, _ = env2.apply(t0, "planner", planner("RR"))
    assert "Last turn: the planner sent `R R`" in env2.observe(t, "tool")[0]["content"]


@pytest.mark.parametrize("code,status", [
    ("raise RuntimeError('boom')", "failed (error)"),
    ("while True:\n    pass", "failed (timeout)"),
    ("import sys\nsys.exit(0)", "failed"),
    ("x = 1", "printed nothing"),
    ("x = (", "failed (error)"),
    ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)", "failed"),
    ("x = ' ' * 2 ** 32", "failed"),
    ("print('D')", ""),  # runs, but the path goes into a wall
])
def test_hostile_or_failing_tool_programs_score_low_without_raising(code, status):
    env = PlanPath(PlanPathOptions(num_problems=1, wall_seconds=1.0))
    _, s0 = custom_plan_path()
    s, r = env.apply(s0, "tool", fenced(code))
    if code == "print('D')":
        assert r == tp.TOOL_RAN
    else:
        assert r == tp.TOOL_FAILED
    assert status in s.tool_output and s.turn == 0 and s.pos == s0.pos
    assert env.apply(s0, "tool", "")[1] == tp.TOOL_FAILED


def test_sokoban_tool_solves_and_improves():
    env, s0 = custom_sokoban(("######",
                              "#@$.##",
                              "#    #",
                              "# $. #",
                              "######"))
    s, r = env.apply(s0, "tool", fenced(SOKOBAN_BFS))
    assert r == sk.TOOL_SOLVED
    moves = parse_moves(s.tool_output, label_required=False)
    assert len(moves) == len(solve(s0.level, s0.player, s0.boxes))  # the program's BFS is optimal too
    _, r = env.apply(s0, "tool", fenced("print('R')"))  # one box onto its goal, not solved
    assert r == sk.TOOL_IMPROVED
    _, r = env.apply(s0, "tool", fenced("print('U')"))
    assert r == sk.TOOL_RAN


def test_sudoku_tool_solver_and_planner_copy():
    env = Sudoku(SudokuOptions(size=9, num_problems=1))
    s0 = env.reset(env.problems()[0])
    s, r = env.apply(s0, "tool", fenced(SUDOKU_SOLVER))
    assert r == sd.TOOL_SOLVED
    s, r = env.apply(s, "planner", f"Copying the tool:\n{s.tool_output}")
    assert s.solved and s.cells == s0.solution and r == pytest.approx(1.0 + sd.SOLVED)


# --- boxoban files and options ------------------------------------------------------------------


def test_boxoban_parsing_from_a_small_file(tmp_path):
    f = tmp_path / "levels.txt"
    f.write_text("; 0\n#####\n#+$ #\n#  *#\n#. $#\n#####\n\n; 1\n####\n#@$.#\n####\n", encoding="utf-8")
    levels = load_boxoban(f)
    assert [lid for lid, _ in levels] == ["levels/0", "levels/1"]
    level, player, boxes = parse_level(levels[0][1])
    assert player == (1, 1) and player in level.goals and (2, 3) in boxes & level.goals and len(level.goals) == 3
    assert render_level(level, player, boxes) == levels[0][1]
    assert load_boxoban(f, limit=1) == levels[:1]
    (tmp_path / "bad.txt").write_text("; 7\n####\n#@$X#\n####\n", encoding="utf-8")
    with pytest.raises(ValueError, match="bad.txt, level 7: character 'X'"):
        load_boxoban(tmp_path / "bad.txt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_boxoban(tmp_path / "missing")
    with pytest.raises(ValueError, match="task.path"):
        Sokoban(SokobanOptions(source="boxoban"))


@pytest.mark.skipif(not BOXOBAN.is_dir(), reason=f"Boxoban levels not found at {BOXOBAN}")
def test_boxoban_files_load_as_problems():
    levels = load_boxoban(BOXOBAN / "unfiltered" / "test", limit=20)
    assert len(levels) == 20 and levels[0][0] == "000/0"
    for _, rows in levels:
        level, player, boxes = parse_level(rows)
        assert (level.height, level.width) == (10, 10) and len(boxes) == 4 == len(level.goals)
        assert render_level(level, player, boxes) == rows
    env = Sokoban(SokobanOptions(source="boxoban", path=str(BOXOBAN), num_problems=3))
    assert [p.id for p in env.problems()] == ["boxoban/hard/000/0", "boxoban/hard/000/1", "boxoban/hard/000/2"]
    s = env.reset(env.problems()[0])
    assert "\n".join(env.problems()[0].data["rows"]) in env.observe(s, "planner")[0]["content"]
    out = play(s.level, s.player, s.boxes, "UUUU")
    assert out.executed <= 4


def test_options_are_validated_like_the_config():
    with pytest.raises(ConfigError, match="task.size"):
        build_dataclass(SudokuOptions, {"size": 5}, "task.")
    with pytest.raises(ConfigError, match="task.source"):
        build_dataclass(SokobanOptions, {"source": "web"}, "task.")
    with pytest.raises(ConfigError, match="task.wall_density"):
        build_dataclass(PlanPathOptions, {"wall_density": 0.9}, "task.")
    opts = build_dataclass(PlanPathOptions, {"max_turns": 2, "max_size": 5}, "task.")
    assert PlanPath(opts).max_turns == 2


# --- format validity (teamrl eval's valid replies) ----------------------------------------------


@pytest.mark.parametrize("spec, planner_reply", [
    ({"name": "plan_path", "num_problems": 1}, "Going right first.\nMoves: R R D"),
    ({"name": "sokoban", "num_problems": 1}, "**Moves:** U U L"),  # well-formed, whether or not the moves are good
    ({"name": "sudoku", "size": 4, "num_problems": 1}, "r1c1=4\nr5c2=1"),  # an out-of-range fill is still a fill
    ({"name": "sudoku", "size": 4, "num_problems": 1}, "1234\n3412\n2143\n4321"),  # a whole grid
], ids=["plan_path", "sokoban", "sudoku-fills", "sudoku-grid"])
def test_valid_replies_of_either_role(spec, planner_reply):
    from teamrl.tasks import make_task
    from teamrl.tasks.task import reply_valid

    env = make_task(spec)
    p = env.problems()[0]
    assert reply_valid(env, p, planner_reply) is True
    assert reply_valid(env, p, fenced("print('U R')")) is True  # the tool's program
    assert reply_valid(env, p, "I would go around the wall, then up to the goal.") is False
    assert reply_valid(env, p, "print('U R')") is False  # a program without its ```python fence
    assert all(env.valid(p, text) for _, _, text in env.demonstrations(p))


def test_a_program_is_no_valid_reply_without_a_tool_agent():
    from teamrl.tasks import make_task

    env = make_task({"name": "plan_path", "num_problems": 1, "agents": "planner"})
    p = env.problems()[0]
    assert not env.valid(p, fenced("print('U R')")) and env.valid(p, "Moves: U R")
