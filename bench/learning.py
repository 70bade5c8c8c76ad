"""The learning benchmark (``make learn`` = ``teamrl bench --learning``): does each algorithm learn, on
held-out problems, against its baselines at an equal sample budget?

For each algorithm on its paper's task at CPU scale, every arm runs with the same steps, problems
per step and group size (so the same number of sampled episodes), on ``--seeds`` seeds, and is
scored greedily on held-out problems (``task.split=test``, or a fresh generator seed):

- MAGRPO on writing.tldr (the demo): untrained team vs MAGRPO;
- AT-GRPO on Plan-Path: untrained, warm start only, single-agent GRPO (planner alone), AT-GRPO
  with trajectory grouping (the paper's ablation) and with tree grouping, both after the warm start;
- M-GRPO on the research environment: untrained, warm start only, single agent, frozen sub-agent,
  main + sub (the RL arms after the warm start);
- the workflow study on easy arithmetic, Eval-Opt and Voting: untrained, SA-RL (the ``single``
  workflow), SP (one shared policy) and IP (one LoRA adapter per role).

Writes ``--out`` (default bench/LEARNING.md): one table per comparison (held-out score, mean and
spread over seeds; success/accuracy; valid replies; wall time; sampled episodes and trained
tokens) and one PNG of training curves per comparison beside it. ``--quick``: the tiny random
model, one seed, one step, two held-out problems: a smoke run of the whole grid (seconds).

``--jobs N`` (default 2) runs N (arm, seed) runs at once, each in its own process at one torch
thread. Measured here (2 cores, MAGRPO writing): a step took ~105 s in each of two 1-thread
processes side by side and ~75 s in one 2-thread process alone, so two at a time get ~1.4x more
done; a held-out evaluation gains nothing either way (~110 s each side by side, ~55-65 s alone).

Usage: python bench/learning.py [--quick] [--seeds 2] [--jobs 2] [--only magrpo,at_grpo,m_grpo,study] [--out bench/LEARNING.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import statistics
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Arm:
    """One row of a comparison: its overrides, whether it is warm-started and whether RL trains it."""

    label: str
    overrides: tuple[str, ...] = ()
    warm_start: bool = False
    rl: bool = True


@dataclass(frozen=True)
class Comparison:
    key: str
    title: str
    common: tuple[str, ...]  # the full-scale settings shared by every arm (the sample budget)
    arms: tuple[Arm, ...]
    quick: tuple[str, ...] = ()  # --quick: the task's own smaller settings
    config: str | None = None  # a shipped config (relative to the repository) the settings start from
    eval_problems: int = 6  # held-out problems each arm is scored on (--eval overrides)
    warm_roles: tuple[str, ...] = ()  # the roles whose demonstrations the warm start uses (() = all)
    warm_problems: int = 4  # the warm start: the task's demonstrations of its first N training problems ...
    warm_epochs: int = 2  # ... this many passes
    flag_cliffs: bool = False  # the page flags arms whose held-out accuracy fell under the untrained team's


@dataclass
class ArmResult:
    label: str
    seeds: list[int] = field(default_factory=list)  # the seeds run, in the order of the lists below
    scores: list[float] = field(default_factory=list)  # held-out normalised return, one per seed
    success: list[float] = field(default_factory=list)
    valid: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    episodes: int = 0
    tokens: list[float] = field(default_factory=list)
    curves: list[list[float]] = field(default_factory=list)  # training reward per step, one list per seed


def comparisons() -> list[Comparison]:
    """The grid at CPU scale (the embedded SmolLM2-135M).

    Sized so that the whole grid, 2 seeds, runs in about an hour on 2 cores (two runs at a time). At
    one thread beside another run, a MAGRPO writing step took ~105 s, an AT-GRPO Plan-Path step
    (2 turns, 96 tokens, K=4) ~300 s, one SFT step of 8 Plan-Path demonstrations ~150 s and a
    held-out evaluation of 12 papers ~110 s, so each comparison gets only a few steps of small
    groups: the tables say how far that moves each arm, not what more steps would do.
    """
    lr = "train.lr=0.0005"
    return [
        Comparison("magrpo", "MAGRPO, writing.tldr (the demo task and settings): two LoRA agents, held-out papers (aclsum test split)",
                   ("rollout.group_size=4", "rollout.batch_size=2", "rollout.max_new_tokens=64", "train.steps=5", lr),
                   (Arm("untrained team", rl=False), Arm("MAGRPO")),
                   config="configs/magrpo_writing_tldr.yaml", eval_problems=12),
        Comparison("at_grpo", "AT-GRPO, Plan-Path 4x4, 1 turn (tool + planner, one shared policy), held-out grids of a fresh seed",
                   ("algorithm=at_grpo", "task.name=plan_path", "task.min_size=4", "task.max_size=4", "task.max_turns=1",
                    "task.num_problems=32", "policy.mode=shared", "rollout.group_size=2", "rollout.batch_size=2",
                    "rollout.max_new_tokens=48", "train.steps=2", lr),
                   (Arm("untrained team", rl=False), Arm("warm start only", warm_start=True, rl=False),
                    Arm("single-agent GRPO (planner alone), warm start", ("task.agents=planner", "at_grpo.grouping=trajectory"),
                        warm_start=True),
                    Arm("AT-GRPO, trajectory grouping, warm start", ("at_grpo.grouping=trajectory",), warm_start=True),
                    Arm("AT-GRPO, tree grouping, warm start", ("at_grpo.grouping=tree",), warm_start=True)),
                   quick=("task.num_problems=8",),
                   # the tool's demonstration is a ~230-token BFS program, past what the tool may write here
                   warm_roles=("planner",), warm_problems=8),
        Comparison("m_grpo", "M-GRPO, research environment (main + tool-using sub-agent), held-out questions of a fresh seed",
                   ("algorithm=m_grpo", "task.name=research", "task.num_problems=32", "policy.mode=lora_per_role",
                    "rollout.group_size=2", "rollout.batch_size=2", "rollout.max_new_tokens=48", "train.steps=2", lr),
                   (Arm("untrained team", rl=False), Arm("warm start only", warm_start=True, rl=False),
                    # the task's demonstrations are of the team protocol (main + sub), so the single agent has none
                    Arm("single agent (no warm start: no single-agent demonstrations)", ("m_grpo.agents=single",)),
                    Arm("main + frozen sub-agent, warm start", ("m_grpo.sub_agent=frozen",), warm_start=True),
                    Arm("M-GRPO main + sub, warm start", (), warm_start=True)),
                   quick=("task.num_problems=12",),
                   warm_problems=2, warm_epochs=1),  # ~8 demonstrations (main and sub turns) per question
        *[Comparison(f"study_{wf}", f"Workflow study, {wf} on easy arithmetic, held-out problems (task.split=test)",
                     ("algorithm=grpo", "task.name=math.solve", "task.source=generated_easy", "task.num_problems=80",
                      "task.test_size=16", f"workflow.name={wf}", "rollout.group_size=4", "rollout.batch_size=2",
                      *STUDY_SIZES[wf], lr),
                     (Arm("untrained team", rl=False), Arm("SA-RL (single workflow)", ("workflow.name=single", "workflow.options={}")),
                      Arm("SP (shared policy)", ("policy.mode=shared",)), Arm("IP (LoRA per role)", ("policy.mode=lora_per_role",))),
                     quick=("task.num_problems=12", "task.test_size=3"), flag_cliffs=True)
          for wf in ("eval_opt", "voting")],
    ]


# The warm start (Comparison.warm_problems, warm_epochs). SmolLM2-135M at one thread: 16 Plan-Path
# demonstrations x 2 passes (4 steps of 8) took about 10 minutes, so it is kept small and done once per
# comparison and seed (shared_warm_start).
WARM_PROBLEMS_QUICK = 2
WARM_LR = 2e-3  # a LoRA adapter takes a higher rate than RL's; the few warm-start steps must teach the format

# The study's sizes per workflow. Measured at one thread beside another run, an Eval-Opt SP step of 3
# attempts took ~6.5 min (rollout ~155 s, update ~205-235 s) and a whole SP run ~19 min, so each study
# arm gets one step, Eval-Opt 2 attempts. One step leaves no room for an evaluation during training to
# find a fall from a peak, so the page compares each arm's held-out accuracy with the untrained team's
# (CLIFF_POINTS, the trainer's default train.cliff_points).
STUDY_SIZES = {
    "eval_opt": ("rollout.max_new_tokens=64", "train.steps=1", "train.eval_every=0", "workflow.options.max_iterations=2"),
    "voting": ("rollout.max_new_tokens=32", "train.steps=1", "train.eval_every=0"),
}
CLIFF_POINTS = 10.0

# --quick: every comparison on the tiny random model, one step of the smallest budget
QUICK = ("model=tiny-random", "threads=1", "rollout.max_new_tokens=4", "rollout.group_size=2", "rollout.batch_size=1",
         "train.steps=1", "policy.lora.r=4")


def _overrides(comp: Comparison, arm: Arm, quick: bool, one_thread: bool = False) -> list[str]:
    extra = [*QUICK, *comp.quick] if quick else []
    threads = ["threads=1"] if one_thread else []
    return [*comp.common, *arm.overrides, *extra, *threads, "run.progress=false", "run.tensorboard=false",
            "run.log_episodes=false"]


def _config(comp: Comparison, arm: Arm, quick: bool, one_thread: bool, seed: int, workdir: Path, name: str,
            *extra: str):
    """The run's config: the comparison's shipped config (if any) with its, the arm's and the run's settings."""
    from teamrl.core.config import load_config

    return load_config(comp.config and REPO / comp.config, [*_overrides(comp, arm, quick, one_thread), f"seed={seed}",
                                                            f"run.dir={workdir}", f"name={name}", *extra])


def merge(into: ArmResult, one: ArmResult) -> None:
    """Add one seed's run (``one``) to the arm's result over seeds."""
    for f in ("seeds", "scores", "success", "valid", "wall", "tokens", "curves"):
        getattr(into, f).extend(getattr(one, f))
    into.episodes = into.episodes or one.episodes


def run_arm_in_process(comp: Comparison, index: int, seed: int, workdir: Path, eval_problems: int, quick: bool,
                       one_thread: bool) -> ArmResult:
    """One (arm, seed) run in a child process of its own (``--task``), at one torch thread: its result."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"} if one_thread else None
    cmd = [sys.executable, str(Path(__file__).resolve()), "--task", comp.key, str(index), str(seed), "--workdir",
           str(workdir), "--eval", str(eval_problems), *(["--quick"] if quick else []), *(["--one-thread"] if one_thread else [])]
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"bench --learning: {comp.key} arm {index} seed {seed} failed (exit {done.returncode}); "
                           f"its traceback is above; rerun alone with: {' '.join(cmd)}")
    return ArmResult(**json.loads(done.stdout.strip().splitlines()[-1]))


