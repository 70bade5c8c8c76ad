"""The learning benchmark (``make learn`` = ``teamrl bench --learning``): does each algorithm learn, on
held-out problems, against its baselines at an equal sample budget?

For each algorithm on its paper's task at CPU scale, every arm runs with the same steps, problems
per step and group size (so the same number of sampled episodes; an arm that names a larger budget
in its label is the exception, and the page says so), on ``--seeds`` seeds, and is scored greedily on
held-out problems (``task.split=test``, or a fresh generator seed):

- MAGRPO on writing.tldr (the demo task, 10 steps of 2 papers x 4 samples per agent) and on
  code.helper_main (HumanEval, its last 48 problems held out): untrained team, the prompt baselines
  ``sequential`` and ``discussion`` (the untrained model through those workflows, eval only), MAGRPO,
  and MAGRPO at 20 steps of 4 problems (writing also at 10 steps of 4);
- AT-GRPO on Plan-Path: untrained, warm start only, single-agent GRPO (planner alone), AT-GRPO
  with trajectory grouping (the paper's ablation) and with tree grouping, both after the warm start, and
  tree grouping with one LoRA adapter per role (its own warm start), also scored with the roles' adapters
  swapped (the paper's specialisation check: a row of its own, no second training);
- M-GRPO on the research environment: untrained, warm start only, single agent, frozen sub-agent,
  main + sub (the RL arms after the warm start);
- the workflow study on easy arithmetic, Eval-Opt and Voting: untrained, SA-RL (the ``single``
  workflow), SP (one shared policy) and IP (one LoRA adapter per role).

Writes ``--out`` (default bench/LEARNING.md): one table per comparison (held-out score, mean and
spread over seeds; success/accuracy; valid replies; the paired difference against the untrained
team per seed; the learning signal; wall time; sampled episodes and trained tokens), one PNG of
training curves per comparison beside it, and ``learning_results.json`` beside it (the same figures,
machine-readable). ``--quick``: the tiny random model, one seed, one step, two held-out problems: a
smoke run of the whole grid (seconds), written under runs/learn_quick/, never into the committed cache.

**Evaluated once.** An eval-only arm whose result cannot depend on the seed (``Arm.seed_free``: base
weights, greedy, held-out problems that no seed picks, as MAGRPO's aclsum test split) runs once and
its result stands for every seed (one cell, ``<arm>-every-seed.json``), paired with each seed's runs.

The runs go seed by seed (seed 0's arms, then seed 1's, ...; the untrained team first), and eval-only
arms that are evaluated once after every seed's runs, so a grid stopped part-way still has pairs.

**Resumable.** Each finished (comparison, arm, seed) run is cached as a small JSON file under
``--cells`` (default bench/learning_cells/<comparison>/<arm>-seed<N>.json, committed with the
repository), keyed by a fingerprint of everything that decides its result (settings, level, warm
start, held-out count). A run reuses every cell whose fingerprint matches and runs only what is
missing, so the grid can be stopped and resumed across sessions; ``--render-only`` rewrites the page
and the JSON from the cache alone.

**Calibration** (``--calibrate``): each task's difficulty levels (``Comparison.levels``) are scored
with the embedded model, after the warm start where the comparison has one: greedy success and valid
replies on held-out problems, and at the training temperature with the comparison's group size the
success and the share of groups whose rewards vary (the real target: only those groups teach; measured
by ``teamrl calibrate``'s own code, ``teamrl.trainer.calibrate.measure``: G episodes per problem). The
level whose sampled success is within 15-50% with the most varied groups is picked; the grid then
runs at the picked level. Results go to bench/calibration.json (cached per level, resumable) and a
table into docs/learning.md.

``--jobs N`` (default 2) runs N (arm, seed) runs at once, each in its own process at one torch
thread. Measured here (2 cores, MAGRPO writing): a step took ~105 s in each of two 1-thread
processes side by side and ~75 s in one 2-thread process alone, so two at a time get ~1.4x more
done; a held-out evaluation gains nothing either way (~110 s each side by side, ~55-65 s alone).
Runs start in grid order (seed by seed), except that a run whose warm start another run is building
gives way to one that can build its own (another seed's): two warm starts are built side by side.

Usage: python bench/learning.py [--quick] [--seeds 3] [--jobs 2] [--only magrpo,at_grpo,...] [--out bench/LEARNING.md]
                                [--cells DIR] [--render-only] [--calibrate [--calibrate-problems N]]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The parts, one concept a module beside this file: learning_grid (the comparisons, arms, levels and settings),
# learning_runner (one run, the shared warm starts), learning_cache (the finished runs' cells), learning_stats
# (paired differences, cliffs, dynamics), learning_render (the page, the plots, the JSON) and learning_calibration.
# Their names stay importable from here (tests load this file by path).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import learning_calibration  # noqa: E402
from learning_cache import cell_fingerprint, cell_path, for_seeds, read_cell, write_cell  # noqa: E402
from learning_calibration import (  # noqa: E402
    BAND,
    CALIBRATE_PROBLEMS,
    MARK_END,
    MARK_START,
    calibrate,
    calibration_markdown,
    pick_level,
    write_calibration_doc,
)
from learning_grid import (  # noqa: E402
    CALIBRATION,
    CALIBRATION_DOC,
    CELLS,
    CLIFF_POINTS,
    DYNAMICS_WINDOW,
    EVAL_PROBLEMS,
    PER_SEED,
    QUICK,
    QUICK_OUT,
    REPO,
    SEEDS,
    STUDY_SIZES,
    WARM_LR,
    WARM_PROBLEMS_QUICK,
    Arm,
    ArmResult,
    Comparison,
    Level,
    _config,
    _overrides,
    comparisons,
    merge,
)
from learning_render import plot, render, render_study_dynamics, results_json  # noqa: E402
from learning_runner import next_run, run_arm, run_arm_in_process, shared_warm_start, warm_start_dir  # noqa: E402
from learning_stats import (  # noqa: E402
    ALSO_LABELS,
    also_rows,
    held_out_cliffs,
    paired_vs_untrained,
    paired_vs_warm_start,
    study_dynamics,
    warm_start_alone,
)

# The names this file offers: its parts' (the tests reach them through here) and main.
__all__ = [
    "learning_calibration", "cell_fingerprint", "cell_path", "for_seeds", "read_cell", "write_cell", "BAND",
    "CALIBRATE_PROBLEMS", "MARK_END", "MARK_START", "calibrate", "calibration_markdown", "pick_level",
    "write_calibration_doc", "CALIBRATION", "CALIBRATION_DOC", "CELLS", "CLIFF_POINTS", "DYNAMICS_WINDOW",
    "EVAL_PROBLEMS", "PER_SEED", "QUICK", "QUICK_OUT", "REPO", "SEEDS", "STUDY_SIZES", "WARM_LR",
    "WARM_PROBLEMS_QUICK", "Arm", "ArmResult", "Comparison", "Level", "_config", "_overrides", "comparisons",
    "merge", "plot", "render", "render_study_dynamics", "results_json", "next_run", "run_arm", "run_arm_in_process",
    "shared_warm_start", "warm_start_dir", "ALSO_LABELS", "also_rows", "held_out_cliffs", "paired_vs_untrained",
    "paired_vs_warm_start", "study_dynamics", "warm_start_alone", "main"
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny random model, 1 seed, 1 step, 2 held-out problems")
    ap.add_argument("--seeds", type=int, default=None, help=f"seeds per arm (default {SEEDS}; --quick: 1)")
    ap.add_argument("--eval", type=int, default=None, help=f"held-out problems per arm (default {EVAL_PROBLEMS}; --quick: 2)")
    ap.add_argument("--only", default="", help="comma-separated comparison keys (magrpo, magrpo_code, at_grpo, m_grpo, study_eval_opt, "
                                               "study_voting); default all")
    ap.add_argument("--arms", default="", help="comma-separated arm indices (from 0, in the grid's order) to run now; the "
                    "other arms' cells are still read; default every arm")
    ap.add_argument("--out", default=None, help="Markdown file to write (PNGs and learning_results.json beside it; default "
                                                "bench/LEARNING.md, --quick: runs/learn_quick/LEARNING.md)")
    ap.add_argument("--cells", default=None, help="cache of finished runs (default bench/learning_cells; --quick: a temporary folder)")
    ap.add_argument("--render-only", action="store_true", help="run nothing: rewrite the page and the JSON from the cache "
                                                               "(with --calibrate: the calibration table from its file)")
    ap.add_argument("--jobs", type=int, default=None, help="(arm, seed) runs at once, one process and one torch thread "
                                                           "each (default 2; --quick: 1, in this process)")
    ap.add_argument("--calibrate", action="store_true", help="measure each task's difficulty levels and pick one (see above)")
    ap.add_argument("--calibrate-problems", type=int, default=None,
                    help=f"problems per level (default {CALIBRATE_PROBLEMS}; --quick: 2)")
    ap.add_argument("--calibration", default=None, help="calibration file (default bench/calibration.json; --quick: temporary)")
    ap.add_argument("--calibration-doc", default=None, help="Markdown file the calibration table goes into (default "
                                                            "docs/learning.md; --quick: none)")
    ap.add_argument("--recalibrate", action="store_true", help="with --calibrate: measure levels already in the file again")
    ap.add_argument("--run-cell", nargs=3, metavar=("KEY", "ARM", "SEED"), help=argparse.SUPPRESS)  # one run, in a child
    ap.add_argument("--level", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--one-thread", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cell", help=argparse.SUPPRESS)  # a child: where to cache its finished run ...
    ap.add_argument("--fingerprint", default="", help=argparse.SUPPRESS)  # ... under this fingerprint
    args = ap.parse_args(argv)
    if args.run_cell:  # a child of --jobs: one (arm, seed) run; its result as the last line of stdout
        key, index, seed = args.run_cell[0], int(args.run_cell[1]), int(args.run_cell[2])
        comp = next(c for c in comparisons() if c.key == key)
        level = next((lv for lv in comp.levels if lv.label == args.level), None)
        one = ArmResult(comp.arms[index].label)
        run_arm(comp, index, seed, Path(args.workdir), args.eval, args.quick, one, args.one_thread, level)
        if args.cell:  # the finished run is kept even if the grid that started it cannot take it
            write_cell(Path(args.cell), args.fingerprint, comp, level, one)
        print(json.dumps(dataclasses.asdict(one)), flush=True)
        return 0
    jobs = args.jobs if args.jobs is not None else (1 if args.quick else 2)
    if jobs < 1:
        print(f"bench --learning: --jobs {jobs} must be >= 1", file=sys.stderr)
        return 2
    for flag in ("seeds", "eval", "calibrate_problems"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            print(f"bench --learning: --{flag.replace('_', '-')} {value} must be >= 1", file=sys.stderr)
            return 2
    seeds = list(range(args.seeds or (1 if args.quick else SEEDS)))

    def eval_problems(comp: Comparison) -> int:
        return args.eval or (2 if args.quick else comp.eval_problems)
    grid = comparisons()
    if args.only:
        keys = args.only.split(",")
        unknown = [k for k in keys if k not in {c.key for c in grid}]
        if unknown:
            print(f"bench --learning: --only {unknown[0]!r} is not a comparison; choose from {[c.key for c in grid]}", file=sys.stderr)
            return 2
        grid = [c for c in grid if c.key in keys]
    try:
        arms = {int(a) for a in args.arms.split(",")} if args.arms else None
    except ValueError:
        print(f"bench --learning: --arms {args.arms!r} must be comma-separated arm indices, e.g. 1,4", file=sys.stderr)
        return 2
    bad = [a for a in sorted(arms or ()) if not all(0 <= a < len(c.arms) for c in grid)]
    if bad:
        print(f"bench --learning: --arms {bad[0]} is not an arm of every comparison run; arms are 0.."
              f"{min(len(c.arms) for c in grid) - 1}", file=sys.stderr)
        return 2
    args.arms = arms
    with tempfile.TemporaryDirectory() as d:
        calibration_file = Path(args.calibration) if args.calibration else (Path(d) / "calibration.json" if args.quick
                                                                            else CALIBRATION)
        if args.calibrate:
            doc = Path(args.calibration_doc) if args.calibration_doc else (None if args.quick else CALIBRATION_DOC)
            calibrate(grid, args.quick, calibration_file, doc, args.calibrate_problems or (2 if args.quick else CALIBRATE_PROBLEMS),
                      Path(d), redo=args.recalibrate, measure=not args.render_only)
            return 0
        try:
            calibration = json.loads(calibration_file.read_text()) if calibration_file.is_file() else {}
        except ValueError as e:
            print(f"bench --learning: {calibration_file} is not JSON ({e}); delete it or run --calibrate again", file=sys.stderr)
            return 2
        return _grid(args, grid, seeds, eval_problems, calibration, jobs, Path(d))


def _grid(args, grid: list[Comparison], seeds: list[int], eval_problems, calibration: dict, jobs: int, d: Path) -> int:
    """Run the (comparison, arm, seed) runs missing from the cache, then write the page and the JSON."""
    out = Path(args.out) if args.out else (QUICK_OUT if args.quick else REPO / "bench" / "LEARNING.md")
    cells = Path(args.cells) if args.cells else (d / "cells" if args.quick else CELLS)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    mode = "--quick smoke run (tiny random model: the numbers say nothing about learning)" if args.quick else "full run"
    lock = threading.Lock()
    levels = {c.key: c.level(calibration) for c in grid}
    results = {c.key: [ArmResult(a.label) for a in c.arms] for c in grid}
    runs, cached, total = [], 0, 0  # total: every (arm, seed) run of the grid, cached, to run or left out by --arms
    for c in grid:
        order = []  # seed by seed (a stopped grid still pairs); arms evaluated once: the untrained team first, others last
        for i, arm in enumerate(c.arms):
            for k, s in enumerate(seeds[:1] if arm.seed_free else seeds):
                order.append(((len(seeds) if arm.seed_free and i else k), i, s))
        total += len(order)
        for _, i, s in sorted(order):
            fp = cell_fingerprint(c, i, eval_problems(c), args.quick, levels[c.key])
            one = read_cell(cell_path(cells, c, i, s), fp)
            if one is not None:
                for each in (for_seeds(one, seeds) if c.arms[i].seed_free else [one]):
                    merge(results[c.key][i], each)
                cached += 1
            elif args.arms is None or i in args.arms:
                runs.append((c, i, s, fp))
    finished = [cached]  # runs (cells) finished: an arm evaluated once is one run however many seeds it fills
    if args.render_only:
        runs = []

    def publish() -> str:
        """Write the page and the JSON from the runs finished so far (after every run: a run that is stopped
        still leaves what it measured); returns the page."""
        sections = []
        for comp in grid:  # seeds finish in any order: the table gives mean and range, the plot the mean
            if not any(r.scores for r in results[comp.key]):  # no arm is dropped: a section not run yet says so
                level = levels[comp.key]
                sections.append(f"### {comp.title}\n\nNot run yet at the current settings"
                                f"{f' (level: {level.label})' if level else ''}: no cell under {cells.name}/{comp.key}/. "
                                f"Arms: {'; '.join(a.label for a in comp.arms)}. `make learn ARGS=--only={comp.key}` runs them.\n")
                continue
            png = out.with_name(f"{out.stem}_{comp.key}.png")
            sections.append(render(comp, results[comp.key], seeds, eval_problems(comp),
                                   png.name if plot(comp, results[comp.key], png) else None, levels[comp.key]))
        state = "" if finished[0] == total else f"; partial: {finished[0]} of {total} runs finished so far"
        page = (f"# Learning benchmark\n\nWritten by `bench/learning.py` ({mode}); wall time "
                f"{time.perf_counter() - t0:.0f} s{state}; {cached} runs read from the cache ({cells.name}/).\n\n"
                "Paired difference: the arm's held-out normalised return minus the untrained team's, problem by problem, "
                "on the same seed, +/- its standard error; `*`: beyond 2 standard errors. Learning signal: the share of the "
                "arm's training groups whose advantages were not all 0 (only those teach).\n\n" + "\n".join(sections))
        out.write_text(page)
        summary = results_json(grid, results, levels, {c.key: eval_problems(c) for c in grid}, mode)
        out.with_name("learning_results.json").write_text(json.dumps(summary, indent=1) + "\n")
        return page

    def one_run(run: tuple[Comparison, int, int, str]) -> None:
        comp, index, seed, fp = run
        level = levels[comp.key]
        if jobs == 1:
            one = ArmResult(comp.arms[index].label)
            run_arm(comp, index, seed, d, eval_problems(comp), args.quick, one, level=level)
        else:  # the child caches its run itself
            one = run_arm_in_process(comp, index, seed, d, eval_problems(comp), args.quick, one_thread=True, level=level,
                                     cell=cell_path(cells, comp, index, seed), fingerprint=fp)
        with lock:
            if jobs == 1:
                write_cell(cell_path(cells, comp, index, seed), fp, comp, level, one)
            for each in (for_seeds(one, seeds) if comp.arms[index].seed_free else [one]):
                merge(results[comp.key][index], each)
            finished[0] += 1
            publish()
        print(f"[learn] {time.perf_counter() - t0:.0f} s: {comp.key} / {one.label} / seed {seed}: held-out "
              f"{one.scores[0]:.3f}, {one.wall[0]:.0f} s", file=sys.stderr, flush=True)

    pending, going = list(runs), []  # the runs not started yet, the runs going (their warm starts are being built)

    def warm_of(run: tuple[Comparison, int, int, str]) -> Path | None:
        comp, index, seed, _ = run
        return warm_start_dir(comp, seed, d, levels[comp.key], comp.arms[index]) if comp.arms[index].warm_start else None

    def worker() -> None:  # runs in grid order, but a run that would wait on a warm start being built gives way
        while True:
            with lock:
                if not pending:
                    return
                run = pending.pop(next_run([warm_of(r) for r in pending], {warm_of(r) for r in going} - {None}))
                going.append(run)
            try:
                one_run(run)
            finally:
                with lock:
                    going.remove(run)

    with ThreadPoolExecutor(jobs) as pool:
        for future in [pool.submit(worker) for _ in range(jobs)]:
            future.result()  # re-raise the first failure (the other worker goes on with the pending runs)
    print(publish())
    return 0


if __name__ == "__main__":
    sys.exit(main())
