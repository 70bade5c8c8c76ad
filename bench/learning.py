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
success and the share of groups whose rewards vary (the real target: only those groups teach). The
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
import fcntl
import hashlib
import json
import os
import re
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
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CELLS = REPO / "bench" / "learning_cells"  # the committed cache: one JSON per finished (comparison, arm, seed)
CALIBRATION = REPO / "bench" / "calibration.json"
CALIBRATION_DOC = REPO / "docs" / "learning.md"
QUICK_OUT = REPO / "runs" / "learn_quick" / "LEARNING.md"  # --quick writes here by default, never into bench/
SEEDS = 3
EVAL_PROBLEMS = 48  # held-out problems per arm: a paired difference of ~0.1 needs about this many to clear 2 standard errors
# calibration: the band of sampled success that gives groups signal, and its defaults
BAND = (0.15, 0.50)
CALIBRATE_PROBLEMS = 16


@dataclass(frozen=True)
class Arm:
    """One row of a comparison: its overrides, whether it is warm-started and whether RL trains it."""

    label: str
    overrides: tuple[str, ...] = ()
    warm_start: bool = False
    rl: bool = True
    method: str = ""  # the ``teamrl eval`` method that scores it ("": team when trained or warm-started, else untrained)
    seed_free: bool = False  # its result is the same for every seed (eval only, base weights, fixed held-out problems): run once
    also_eval: tuple[str, ...] = ()  # more ``teamrl eval`` methods scoring the same run (a row each, "<label>, <ALSO_LABELS>")


@dataclass(frozen=True)
class Level:
    """One difficulty level of a comparison's task: its label and the task options that make it."""

    label: str
    overrides: tuple[str, ...]


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
    levels: tuple[Level, ...] = ()  # difficulty levels, easiest first (--calibrate picks one); () = the task has no knob here
    default_level: str = ""  # the level the grid runs at until a calibration picks one
    calibration_arm: int = -1  # the arm whose team (and warm start) calibration scores: the algorithm's own

    def level(self, calibration: dict | None = None) -> Level | None:
        """The level the grid runs at: the calibration's pick where it names one of ours, else the default."""
        by = {lv.label: lv for lv in self.levels}
        picked = ((calibration or {}).get(self.key) or {}).get("picked")
        return by.get(picked) or by.get(self.default_level) or (self.levels[0] if self.levels else None)


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
    # per seed: the held-out problems' ids and normalised returns (paired differences), the run's learning signal
    problem_ids: list[list[str]] = field(default_factory=list)
    problem_scores: list[list[float]] = field(default_factory=list)
    signal: list[float | None] = field(default_factory=list)  # share of groups with a non-zero advantage over its steps
    signal_groups: list[list[int]] = field(default_factory=list)  # [groups with signal, groups] over its steps
    role_grad_norms: list[dict[str, float]] = field(default_factory=list)  # per seed: each role's gradient norm, mean over steps
    # per seed: the same run scored by each of ``Arm.also_eval``'s methods (method -> that one-seed ArmResult as a dict)
    also: list[dict[str, dict[str, Any]]] = field(default_factory=list)