def shared_warm_start(comp: Comparison, seed: int, workdir: Path, quick: bool, one_thread: bool) -> tuple[Path, float]:
    """The comparison's warm start for ``seed`` (run directory, seconds it took): done once, by the first arm
    that needs it (a file lock keeps parallel runs from doing it twice), on the comparison's common settings,
    and shared by its warm-started arms, which start RL from a copy of its checkpoint."""
    from teamrl.tasks import make_task
    from teamrl.trainer.sft import task_demonstrations, warm_start

    name = f"{comp.key}-warm-seed{seed}"
    warm_dir = workdir / name
    with open(workdir / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (warm_dir / "seconds").is_file():
            cfg = _config(comp, Arm("warm start"), quick, one_thread, seed, workdir, name)
            t0 = time.perf_counter()
            task = make_task(cfg.task)
            demos = task_demonstrations(task, task.problems()[:WARM_PROBLEMS_QUICK if quick else comp.warm_problems])
            demos = [d for d in demos if not comp.warm_roles or d.role in comp.warm_roles]
            warm_start(cfg, demos, epochs=1 if quick else comp.warm_epochs, batch_size=8, lr=WARM_LR, progress=False)
            (warm_dir / "seconds").write_text(f"{time.perf_counter() - t0:.1f}")
    return warm_dir, float((warm_dir / "seconds").read_text())


def run_arm(comp: Comparison, index: int, seed: int, workdir: Path, eval_problems: int, quick: bool, result: ArmResult,
            one_thread: bool = False) -> None:
    """Warm start (if the arm has one), RL (if it trains), then the greedy held-out score; into ``result``."""
    from teamrl.trainer.evaluate import evaluate, held_out_config
    from teamrl.trainer.trainer import Trainer

    arm = comp.arms[index]
    name = f"{comp.key}-arm{index}-seed{seed}"
    cfg = _config(comp, arm, quick, one_thread, seed, workdir, name, f"run.save_every={10**6}")
    t0 = time.perf_counter()
    warm_seconds = 0.0
    if arm.warm_start:
        warm_dir, warm_seconds = shared_warm_start(comp, seed, workdir, quick, one_thread)
        shutil.copytree(warm_dir / "checkpoints", workdir / name / "checkpoints")
        (workdir / name / "metrics.jsonl").touch()
    trained_tokens = 0.0
    if arm.rl:
        metrics = Trainer(cfg, resume=arm.warm_start).train()
        steps = [m for m in metrics if "reward_mean" in m]
        result.curves.append([m.get("normalised_return", m["reward_mean"]) for m in steps])
        trained_tokens = sum(v for m in steps for k, v in m.items() if k.startswith("tokens/"))
        result.episodes = cfg.train.steps * cfg.rollout.batch_size * cfg.rollout.group_size
    held, _ = held_out_config(cfg)
    method = "team" if (arm.rl or arm.warm_start) else "untrained"
    (row,) = evaluate(held, [method], checkpoint=workdir / name if method == "team" else None, limit=eval_problems,
                      progress=False)
    result.seeds.append(seed)
    result.wall.append(time.perf_counter() - t0 + warm_seconds)  # each warm-started arm carries the warm start's cost
    result.scores.append(row.mean)
    result.tokens.append(trained_tokens)
    if row.pass_at_1 is not None:
        result.success.append(row.pass_at_1)
    if row.valid is not None:
        result.valid.append(row.valid)


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ({min(values):.3f}..{max(values):.3f})"


def render(comp: Comparison, results: list[ArmResult], seeds: list[int], eval_problems: int, png: str | None) -> str:
    """The comparison's Markdown section: the table (mean and range over seeds) and its curve plot."""
    lines = [f"### {comp.title}", "",
             f"Seeds {seeds}; {eval_problems} held-out problems, greedy. Equal budget: every RL arm samples the same "
             "episodes (steps x problems per step x group size).", "",
             "| arm | held-out normalised return | success / accuracy | valid replies | wall s (mean) | episodes sampled (steps x problems x G) | "
             "trained tokens (mean) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        if not r.scores:  # not run yet (a partial page)
            lines.append(f"| {r.label} | not run yet | | | | | |")
            continue
        lines.append(f"| {r.label} | {_spread(r.scores)} | {_spread(r.success)} | {_spread(r.valid)} | "
                     f"{statistics.mean(r.wall):.0f} | {r.episodes or '-'} | {statistics.mean(r.tokens):.0f} |")
    if comp.flag_cliffs:
        lines += ["", held_out_cliffs(results)]
    if png:
        lines += ["", f"![{comp.key} training curves]({png})"]
    return "\n".join(lines) + "\n"


def held_out_cliffs(results: list[ArmResult], points: float = CLIFF_POINTS) -> str:
    """The trained arms whose held-out accuracy fell more than ``points`` percentage points under the
    untrained team's (results[0]) on the same seed: an accuracy cliff (one line of Markdown)."""
    base = dict(zip(results[0].seeds, results[0].success))
    found = [f"{r.label} (seed {seed}: {100 * acc:.0f}% vs {100 * base[seed]:.0f}%)" for r in results[1:]
             for seed, acc in zip(r.seeds, r.success) if seed in base and 100 * (base[seed] - acc) > points]
    return (f"Accuracy cliffs (held-out accuracy more than {points:g} points under the untrained team's, same seed): "
            + ("; ".join(found) if found else "none") + ".")


def plot(comp: Comparison, results: list[ArmResult], path: Path) -> bool:
    """Training curves (mean over seeds) of the RL arms; False when no arm trained."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trained = [r for r in results if r.curves]
    if not trained:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in trained:
        n = min(len(c) for c in r.curves)
        ax.plot(range(1, n + 1), [statistics.mean(c[i] for c in r.curves) for i in range(n)], marker="o", label=r.label)
    ax.set_xlabel("step")
    ax.set_ylabel("training reward (mean over seeds)")
    ax.set_title(comp.key)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny random model, 1 seed, 1 step, 2 held-out problems")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per arm (default 2; --quick: 1)")
    ap.add_argument("--eval", type=int, default=None, help="held-out problems per arm (default: the comparison's, 6 or 12; --quick: 2)")
    ap.add_argument("--only", default="", help="comma-separated comparison keys (magrpo, at_grpo, m_grpo, study_eval_opt, "
                                               "study_voting); default all")
    ap.add_argument("--out", default=str(REPO / "bench" / "LEARNING.md"), help="Markdown file to write (PNGs beside it)")
    ap.add_argument("--jobs", type=int, default=None, help="(arm, seed) runs at once, one process and one torch thread "
                                                           "each (default 2; --quick: 1, in this process)")
    ap.add_argument("--task", nargs=3, metavar=("KEY", "ARM", "SEED"), help=argparse.SUPPRESS)  # one run, in a child
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--one-thread", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.task:  # a child of --jobs: one (arm, seed) run; its result as the last line of stdout
        key, index, seed = args.task[0], int(args.task[1]), int(args.task[2])
        comp = next(c for c in comparisons() if c.key == key)
        one = ArmResult(comp.arms[index].label)
        run_arm(comp, index, seed, Path(args.workdir), args.eval, args.quick, one, args.one_thread)
        print(json.dumps(dataclasses.asdict(one)), flush=True)
        return 0
    jobs = args.jobs if args.jobs is not None else (1 if args.quick else 2)
    if jobs < 1:
        print(f"bench --learning: --jobs {jobs} must be >= 1", file=sys.stderr)
        return 2
    seeds = list(range(args.seeds or (1 if args.quick else 2)))

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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    mode = "--quick smoke run (tiny random model: the numbers say nothing about learning)" if args.quick else "full run"
    lock = threading.Lock()
    with tempfile.TemporaryDirectory() as d:
        results = {c.key: [ArmResult(a.label) for a in c.arms] for c in grid}
        runs = [(c, i, s) for c in grid for i in range(len(c.arms)) for s in seeds]

        def publish() -> str:
            """Write the page from the runs finished so far (after every run: a run that is stopped
            still leaves what it measured); returns it."""
            sections = []
            for comp in grid:  # seeds finish in any order: the table gives mean and range, the plot the mean
                if not any(r.scores for r in results[comp.key]):
                    continue
                png = out.with_name(f"{out.stem}_{comp.key}.png")
                sections.append(render(comp, results[comp.key], seeds, eval_problems(comp),
                                       png.name if plot(comp, results[comp.key], png) else None))
            finished = sum(len(r.scores) for arms in results.values() for r in arms)
            state = "" if finished == len(runs) else f"; partial: {finished} of {len(runs)} runs finished so far"
            page = (f"# Learning benchmark\n\nWritten by `bench/learning.py` ({mode}); wall time "
                    f"{time.perf_counter() - t0:.0f} s{state}.\n\n" + "\n".join(sections))
            out.write_text(page)
            return page

        def one_run(run: tuple[Comparison, int, int]) -> None:
            comp, index, seed = run
            if jobs == 1:
                one = ArmResult(comp.arms[index].label)
                run_arm(comp, index, seed, Path(d), eval_problems(comp), args.quick, one)
            else:
                one = run_arm_in_process(comp, index, seed, Path(d), eval_problems(comp), args.quick, one_thread=True)
            with lock:
                merge(results[comp.key][index], one)
                publish()
            print(f"[learn] {time.perf_counter() - t0:.0f} s: {comp.key} / {one.label} / seed {seed}: held-out "
                  f"{one.scores[0]:.3f}, {one.wall[0]:.0f} s", file=sys.stderr, flush=True)

        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(one_run, runs))  # list(): re-raise the first failure
    print(publish())
    return 0


if __name__ == "__main__":
    sys.exit(main())
