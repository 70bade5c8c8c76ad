"""The learning benchmark's grid (``bench/learning.py``): its comparisons, their arms and difficulty levels,
the settings each run is made of, and the result of an arm over seeds."""

from __future__ import annotations

import dataclasses
import re
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
    calibrated_by: str = ""  # another comparison whose calibration pick this one runs at ("": its own)

    def level(self, calibration: dict | None = None) -> Level | None:
        """The level the grid runs at: the calibration's pick where it names one of ours, else the default."""
        by = {lv.label: lv for lv in self.levels}
        picked = ((calibration or {}).get(self.calibrated_by or self.key) or {}).get("picked")
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
    # per seed: each optimizer step's gradient norm before clipping (the largest of the run's policies'); [] for a run
    # cached before it was recorded or one that did not train
    grad_norms: list[list[float]] = field(default_factory=list)
    # per seed: the held-out accuracy evaluated during training (train.eval_every), [step, accuracy] pairs from step 0
    eval_curves: list[list[list[float]]] = field(default_factory=list)
    # per seed: each role's own (local) reward per step where the algorithm logs it (AT-GRPO: "tool/turn0" -> [...])
    role_local_rewards: list[dict[str, list[float]]] = field(default_factory=list)
    # per seed: each role's own reward in the greedy held-out evaluation, {"mean": ..., "at_one": share of its calls at 1}
    # (AT-GRPO's Plan-Path tool: the share of held-out grids its program solved); roles given none are absent
    held_out_own_rewards: list[dict[str, dict[str, float]]] = field(default_factory=list)
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
        # Dr. MAS (2026): normalising advantages over every agent's samples (team-wide) spikes the gradient norm when
        # the agents' rewards differ; per agent it does not. The same run, twice: train.advantage_scope agent | team.
        # Writing's agents share one reward per joint action (aligned): the scopes differ only in the pooled std.
        Comparison("adv_scope_magrpo", "Advantage normalisation per agent (Dr. MAS) vs team-wide: MAGRPO, writing.tldr, "
                   "held-out papers (aclsum test split)",
                   ("rollout.group_size=4", "rollout.batch_size=2", "rollout.max_new_tokens=64", "train.steps=10", lr),
                   (Arm("untrained team", rl=False, seed_free=True),
                    Arm("MAGRPO, agent-wise normalisation (the default)", ("train.advantage_scope=agent",)),
                    Arm("MAGRPO, team-wide normalisation", ("train.advantage_scope=team",))),
                   config="configs/magrpo_writing_tldr.yaml", eval_problems=EVAL_PROBLEMS),
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
                    # 256 new tokens and both roles warm-started (issue learn-3): at 48 the tool's ~230-token BFS program
                    # never fit, so the tool never earned its reward and every arm solved the same 5 of 48 grids; 8 grids
                    # a step, 4x the 2 of the first grid
                    "rollout.max_new_tokens=256", "rollout.batch_size=8", "train.steps=20", "train.advantage=mean",
                    # 4 completions a pass, not 16: at 16 the tree arm's learn step (8 grids x 2 roles x 4 candidates
                    # of ~500 tokens) took 13 GB and was killed for memory beside a second run (2026-12-05)
                    "train.lr=0.0001", "train.micro_batch_size=4"),
                   # the held-out grids come from task.seed + 1 whatever the run's seed: the untrained team is evaluated once
                   (Arm("untrained team", rl=False, seed_free=True), Arm("warm start only", warm_start=True, rl=False),
                    Arm("single-agent GRPO (planner alone), warm start", ("task.agents=planner", "at_grpo.grouping=trajectory"),
                        warm_start=True),
                    Arm("AT-GRPO, trajectory grouping, warm start", ("at_grpo.grouping=trajectory",), warm_start=True),
                    Arm("AT-GRPO, tree grouping, warm start", ("at_grpo.grouping=tree",), warm_start=True),
                    # one LoRA adapter per role (its own warm start: the planner's adapter on the planner's demonstrations,
                    # the tool's none), also scored swapped (each role on the other's adapter: does each role specialise?)
                    Arm("AT-GRPO, tree grouping, per-role policies, warm start",
                        ("at_grpo.grouping=tree", "policy.mode=lora_per_role"), warm_start=True, also_eval=("swapped",)),
                    # the per-role arm's own warm start alone: its RL's own effect
                    Arm("warm start only, per-role policies", ("policy.mode=lora_per_role",), warm_start=True, rl=False),
                    # the team's warm start scored planner-alone (no tool output): the single agent's RL's own effect
                    # (added 2026-12-05, last: the arms' indices of running grids stay)
                    Arm("warm start only, planner alone", ("task.agents=planner",), warm_start=True, rl=False)),
                   quick=("task.num_problems=8",),
                   # both roles: the tool's demonstration is the ~230-token BFS program (the same for every grid), the
                   # planner's the path that program prints. 16 grids x 3 passes (12 steps), not 8 x 2 (4 steps): after
                   # 4 steps the loss was still falling (0.058, 0.137, 0.093 on seeds 0-2) and on seed 1 no sampled
                   # program ever ran, so the tool never earned its reward there (2026-12-05)
                   warm_problems=16, warm_epochs=3, eval_problems=EVAL_PROBLEMS,
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
        # The study with a format it can meet (issue learn-3): each role warm-started on its workflow's demonstrations
        # (the generator's answer line, the aggregator's Choice, the evaluator's Verdict), 96 new tokens, 4x the episodes
        # of the first grid (STUDY_SIZES) and lr 1e-4 against the cliffs. At 32 tokens and no warm start, 2-8% of
        # Voting's replies were valid and no team arm beat the untrained team on 3 seeds.
        *[Comparison(f"study_{wf}", f"Workflow study, {wf} on arithmetic, held-out problems (task.split=test)",
                     (*STUDY_COMMON, f"workflow.name={wf}", *STUDY_SIZES[wf]),
                     # the test split and greedy decoding do not depend on the seed: the untrained team is evaluated once
                     # SP and IP first: the grid runs seed by seed and arm by arm, so a stopped grid has the study's pair
                     (Arm("untrained team", rl=False, seed_free=True),
                      Arm("warm start only", warm_start=True, rl=False),
                      # role_grad_norms: the gradient norm of each role type on the one shared policy (role capture)
                      Arm("SP (shared policy), warm start", ("policy.mode=shared", "train.role_grad_norms=true"), warm_start=True),
                      Arm("IP (LoRA per role), warm start", ("policy.mode=lora_per_role",), warm_start=True),
                      # the single agent's prompt is the generator's: it starts from the team's shared warm start
                      Arm("SA-RL (single workflow), warm start", ("workflow.name=single", "workflow.options={}"), warm_start=True),
                      # IP's own warm start (one adapter per role), RL's own effect for IP (added after the first seeds:
                      # last, so the arms' indices of running grids stay; on seed 0 IP's warm start scored 0.56 on 16
                      # held-out problems at step 0 against the shared one's 0.31)
                      Arm("warm start only, IP (LoRA per role)", ("policy.mode=lora_per_role",), warm_start=True, rl=False),
                      # the first grid's learning rate, against the cliffs of 1e-4's (issue learn-3: both rates)
                      Arm("SP (shared policy), warm start, lr 5e-4", ("policy.mode=shared", "train.role_grad_norms=true",
                                                                      "train.lr=0.0005"), warm_start=True),
                      Arm("IP (LoRA per role), warm start, lr 5e-4", ("policy.mode=lora_per_role", "train.lr=0.0005"),
                          warm_start=True)),
                     quick=("task.num_problems=12", "task.test_size=3"), flag_cliffs=True, eval_problems=EVAL_PROBLEMS,
                     warm_problems=STUDY_WARM_PROBLEMS, levels=arithmetic, default_level="one operation, operands <= 20",
                     calibration_arm=2)
          for wf in ("eval_opt", "voting")],
        # Dr. MAS on the study's Voting: per-role rewards (each generator its own answer, the aggregator its pick) give
        # the roles different reward distributions, the case where a team-wide baseline sits off each role's own.
        Comparison("adv_scope_voting", "Advantage normalisation per agent (Dr. MAS) vs team-wide: Voting, per-role "
                   "rewards, one shared policy, held-out problems (task.split=test)",
                   (*STUDY_COMMON, "workflow.name=voting", *STUDY_SIZES["voting"], "workflow.reward=per_role",
                    "policy.mode=shared", "train.role_grad_norms=true"),
                   (Arm("untrained team", rl=False, seed_free=True),
                    Arm("SP, per-role reward, agent-wise normalisation (the default), warm start", ("train.advantage_scope=agent",),
                        warm_start=True),
                    Arm("SP, per-role reward, team-wide normalisation, warm start", ("train.advantage_scope=team",),
                        warm_start=True)),
                   quick=("task.num_problems=12", "task.test_size=3"), eval_problems=EVAL_PROBLEMS,
                   warm_problems=STUDY_WARM_PROBLEMS, levels=arithmetic, default_level="one operation, operands <= 5",
                   calibrated_by="study_voting"),
        # prime-rl's reverse-text task (issue learn-4): a task nobody here tuned, the warm start from its demonstrations,
        # then RL at the shipped config's settings (lr 1e-4 and the default KL to the warm start), at grpo_word_count's lr
        # 5e-4 with that default, and at the old defaults that undid a newcomer's warm start (lr 5e-4, no KL). prime-rl's own figures
        # are another model's (Qwen3-0.6B, 0.05 -> ~0.8 after SFT + 20 RL steps). The held-out texts are the last 48
        # whatever the seed (task.test_size), so the untrained model is evaluated once.
        Comparison("reverse_text", "GRPO on reverse-text (prime-rl's task; LCS-ratio reward), SmolLM2-135M, 200 "
                   "demonstrations as the warm start, held-out texts (the last 48, task.split=test)",
                   (f"task.test_size={EVAL_PROBLEMS}",),
                   (Arm("untrained", rl=False, seed_free=True),
                    Arm("warm start only", warm_start=True, rl=False),
                    Arm("GRPO after the warm start (the shipped config: lr 1e-4, KL 0.5 to the warm start)",
                        warm_start=True),
                    Arm("GRPO after the warm start at lr 5e-4 (grpo_word_count's), the default KL to the warm start",
                        ("train.lr=0.0005",), warm_start=True),
                    Arm("GRPO after the warm start at lr 5e-4, no KL (the old defaults)",
                        ("train.lr=0.0005", "train.loss.kl_coef=0"), warm_start=True)),
                   quick=("task.num_problems=12", "task.test_size=3"), config="configs/grpo_reverse_text.yaml",
                   eval_problems=EVAL_PROBLEMS, warm_problems=200, warm_epochs=3),
        Comparison("reverse_text_team", "MAGRPO on reverse-text for two (head and tail each reverse their half, one LoRA "
                   "adapter each), 200 texts' demonstrations as the warm start, held-out texts (the last 48)",
                   (f"task.test_size={EVAL_PROBLEMS}",),
                   (Arm("untrained team", rl=False, seed_free=True),
                    Arm("warm start only", warm_start=True, rl=False),
                    Arm("MAGRPO after the warm start (the shipped config)", warm_start=True)),
                   quick=("task.num_problems=12", "task.test_size=3"), config="configs/magrpo_reverse_text.yaml",
                   eval_problems=EVAL_PROBLEMS, warm_problems=200, warm_epochs=3),
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
# Issue learn-3: 4x those episodes (Voting 30 steps x 4 problems, Eval-Opt 20 x 4), 96 new tokens, lr 1e-4.
# The held-out peak and cliffs: 16 of the held-out problems every 5 steps (from step 0, the warm start), ~30 s each.
STUDY_COMMON = ("algorithm=grpo", "task.name=math.solve", "task.num_problems=176", f"task.test_size={EVAL_PROBLEMS}",
                "rollout.group_size=4", "rollout.batch_size=4", "rollout.max_new_tokens=96", "train.eval_every=5",
                "train.eval_problems=16", "train.lr=0.0001")
STUDY_SIZES = {
    "eval_opt": ("train.steps=20", "workflow.options.max_iterations=2"),
    "voting": ("train.steps=30",),
}
STUDY_WARM_PROBLEMS = 32  # x 2 passes of each role's demonstration (Voting: 64 rows, Eval-Opt: 128)
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


def _policy_overrides(arm: Arm) -> tuple[str, ...]:
    """The arm's ``policy.*`` overrides: an arm with its own policy mode needs a warm start of that mode."""
    return tuple(o for o in arm.overrides if o.startswith("policy."))


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60]


# the fields of ArmResult that hold one entry per seed (every field but the label and the episode count)
PER_SEED = tuple(f.name for f in dataclasses.fields(ArmResult) if f.name not in ("label", "episodes"))


def merge(into: ArmResult, one: ArmResult) -> None:
    """Add one seed's run (``one``) to the arm's result over seeds."""
    for f in PER_SEED:
        getattr(into, f).extend(getattr(one, f))
    into.episodes = into.episodes or one.episodes