def comparisons() -> list[Comparison]:
    """The grid at CPU scale (the embedded SmolLM2-135M).

    Steps and group sizes are still those sized for an hour on 2 cores (two runs at a time). At one
    thread beside another run, a MAGRPO writing step took ~105 s, an AT-GRPO Plan-Path step (2 turns,
    96 tokens, K=4) ~300 s, one SFT step of 8 Plan-Path demonstrations ~150 s and a held-out
    evaluation of 12 papers ~110 s. One process alone at one thread (2026-12-02, beside test runs): a MAGRPO
    step of 2 papers x 4 samples per agent ~40 s (rollout ~16 s, update ~22 s), a greedy evaluation of the
    untrained team on 48 papers ~150 s. Every arm is scored on ``EVAL_PROBLEMS`` held-out problems (so the
    generated tasks make at least that many, and the study holds that many out). Each task with a
    difficulty knob lists its levels (easiest first); the grid runs at the calibration's pick
    (bench/calibration.json), else at ``default_level``, the settings of the last full run.
    """
    lr = "train.lr=0.0005"
    plan_path = (Level("3x3, walls 0.10", ("task.min_size=3", "task.max_size=3", "task.wall_density=0.1")),
                 Level("4x4, walls 0.10", ("task.min_size=4", "task.max_size=4", "task.wall_density=0.1")),
                 Level("4x4, walls 0.25", ("task.min_size=4", "task.max_size=4", "task.wall_density=0.25")),
                 Level("5x5, walls 0.25", ("task.min_size=5", "task.max_size=5", "task.wall_density=0.25")))
    research = (Level("2 hops (city), 4 people", ("task.kinds=city", "task.num_people=4")),
                Level("2 hops (city), 12 people", ("task.kinds=city", "task.num_people=12")),
                Level("2-3 hops (city, country), 12 people", ("task.kinds=city,country", "task.num_people=12")),
                Level("2-3 hops and arithmetic (every kind), 12 people", ("task.kinds=city,country,age", "task.num_people=12")))
    arithmetic = (Level("one operation, operands <= 5", ("task.source=generated_easy", "task.max_operand=5")),
                  Level("one operation, operands <= 10", ("task.source=generated_easy", "task.max_operand=10")),
                  Level("one operation, operands <= 20", ("task.source=generated_easy", "task.max_operand=20")),
                  Level("several operations (generated)", ("task.source=generated",)))
    return [
        # 10 steps x 2 papers x 4 samples per agent (20 training papers). The held-out papers are the aclsum test
        # split whatever the seed (task.seed, not the run's seed, picks a sample), and the base model is scored
        # greedily, so the untrained team and the prompt baselines are evaluated once for every seed.
        Comparison("magrpo", "MAGRPO, writing.tldr (the demo task): two LoRA agents vs the untrained team and the prompt "
                   "baselines, held-out papers (aclsum test split)",
                   ("rollout.group_size=4", "rollout.batch_size=2", "rollout.max_new_tokens=64", "train.steps=10", lr),
                   (Arm("untrained team", rl=False, seed_free=True),
                    Arm("sequential (prompt baseline, untrained)", rl=False, method="sequential", seed_free=True),
                    Arm("discussion (prompt baseline, untrained)", rl=False, method="discussion", seed_free=True),
                    Arm("MAGRPO"),
                    # twice the papers per step (twice the episodes: 10 steps x 4 papers x G = 4), added after the 2-paper
                    # arm cleared 2 standard errors on one seed of three
                    Arm("MAGRPO, 4 papers per step", ("rollout.batch_size=4",)),
                    # and twice the steps (20 x 4 papers x G = 4), added after the 4-paper arm cleared 2 standard errors
                    # on two seeds of three (a 20-step probe on seed 2: +0.128 +/- 0.020, 160 of 160 groups varied)
                    Arm("MAGRPO, 4 papers per step, 20 steps", ("rollout.batch_size=4", "train.steps=20"))),
                   config="configs/magrpo_writing_tldr.yaml", eval_problems=EVAL_PROBLEMS),
        # The paper's code comparison: helper + main on HumanEval, held out its last 48 problems (task.split=test,
        # whatever the seed), a graded level reward (max 4), so the base model's arms are evaluated once.
        Comparison("magrpo_code", "MAGRPO, code.helper_main (HumanEval): helper + main LoRA agents vs the untrained team "
                   "and the prompt baselines, held-out problems (the last 48, task.split=test)",
                   ("rollout.group_size=4", "rollout.batch_size=2", "rollout.max_new_tokens=128", "train.steps=10",
                    f"task.test_size={EVAL_PROBLEMS}", lr),
                   (Arm("untrained team", rl=False, seed_free=True),
                    Arm("sequential (prompt baseline, untrained)", rl=False, method="sequential", seed_free=True),
                    Arm("discussion (prompt baseline, untrained)", rl=False, method="discussion", seed_free=True),
                    Arm("MAGRPO"),
                    # the writing comparison's larger budget (20 steps x 4 problems x G = 4), added after the 10-step arm
                    # cleared 2 standard errors on one seed of three
                    Arm("MAGRPO, 4 problems per step, 20 steps", ("rollout.batch_size=4", "train.steps=20"))),
                   quick=("task.num_problems=4", "task.test_size=2"),
                   config="configs/magrpo_code_helper_main.yaml", eval_problems=EVAL_PROBLEMS),
        Comparison("at_grpo", "AT-GRPO, Plan-Path, 1 turn (tool + planner, one shared policy unless per-role), held-out grids of "
                   "a fresh seed",
                   ("algorithm=at_grpo", "task.name=plan_path", "task.max_turns=1",
                    "task.num_problems=64", "policy.mode=shared", "rollout.group_size=4", "rollout.batch_size=2",
                    # Dr. GRPO's advantage (r - group mean, no division by the group's std): with success rare, the
                    # std-scaled advantage of an all-fail group turned its -0.01..-0.1 move penalties into full-size
                    # updates toward short plans, and 20 steps took the warm start's greedy success on 3x3 grids from
                    # 0.104 to 0.000 (trajectory grouping and the single agent, seed 0, 2026-12-02)
                    # lr 1e-4, not the grid's 5e-4: at 5e-4 (and mean advantages) 20 steps still lowered the warm
                    # start's held-out 0.104 on seed 0 (single agent 0.104, trajectory 0.062, tree 0.000: the tool's
                    # replies shrank to 1 token) and on seed 1 (single agent 0.000), 2026-12-02
                    "rollout.max_new_tokens=48", "train.steps=20", "train.advantage=mean", "train.lr=0.0001"),
                   # the held-out grids come from task.seed + 1 whatever the run's seed: the untrained team is evaluated once
                   (Arm("untrained team", rl=False, seed_free=True), Arm("warm start only", warm_start=True, rl=False),
                    Arm("single-agent GRPO (planner alone), warm start", ("task.agents=planner", "at_grpo.grouping=trajectory"),
                        warm_start=True),
                    Arm("AT-GRPO, trajectory grouping, warm start", ("at_grpo.grouping=trajectory",), warm_start=True),
                    Arm("AT-GRPO, tree grouping, warm start", ("at_grpo.grouping=tree",), warm_start=True),
                    # one LoRA adapter per role (its own warm start: the planner's adapter on the planner's demonstrations,
                    # the tool's none), also scored swapped (each role on the other's adapter: does each role specialise?)
                    Arm("AT-GRPO, tree grouping, per-role policies, warm start",
                        ("at_grpo.grouping=tree", "policy.mode=lora_per_role"), warm_start=True, also_eval=("swapped",))),
                   quick=("task.num_problems=8",),
                   # the tool's demonstration is a ~230-token BFS program, past what the tool may write here
                   warm_roles=("planner",), warm_problems=8, eval_problems=EVAL_PROBLEMS,
                   levels=plan_path, default_level="4x4, walls 0.25", calibration_arm=4),
        Comparison("m_grpo", "M-GRPO, research environment (main + tool-using sub-agent), held-out questions of a fresh seed",
                   ("algorithm=m_grpo", "task.name=research", "task.num_problems=64", "policy.mode=lora_per_role",
                    # lr 1e-4 and 10 steps (a step is ~2 min at one thread). At 5e-4, 20 steps took the warm start's held-out
                    # 0.419 to 0.100 for both RL arms (every answer wrong after step 2; seed 0, 2026-12-02); at 1e-4, 6 steps
                    # of main + sub took it to 0.531 (+0.113 +/- 0.043 paired, by hand)
                    "rollout.group_size=4", "rollout.batch_size=2", "rollout.max_new_tokens=48", "train.steps=10",
                    "train.lr=0.0001"),
                   # the held-out questions come from task.seed + 1 whatever the run's seed: the untrained team is evaluated once
                   (Arm("untrained team", rl=False, seed_free=True), Arm("warm start only", warm_start=True, rl=False),
                    # the task's demonstrations are of the team protocol (main + sub), so the single agent has none
                    Arm("single agent (no warm start: no single-agent demonstrations)", ("m_grpo.agents=single",)),
                    Arm("main + frozen sub-agent, warm start", ("m_grpo.sub_agent=frozen",), warm_start=True),
                    Arm("M-GRPO main + sub, warm start", (), warm_start=True)),
                   quick=("task.num_problems=12",),
                   # ~8 demonstrations (main and sub turns) per question. Measured by hand on 16 held-out questions
                   # (2026-12-02, docs/learning.md): 2 questions x 1 pass left 0% success at every level; on city questions
                   # 4 x 2 gave 0%, 8 x 2 and 16 x 2 100%; on city and country questions 8 x 2 gave 31%; with age
                   # arithmetic too, 8 x 2 and 16 x 2 gave 0% (the sub-agent's second call returned nothing). 8 x 2 taught the
                   # protocol on 1 seed of 3 (held-out 0.419, 0.031, 0.015); 16 x 2 on seeds 1 and 2 gave 0.438 and 0.231
                   warm_problems=16, warm_epochs=2,
                   eval_problems=EVAL_PROBLEMS, levels=research,
                   default_level="2-3 hops (city, country), 12 people"),
        *[Comparison(f"study_{wf}", f"Workflow study, {wf} on arithmetic, held-out problems (task.split=test)",
                     ("algorithm=grpo", "task.name=math.solve", "task.num_problems=128",
                      f"task.test_size={EVAL_PROBLEMS}", f"workflow.name={wf}", "rollout.group_size=4", "rollout.batch_size=2",
                      *STUDY_SIZES[wf], lr),
                     # the test split and greedy decoding do not depend on the seed: the untrained team is evaluated once
                     # SP and IP first: the grid runs seed by seed and arm by arm, so a stopped grid has the study's pair
                     (Arm("untrained team", rl=False, seed_free=True),
                      # role_grad_norms: the gradient norm of each role type on the one shared policy (role capture)
                      Arm("SP (shared policy)", ("policy.mode=shared", "train.role_grad_norms=true")),
                      Arm("IP (LoRA per role)", ("policy.mode=lora_per_role",)),
                      Arm("SA-RL (single workflow)", ("workflow.name=single", "workflow.options={}"))),
                     quick=("task.num_problems=12", "task.test_size=3"), flag_cliffs=True, eval_problems=EVAL_PROBLEMS,
                     levels=arithmetic, default_level="one operation, operands <= 20", calibration_arm=1)
          for wf in ("eval_opt", "voting")],
    ]


# The warm start (Comparison.warm_problems, warm_epochs). SmolLM2-135M at one thread: 16 Plan-Path
# demonstrations x 2 passes (4 steps of 8) took about 10 minutes, so it is kept small and done once per
# comparison and seed (shared_warm_start).
WARM_PROBLEMS_QUICK = 2
WARM_LR = 2e-3  # a LoRA adapter takes a higher rate than RL's; the few warm-start steps must teach the format

# The study's sizes per workflow. Measured 2026-12-02 at one thread beside another run, at the calibrated
# levels, G = 4 and 2 problems per step: a Voting step ~15 s of rollout and ~25 s of update when a group
# varied; an Eval-Opt step of 2 attempts ~30 s of rollout (plus its update). So Voting trains 15 steps and
# Eval-Opt 10. The held-out accuracy is compared with the untrained team's (CLIFF_POINTS, the trainer's
# default train.cliff_points) and the training curve with its own peak (study_dynamics), without an
# evaluation during training (train.eval_every=0): 48 held-out problems per evaluation cost ~2 min.
STUDY_SIZES = {
    "eval_opt": ("rollout.max_new_tokens=64", "train.steps=10", "train.eval_every=0", "workflow.options.max_iterations=2"),
    "voting": ("rollout.max_new_tokens=32", "train.steps=15", "train.eval_every=0"),
}
CLIFF_POINTS = 10.0
DYNAMICS_WINDOW = 3  # steps per window of the study's training curve (peak, final)

# --quick: every comparison on the tiny random model, one step of the smallest budget
QUICK = ("model=tiny-random", "threads=1", "rollout.max_new_tokens=4", "rollout.group_size=2", "rollout.batch_size=1",
         "train.steps=1", "policy.lora.r=4")


def _overrides(comp: Comparison, arm: Arm, quick: bool, one_thread: bool = False, level: Level | None = None) -> list[str]:
    extra = [*QUICK, *comp.quick] if quick else []
    threads = ["threads=1"] if one_thread else []
    return [*comp.common, *(level.overrides if level else ()), *arm.overrides, *extra, *threads, "run.progress=false",
            "run.tensorboard=false", "run.log_episodes=false"]


def _config(comp: Comparison, arm: Arm, quick: bool, one_thread: bool, seed: int, workdir: Path, name: str,
            *extra: str, level: Level | None = None):
    """The run's config: the comparison's shipped config (if any) with its, the level's, the arm's and the run's settings."""
    from teamrl.core.config import load_config

    return load_config(comp.config and REPO / comp.config, [*_overrides(comp, arm, quick, one_thread, level), f"seed={seed}",
                                                            f"run.dir={workdir}", f"name={name}", *extra])


# the fields of ArmResult that hold one entry per seed (every field but the label and the episode count)
PER_SEED = tuple(f.name for f in dataclasses.fields(ArmResult) if f.name not in ("label", "episodes"))


def merge(into: ArmResult, one: ArmResult) -> None:
    """Add one seed's run (``one``) to the arm's result over seeds."""
    for f in PER_SEED:
        getattr(into, f).extend(getattr(one, f))
    into.episodes = into.episodes or one.episodes


def run_arm_in_process(comp: Comparison, index: int, seed: int, workdir: Path, eval_problems: int, quick: bool,
                       one_thread: bool, level: Level | None = None) -> ArmResult:
    """One (arm, seed) run in a child process of its own (``--run-cell``), at one torch thread: its result."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"} if one_thread else None
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-cell", comp.key, str(index), str(seed), "--workdir",
           str(workdir), "--eval", str(eval_problems), *(["--level", level.label] if level else []),
           *(["--quick"] if quick else []), *(["--one-thread"] if one_thread else [])]
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"bench --learning: {comp.key} arm {index} seed {seed} failed (exit {done.returncode}); "
                           f"its traceback is above; rerun alone with: {' '.join(cmd)}")
    return ArmResult(**json.loads(done.stdout.strip().splitlines()[-1]))


def _policy_overrides(arm: Arm) -> tuple[str, ...]:
    """The arm's ``policy.*`` overrides: an arm with its own policy mode needs a warm start of that mode."""
    return tuple(o for o in arm.overrides if o.startswith("policy."))


def warm_start_dir(comp: Comparison, seed: int, workdir: Path, level: Level | None = None, arm: Arm | None = None) -> Path:
    """Where :func:`shared_warm_start` builds the warm start of (comparison, seed, level, the arm's policy settings);
    it holds ``seconds`` once built."""
    policy = _policy_overrides(arm) if arm else ()
    return workdir / (f"{comp.key}-warm-seed{seed}" + (f"-{_slug(level.label)}" if level else "")
                      + (f"-{_slug(' '.join(o.split('=', 1)[-1] for o in policy))}" if policy else ""))


def next_run(warm_dirs: list[Path | None], building: set[Path]) -> int:
    """Which pending run to start (its index in ``warm_dirs``, the pending runs' warm starts in grid order, None
    for a run without one): the first whose warm start is built or not being built by a run already going.
    Another seed's run would otherwise wait on that warm start's lock, a core idle for its ~10 minutes, while
    it could build its own. The first pending run when every one would wait."""
    for k, warm in enumerate(warm_dirs):
        if warm is None or (warm / "seconds").is_file() or warm not in building:
            return k
    return 0


def shared_warm_start(comp: Comparison, seed: int, workdir: Path, quick: bool, one_thread: bool,
                      level: Level | None = None, arm: Arm | None = None) -> tuple[Path, float]:
    """The comparison's warm start for ``seed`` (run directory, seconds it took): done once, by the first arm
    that needs it (a file lock keeps parallel runs from doing it twice), on the comparison's common settings
    at ``level``, and shared by its warm-started arms, which start RL from a copy of its checkpoint. An
    ``arm`` that sets ``policy.*`` (per-role adapters) gets one of its own: the same demonstrations, roles,
    problems and epochs on its policy settings, in a directory named after them."""
    from teamrl.tasks import make_task
    from teamrl.trainer.sft import task_demonstrations, warm_start

    policy = _policy_overrides(arm) if arm else ()
    warm_dir = warm_start_dir(comp, seed, workdir, level, arm)
    name = warm_dir.name
    with open(workdir / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (warm_dir / "seconds").is_file():
            cfg = _config(comp, Arm("warm start", policy), quick, one_thread, seed, workdir, name, level=level)
            t0 = time.perf_counter()
            task = make_task(cfg.task)
            demos = task_demonstrations(task, task.problems()[:WARM_PROBLEMS_QUICK if quick else comp.warm_problems])
            demos = [d for d in demos if not comp.warm_roles or d.role in comp.warm_roles]
            warm_start(cfg, demos, epochs=1 if quick else comp.warm_epochs, batch_size=8, lr=WARM_LR, progress=False)
            (warm_dir / "seconds").write_text(f"{time.perf_counter() - t0:.1f}")
    return warm_dir, float((warm_dir / "seconds").read_text())


def run_arm(comp: Comparison, index: int, seed: int, workdir: Path, eval_problems: int, quick: bool, result: ArmResult,
            one_thread: bool = False, level: Level | None = None) -> None:
    """Warm start (if the arm has one), RL (if it trains), then the greedy held-out score; into ``result``."""
    from teamrl.trainer.evaluate import evaluate, held_out_config
    from teamrl.trainer.trainer import Trainer

    arm = comp.arms[index]
    name = f"{comp.key}-arm{index}-seed{seed}"
    cfg = _config(comp, arm, quick, one_thread, seed, workdir, name, f"run.save_every={10**6}", level=level)
    t0 = time.perf_counter()
    warm_seconds = 0.0
    if arm.warm_start:
        warm_dir, warm_seconds = shared_warm_start(comp, seed, workdir, quick, one_thread, level, arm)
        shutil.copytree(warm_dir / "checkpoints", workdir / name / "checkpoints")
        (workdir / name / "metrics.jsonl").touch()
    trained_tokens = 0.0
    if arm.rl:
        metrics = Trainer(cfg, resume=arm.warm_start).train()
        steps = [m for m in metrics if "reward_mean" in m]
        result.curves.append([m.get("normalised_return", m["reward_mean"]) for m in steps])
        trained_tokens = sum(v for m in steps for k, v in m.items() if k.startswith("tokens/"))
        result.episodes = cfg.train.steps * cfg.rollout.batch_size * cfg.rollout.group_size
        with_signal = [m for m in steps if "signal/groups" in m]  # the trainer's per-step learning signal
        groups = [int(sum(m["signal/groups_with_signal"] for m in with_signal)), int(sum(m["signal/groups"] for m in with_signal))]
        result.signal.append(groups[0] / groups[1] if groups[1] else None)
        result.signal_groups.append(groups)
        norms: dict[str, list[float]] = {}  # the trainer's gradient norm per role type, over the steps that updated it
        for m in steps:
            for k, v in m.items():
                if k.startswith("role_grad_norm/"):
                    norms.setdefault(k.split("/", 1)[1], []).append(v)
        result.role_grad_norms.append({role: statistics.mean(v) for role, v in sorted(norms.items())})
    else:
        result.signal.append(None)
        result.signal_groups.append([0, 0])
        result.role_grad_norms.append({})
    held, _ = held_out_config(cfg)
    method = arm.method or ("team" if (arm.rl or arm.warm_start) else "untrained")
    row, *also = evaluate(held, [method, *arm.also_eval], checkpoint=workdir / name if method == "team" else None,
                          limit=eval_problems, progress=False)
    extra = {x.method: _scored(ArmResult(arm.label, seeds=[seed], wall=[x.seconds_per_problem * x.problems], tokens=[trained_tokens],
                                         signal=[None], signal_groups=[[0, 0]], role_grad_norms=[{}]), x) for x in also}
    result.also.append({m: dataclasses.asdict(r) for m, r in extra.items()})  # the same trained run, other methods: no second training
    result.seeds.append(seed)
    # each warm-started arm carries the warm start's cost; the extra methods' evaluations are their rows' own
    result.wall.append(time.perf_counter() - t0 + warm_seconds - sum(r.wall[0] for r in extra.values()))
    result.tokens.append(trained_tokens)
    _scored(result, row)


def _scored(result: ArmResult, row) -> ArmResult:
    """Add one held-out evaluation (an :class:`~teamrl.trainer.evaluate.EvalRow`) to ``result``: its mean, the
    problems' ids and scores (for the paired differences), success and valid replies where the task tells."""
    result.scores.append(row.mean)
    result.problem_ids.append([str(e["problem_id"]) for e in row.episodes])
    result.problem_scores.append(list(row.scores))
    if row.pass_at_1 is not None:
        result.success.append(row.pass_at_1)
    if row.valid is not None:
        result.valid.append(row.valid)
    return result


# ---- the cache of finished runs ----------------------------------------------------------------

def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60]


def cell_path(cells: Path, comp: Comparison, index: int, seed: int) -> Path:
    """Where the (comparison, arm, seed) run's result is cached (an arm evaluated once: one cell for every seed)."""
    arm = comp.arms[index]
    return cells / comp.key / (f"{_slug(arm.label)}-every-seed.json" if arm.seed_free else f"{_slug(arm.label)}-seed{seed}.json")


def for_seeds(one: ArmResult, seeds: list[int]) -> list[ArmResult]:
    """An arm evaluated once (``Arm.seed_free``): its one result as each seed's, so it pairs with every seed's runs."""
    return [dataclasses.replace(one, **{**{f: list(getattr(one, f)) for f in PER_SEED}, "seeds": [s]}) for s in seeds]


def cell_fingerprint(comp: Comparison, index: int, eval_problems: int, quick: bool, level: Level | None) -> str:
    """A digest of everything that decides a run's result: another setting, level, warm start or held-out
    count is another cell (an old cell is then run again, not reused)."""
    arm = comp.arms[index]
    what = {"config": comp.config, "overrides": _overrides(comp, arm, quick, False, level), "eval": eval_problems,
            "rl": arm.rl, "warm": [arm.warm_start, list(comp.warm_roles), comp.warm_problems, comp.warm_epochs, WARM_LR]
            if arm.warm_start else None}
    if arm.method:  # only where set: the cells cached before these fields keep their fingerprints
        what["method"] = arm.method
    if arm.seed_free:
        what["seed_free"] = True
    policy = _policy_overrides(arm)
    if arm.warm_start and policy:  # a warm start of its own policy mode, not the comparison's
        what["warm_policy"] = list(policy)
    if arm.also_eval:
        what["also_eval"] = list(arm.also_eval)
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def read_cell(path: Path, fingerprint: str) -> ArmResult | None:
    """The cached one-seed result at ``path`` if it is there and of these settings, else None."""
    try:
        cell = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if cell.get("fingerprint") != fingerprint:
        return None
    names = {f.name for f in dataclasses.fields(ArmResult)}
    return ArmResult(**{k: v for k, v in cell["result"].items() if k in names})


def write_cell(path: Path, fingerprint: str, comp: Comparison, level: Level | None, one: ArmResult) -> None:
    """Cache one finished run (written whole, then renamed: a stopped run never leaves half a cell)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    cell = {"comparison": comp.key, "arm": one.label, "seed": one.seeds[0],
            **({"for_every_seed": True} if path.name.endswith("-every-seed.json") else {}), "level": level.label if level else None,
            "fingerprint": fingerprint, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "result": dataclasses.asdict(one)}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cell, indent=1) + "\n")
    tmp.replace(path)


# ---- the statistics: paired differences against the untrained team ------------------------------

def paired_vs_untrained(untrained: ArmResult, arm: ArmResult) -> dict[int, dict[str, Any]]:
    """Per seed both ran on the same held-out problems: the paired difference of ``arm`` - ``untrained``
    in normalised return (:func:`teamrl.trainer.evaluate.compare`), its standard error and whether it
    exceeds 2 standard errors."""
    from teamrl.trainer.evaluate import EvalRow, compare

    base = {s: (ids, sc) for s, ids, sc in zip(untrained.seeds, untrained.problem_ids, untrained.problem_scores)}
    out = {}
    for seed, ids, scores in zip(arm.seeds, arm.problem_ids, arm.problem_scores):
        if seed not in base or base[seed][0] != ids or not ids:
            continue  # not the same problems (or no untrained run of this seed yet): nothing to pair

        def row(method: str, values: list[float]) -> EvalRow:
            return EvalRow(method, statistics.mean(values), 0.0, len(values), 0.0, 0.0, scores=values)
        c = compare([row("team", scores), row("untrained", base[seed][1])])
        out[seed] = {"difference": c.difference, "stderr": c.stderr, "problems": c.problems, "beyond_noise": c.beyond_noise}
    return out


def warm_start_alone(comp: Comparison, results: list[ArmResult]) -> ArmResult | None:
    """The comparison's "warm start only" result (warm-started, not trained by RL), if it has that arm."""
    return next((r for a, r in zip(comp.arms, results) if a.warm_start and not a.rl), None)


def paired_vs_warm_start(comp: Comparison, results: list[ArmResult]) -> list[dict[int, dict[str, Any]] | None]:
    """Per arm: a warm-started RL arm's paired difference against the warm start alone (RL's own effect, the
    same statistics as :func:`paired_vs_untrained`); None for every other arm or without a warm-start-only arm."""
    warm = warm_start_alone(comp, results)
    return [paired_vs_untrained(warm, r) if warm is not None and a.warm_start and a.rl else None
            for a, r in zip(comp.arms, results)]


# the row label of an arm's run scored by another method (``Arm.also_eval``): "<arm>, <this>"
ALSO_LABELS = {"swapped": "swapped policies"}


def also_rows(arm: Arm, r: ArmResult, warm: ArmResult | None, arm_vs_warm: dict | None
              ) -> list[tuple[str, ArmResult, dict | None]]:
    """(method, result, paired vs the warm start) for each of ``arm.also_eval``: the arm's runs scored by that
    method, a row of their own (its scores per seed from the arm's cells; the training budget, episodes and
    tokens, is the arm's), paired with the warm start ``warm`` where the arm itself is (``arm_vs_warm``)."""
    rows = []
    for method in arm.also_eval:
        row = ArmResult(f"{r.label}, {ALSO_LABELS.get(method, method)}", episodes=r.episodes)
        for per_seed in r.also:
            if method in per_seed:
                merge(row, ArmResult(**per_seed[method]))
        rows.append((method, row, None if arm_vs_warm is None else paired_vs_untrained(warm, row)))
    return rows


def _paired_cell(paired: dict[int, dict[str, Any]]) -> str:
    return "; ".join(f"s{seed}: {p['difference']:+.3f} +/- {p['stderr']:.3f}{' *' if p['beyond_noise'] else ''}"
                     for seed, p in sorted(paired.items())) or "-"


def _signal_cell(r: ArmResult) -> str:
    shares = [x for x in r.signal if x is not None]
    if not shares:
        return "-"
    varied = sum(g[0] for g in r.signal_groups)
    total = sum(g[1] for g in r.signal_groups)
    return f"{100 * varied / total:.0f}% ({varied} of {total})" + (" **no learning signal**" if varied == 0 else "")


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ({min(values):.3f}..{max(values):.3f})"


def render(comp: Comparison, results: list[ArmResult], seeds: list[int], eval_problems: int, png: str | None,
           level: Level | None = None) -> str:
    """The comparison's Markdown section: the table (mean and range over seeds) and its curve plot."""
    at = f" Level: {level.label} (`{' '.join(level.overrides)}`)." if level else ""
    warm_alone = warm_start_alone(comp, results)
    warm = warm_alone is not None
    budgets = sorted({r.episodes for arm, r in zip(comp.arms, results) if arm.rl and r.episodes})
    budget = (f" Budgets differ: RL arms sampled {budgets[0]} to {budgets[-1]} episodes (the episodes column)."
              if len(budgets) > 1 else
              " Equal budget: every RL arm samples the same episodes (steps x problems per step x group size).")
    lines = [f"### {comp.title}", "",
             f"Seeds {seeds}; {eval_problems} held-out problems, greedy.{at}{budget}", "",
             "| arm | held-out normalised return | success / accuracy | valid replies | wall s (mean) | episodes sampled (steps x problems x G) | "
             "trained tokens (mean) | paired difference vs untrained, per seed (* beyond 2 s.e.) | learning signal: groups varied |"
             + (" paired difference vs warm start only, per seed (RL's own effect) |" if warm else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if warm else "")]
    specialised = []  # team - swapped, per arm scored swapped too
    for arm, arm_result, arm_vs_warm in zip(comp.arms, results, paired_vs_warm_start(comp, results)):
        extra = also_rows(arm, arm_result, warm_alone, arm_vs_warm)  # the same run scored by other methods: rows under it
        for r, vs_warm in [(arm_result, arm_vs_warm)] + [(x, x_vs_warm) for _, x, x_vs_warm in extra]:
            if not r.scores:  # not run yet (a partial page)
                lines.append(f"| {r.label} | not run yet | | | | | | | |" + (" |" if warm else ""))
                continue
            paired = _paired_cell(paired_vs_untrained(results[0], r)) if r is not results[0] else ""
            lines.append(f"| {r.label} | {_spread(r.scores)} | {_spread(r.success)} | {_spread(r.valid)} | "
                         f"{statistics.mean(r.wall):.0f} | {r.episodes or '-'} | {statistics.mean(r.tokens):.0f} | {paired} | "
                         f"{_signal_cell(r)} |" + (f" {_paired_cell(vs_warm) if vs_warm is not None else '-'} |" if warm else ""))
        specialised += [f"{arm_result.label}: {_paired_cell(paired_vs_untrained(x, arm_result))}" for m, x, _ in extra
                        if m == "swapped" and x.scores]
    if specialised:
        lines += ["", "Specialisation check (the team's score minus the same run's with each role on the next role's policy, "
                      f"paired per seed): {'; '.join(specialised)}."]
    once = [a.label for a in comp.arms if a.seed_free]
    if once:
        lines += ["", f"Evaluated once and reused for every seed (base weights, greedy, the same held-out problems whatever "
                      f"the seed): {', '.join(once)}."]
    if comp.flag_cliffs:
        lines += ["", held_out_cliffs(results)]
        if any(r.curves for r in results):
            lines += ["", render_study_dynamics(results)]
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


def study_dynamics(results: list[ArmResult], window: int = DYNAMICS_WINDOW) -> list[dict[str, Any] | None]:
    """Per arm (None where it did not train): per seed, the training curve's peak (the highest mean of
    ``window`` consecutive steps, and the last step of that window), its final value (the mean of the last
    ``window`` steps) and how far it fell from the peak; the gradient norm per role, mean over seeds. A step
    samples a few problems only, so a window, not one step, makes a peak."""
    out: list[dict[str, Any] | None] = []
    for r in results:
        if not r.curves:
            out.append(None)
            continue
        peak, peak_step, final = [], [], []
        for curve in r.curves:
            w = min(window, len(curve))
            means = [statistics.mean(curve[i - w:i]) for i in range(w, len(curve) + 1)]
            best = max(range(len(means)), key=lambda i: (means[i], -i))  # the first of equal peaks
            peak.append(means[best])
            peak_step.append(best + w)
            final.append(means[-1])
        roles = sorted({role for norms in r.role_grad_norms for role in norms})
        out.append({"peak": peak, "peak_step": peak_step, "final": final,
                    "fell_from_peak": [p - f for p, f in zip(peak, final)],
                    "role_grad_norm": {role: statistics.mean(n[role] for n in r.role_grad_norms if role in n) for role in roles}})
    return out


def render_study_dynamics(results: list[ArmResult], points: float = CLIFF_POINTS) -> str:
    """The study's training dynamics table (Markdown): peak and final training accuracy per seed, the seeds
    whose curve fell more than ``points`` from its peak, and each role's gradient norm."""
    lines = [f"Training dynamics (training reward over {DYNAMICS_WINDOW}-step windows; a fall of more than {points:g} points "
             "from the peak is a cliff):", "",
             f"| arm | training peak (step), per seed | training final (last {DYNAMICS_WINDOW} steps), per seed | "
             f"fell from peak by more than {points:g} points | gradient norm per role (mean over steps and seeds) |",
             "|---|---|---|---|---|"]
    for r, d in zip(results, study_dynamics(results)):
        if d is None:
            continue
        fell = [f"s{s}: -{100 * x:.0f} points" for s, x in zip(r.seeds, d["fell_from_peak"]) if 100 * x > points]
        norms = ", ".join(f"{role} {v:.2f}" for role, v in d["role_grad_norm"].items()) or "-"
        lines.append(f"| {r.label} | {'; '.join(f's{s}: {p:.3f} (step {k})' for s, p, k in zip(r.seeds, d['peak'], d['peak_step']))} | "
                     f"{'; '.join(f's{s}: {x:.3f}' for s, x in zip(r.seeds, d['final']))} | {'; '.join(fell) or 'none'} | {norms} |")
    return "\n".join(lines)


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


def _arm_json(comp: Comparison, base: ArmResult, r: ArmResult, dynamics: dict[str, Any] | None,
              vs_warm: dict[int, dict[str, Any]] | None) -> dict[str, Any]:
    """One row of ``learning_results.json``: ``r``'s figures, paired with the untrained team (``base``) and the warm start."""
    paired = paired_vs_untrained(base, r) if r is not base else {}
    return {
        "arm": r.label, "seeds": r.seeds, "evaluated_once": any(a.seed_free for a in comp.arms if a.label == r.label), "held_out_problems": [len(ids) for ids in r.problem_ids],
        "mean": statistics.mean(r.scores) if r.scores else None,
        "success": statistics.mean(r.success) if r.success else None,
        "valid": statistics.mean(r.valid) if r.valid else None,
        "paired_vs_untrained": {str(k): v for k, v in sorted(paired.items())},
        # the acceptance of issue 31: beyond 2 standard errors, above the untrained team, on every seed run
        "beats_untrained_on_every_seed": bool(paired) and len(paired) == len(r.seeds) and all(
            p["beyond_noise"] and p["difference"] > 0 for p in paired.values()),
        "signal_groups_varied": [g[0] for g in r.signal_groups], "signal_groups": [g[1] for g in r.signal_groups],
        "episodes_sampled": r.episodes, "wall_s": r.wall,
        **({"training_dynamics": dynamics} if comp.flag_cliffs and dynamics else {}),
        # a warm-started RL arm against the warm start alone: RL's own effect
        **({"paired_vs_warm_start": {str(k): v for k, v in sorted(vs_warm.items())}} if vs_warm is not None else {}),
    }


def results_json(grid: list[Comparison], results: dict[str, list[ArmResult]], levels: dict[str, Level | None],
                 eval_problems: dict[str, int], mode: str) -> dict[str, Any]:
    """The machine-readable ``learning_results.json``: per comparison and arm, the seeds run, the held-out
    problem count, the mean held-out score and, per seed, the paired difference against the untrained team
    (the first arm) with its standard error, and the learning signal of its training."""
    sections = []
    for comp in grid:
        arms = []
        base = results[comp.key][0]
        warm = warm_start_alone(comp, results[comp.key])
        for arm, r, dynamics, vs_warm in zip(comp.arms, results[comp.key], study_dynamics(results[comp.key]),
                                             paired_vs_warm_start(comp, results[comp.key])):
            arms.append(_arm_json(comp, base, r, dynamics, vs_warm))
            for method, x, x_vs_warm in also_rows(arm, r, warm, vs_warm):  # the same run, another method; team - it: the check
                team_minus = paired_vs_untrained(x, r)
                arms.append({**_arm_json(comp, base, x, None, x_vs_warm),
                             "of_arm": r.label, "method": method,
                             "paired_team_minus_method": {str(k): v for k, v in sorted(team_minus.items())}})
        level = levels.get(comp.key)
        sections.append({"key": comp.key, "title": comp.title, "eval_problems": eval_problems[comp.key],
                         "level": {"label": level.label, "overrides": list(level.overrides)} if level else None,
                         "arms": arms})
    return {"mode": mode, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sections": sections}


# ---- calibration ----------------------------------------------------------------------------------

def _sampled_signal(cfg, resume: bool, problems: int) -> dict[str, Any]:
    """At the training temperature and group size, on ``problems`` training problems: the rollouts and
    advantages of training steps, without the update (the trainer's own sampler, groups and advantages)."""
    from teamrl.core.seeding import derive_seed
    from teamrl.rollout.scheduler import GenerationScheduler
    from teamrl.trainer.diagnostics import learning_signal
    from teamrl.trainer.trainer import Trainer
    from teamrl.workflows.context import EpisodeContext

    trainer = Trainer(cfg, resume=resume)
    varied = groups = 0
    success: list[float] = []
    rewards: list[float] = []
    try:
        for step in range(max(1, -(-problems // cfg.rollout.batch_size))):
            batch = trainer._next_problems()
            scheduler = GenerationScheduler(trainer.engine, seed=derive_seed(cfg.seed, step + 1, 1))

            def make_ctx(problem, episode: int, tags: dict, scheduler=scheduler) -> EpisodeContext:
                params = trainer.greedy_params if tags.get("greedy") else trainer.params
                return EpisodeContext(scheduler, trainer.route, trainer.tokenizer, params, problem.id, episode, tags)

            samples = trainer._rollout(batch, make_ctx, scheduler)
            train = trainer._assign_advantages(samples)
            sig = learning_signal(train, trainer.roles)
            varied += int(sig.get("signal/groups_with_signal", 0))
            groups += int(sig.get("signal/groups", 0))
            rewards += [s.reward for s in train]
            m = trainer.algorithm.metrics(train)
            rate = m.get("success_rate", m.get("accuracy"))
            if rate is not None:
                success.append(rate)
    finally:
        trainer.shutdown()
    return {"sampled_success": statistics.mean(success) if success else None,
            "sampled_reward": statistics.mean(rewards) if rewards else None,
            "groups_varied": varied / groups if groups else 0.0, "groups": groups, "groups_with_signal": varied}


def calibrate_level(comp: Comparison, level: Level, quick: bool, workdir: Path, problems: int, seed: int = 0) -> dict[str, Any]:
    """One level's row: greedy success and valid replies on held-out problems and, at the training temperature
    with the comparison's group size, success and the share of groups that vary; after the warm start where
    the calibrated arm has one."""
    from teamrl.trainer.evaluate import evaluate, held_out_config

    arm = comp.arms[comp.calibration_arm]
    name = f"{comp.key}-calibrate-{_slug(level.label)}"
    t0 = time.perf_counter()
    cfg = _config(comp, arm, quick, False, seed, workdir, name, f"run.save_every={10**6}", level=level)
    if arm.warm_start:
        warm_dir, _ = shared_warm_start(comp, seed, workdir, quick, False, level, arm)
        shutil.copytree(warm_dir / "checkpoints", workdir / name / "checkpoints")
        (workdir / name / "metrics.jsonl").touch()
    held, _ = held_out_config(cfg)
    method = "team" if arm.warm_start else "untrained"
    (row,) = evaluate(held, [method], checkpoint=workdir / name if arm.warm_start else None, limit=problems, progress=False)
    out = {"settings": list(level.overrides), "warm_start": arm.warm_start, "problems": row.problems,
           "greedy_success": row.pass_at_1, "greedy_return": row.mean, "valid": row.valid,
           "temperature": cfg.rollout.temperature, "group_size": cfg.rollout.group_size}
    out.update(_sampled_signal(cfg, arm.warm_start, problems))
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def pick_level(rows: dict[str, dict[str, Any]], band: tuple[float, float] = BAND) -> tuple[str | None, str]:
    """(the level to run at, why): of the levels whose greedy success (what the held-out score measures) is in
    ``band`` and whose groups varied, the one with the most varied groups; failing that, the same by sampled
    success (greedy where none was sampled); failing that, the level with the most varied groups (said so);
    None when no level was measured."""
    if not rows:
        return None, "no level measured"

    def rate(r: dict[str, Any]) -> float | None:
        return r["sampled_success"] if r.get("sampled_success") is not None else r.get("greedy_success")
    for name, success in (("greedy success", lambda r: r.get("greedy_success")), ("success", rate)):
        inside = {k: r for k, r in rows.items()
                  if success(r) is not None and band[0] <= success(r) <= band[1] and r["groups_varied"] > 0}
        if inside:
            best = max(inside, key=lambda k: inside[k]["groups_varied"])
            return best, f"{name} {success(inside[best]):.2f} within {band[0]:.2f}-{band[1]:.2f}, the most varied groups of those"
    best = max(rows, key=lambda k: (rows[k]["groups_varied"], rate(rows[k]) or 0.0))
    return best, (f"no level within {band[0]:.2f}-{band[1]:.2f} success with varied groups: the most varied groups "
                  f"({100 * rows[best]['groups_varied']:.0f}%)")


def _fmt(x: Any, pct: bool = True) -> str:
    return "-" if x is None else (f"{100 * x:.0f}%" if pct else f"{x:.3f}")


def calibration_markdown(calibration: dict[str, Any], grid: list[Comparison]) -> str:
    """The calibration table (Markdown) of every comparison calibrated."""
    lines = ["| comparison | level | settings | warm start | problems | greedy success | valid replies | "
             "sampled success (T, G) | groups varied | picked |", "|---|---|---|---|---|---|---|---|---|---|"]
    for comp in grid:
        entry = calibration.get(comp.key)
        if not entry:
            continue
        for lv in comp.levels:
            r = entry["levels"].get(lv.label)
            if r is None:
                continue
            lines.append(f"| {comp.key} | {lv.label} | `{' '.join(r['settings'])}` | {'yes' if r['warm_start'] else 'no'} | "
                         f"{r['problems']} | {_fmt(r['greedy_success'])} | {_fmt(r['valid'])} | "
                         f"{_fmt(r['sampled_success'])} (T={r['temperature']:g}, G={r['group_size']}) | "
                         f"{_fmt(r['groups_varied'])} ({r['groups_with_signal']} of {r['groups']}) | "
                         f"{'**yes**' if entry.get('picked') == lv.label else ''} |")
    picks = [f"- {c.key}: {calibration[c.key]['picked']} ({calibration[c.key]['why']})" for c in grid
             if calibration.get(c.key, {}).get("picked")]
    return "\n".join(lines + [""] + picks) + "\n"


MARK_START, MARK_END = "<!-- calibration table: written by bench/learning.py --calibrate -->", "<!-- end of calibration table -->"


def write_calibration_doc(doc: Path, table: str, mode: str) -> None:
    """Put ``table`` between the markers of ``doc`` (appended under a heading the first time)."""
    text = doc.read_text() if doc.is_file() else ""
    block = f"{MARK_START}\n\n_{mode}; table written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}_\n\n{table}\n{MARK_END}"
    if MARK_START in text and MARK_END in text:
        text = text[:text.index(MARK_START)] + block + text[text.index(MARK_END) + len(MARK_END):]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + "### The calibration table\n\n" + block + "\n"
    doc.write_text(text)


def calibrate(grid: list[Comparison], quick: bool, path: Path, doc: Path | None, problems: int, workdir: Path,
              redo: bool = False, measure: bool = True) -> dict[str, Any]:
    """Measure each comparison's levels (those already in ``path`` with the same settings are kept: resumable),
    pick one per comparison, write ``path`` after every level and the table into ``doc``; ``measure=False``:
    only the picks and the table, from the levels in ``path``."""
    calibration = json.loads(path.read_text()) if path.is_file() else {}
    mode = "--quick (tiny random model: says nothing about the embedded model)" if quick else "SmolLM2-135M"
    for comp in grid:
        levels = comp.levels[:2] if quick else comp.levels
        if levels and measure:
            entry = calibration.setdefault(comp.key, {"levels": {}})
            for lv in levels:
                key = hashlib.sha256(json.dumps([_overrides(comp, comp.arms[comp.calibration_arm], quick, False, lv), problems,
                                                 comp.warm_roles, comp.warm_problems, comp.warm_epochs]).encode()).hexdigest()[:16]
                if not redo and entry["levels"].get(lv.label, {}).get("fingerprint") == key:
                    continue
                row = calibrate_level(comp, lv, quick, workdir, problems)
                entry["levels"][lv.label] = {**row, "fingerprint": key}
                entry["picked"], entry["why"] = pick_level(entry["levels"])
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(calibration, indent=1) + "\n")  # after every level: a stopped run keeps it
                print(f"[calibrate] {comp.key} / {lv.label}: greedy {_fmt(row['greedy_success'])}, sampled "
                      f"{_fmt(row['sampled_success'])}, groups varied {_fmt(row['groups_varied'])} ({row['seconds']:.0f} s)",
                      file=sys.stderr, flush=True)
        if calibration.get(comp.key, {}).get("levels"):  # the pick by today's rule, measured now or read from the file
            calibration[comp.key]["picked"], calibration[comp.key]["why"] = pick_level(calibration[comp.key]["levels"])
    calibration = {k: v for k, v in calibration.items() if v.get("levels")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration, indent=1) + "\n")
    table = calibration_markdown(calibration, grid)
    if doc is not None:
        write_calibration_doc(doc, table, mode)
    print(table)
    return calibration


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny random model, 1 seed, 1 step, 2 held-out problems")
    ap.add_argument("--seeds", type=int, default=None, help=f"seeds per arm (default {SEEDS}; --quick: 1)")
    ap.add_argument("--eval", type=int, default=None, help=f"held-out problems per arm (default {EVAL_PROBLEMS}; --quick: 2)")
    ap.add_argument("--only", default="", help="comma-separated comparison keys (magrpo, magrpo_code, at_grpo, m_grpo, study_eval_opt, "
                                               "study_voting); default all")
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
    args = ap.parse_args(argv)
    if args.run_cell:  # a child of --jobs: one (arm, seed) run; its result as the last line of stdout
        key, index, seed = args.run_cell[0], int(args.run_cell[1]), int(args.run_cell[2])
        comp = next(c for c in comparisons() if c.key == key)
        level = next((lv for lv in comp.levels if lv.label == args.level), None)
        one = ArmResult(comp.arms[index].label)
        run_arm(comp, index, seed, Path(args.workdir), args.eval, args.quick, one, args.one_thread, level)
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
    runs, cached = [], 0
    for c in grid:
        order = []  # seed by seed (a stopped grid still pairs); arms evaluated once: the untrained team first, others last
        for i, arm in enumerate(c.arms):
            for k, s in enumerate(seeds[:1] if arm.seed_free else seeds):
                order.append(((len(seeds) if arm.seed_free and i else k), i, s))
        for _, i, s in sorted(order):
            fp = cell_fingerprint(c, i, eval_problems(c), args.quick, levels[c.key])
            one = read_cell(cell_path(cells, c, i, s), fp)
            if one is not None:
                for each in (for_seeds(one, seeds) if c.arms[i].seed_free else [one]):
                    merge(results[c.key][i], each)
                cached += 1
            else:
                runs.append((c, i, s, fp))
    total = cached + len(runs)
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
        else:
            one = run_arm_in_process(comp, index, seed, d, eval_problems(comp), args.quick, one_thread=True, level=level)
        with lock:
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
