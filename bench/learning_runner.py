"""The learning benchmark's runs (``bench/learning.py``): one (arm, seed) run, in this process or a child of
its own, and the warm starts the runs share."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from learning_grid import WARM_LR, WARM_PROBLEMS_QUICK, Arm, ArmResult, Comparison, Level, _config, _policy_overrides, _slug


def run_arm_in_process(comp: Comparison, index: int, seed: int, workdir: Path, eval_problems: int, quick: bool,
                       one_thread: bool, level: Level | None = None, cell: Path | None = None,
                       fingerprint: str = "") -> ArmResult:
    """One (arm, seed) run in a child process of its own (``--run-cell``), at one torch thread: its result. With
    ``cell``, the child writes the finished run's cell itself before it exits, so a run that finished is kept
    whatever happens to this process afterwards (a parent of older code that cannot read it, a stopped grid)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"} if one_thread else None
    cmd = [sys.executable, str(Path(__file__).resolve().with_name("learning.py")), "--run-cell", comp.key, str(index), str(seed), "--workdir",
           str(workdir), "--eval", str(eval_problems), *(["--level", level.label] if level else []),
           *(["--quick"] if quick else []), *(["--one-thread"] if one_thread else []),
           *(["--cell", str(cell), "--fingerprint", fingerprint] if cell is not None else [])]
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"bench --learning: {comp.key} arm {index} seed {seed} failed (exit {done.returncode}); "
                           f"its traceback is above; rerun alone with: {' '.join(cmd)}")
    fields = json.loads(done.stdout.strip().splitlines()[-1])
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(ArmResult)})
    if unknown:
        raise RuntimeError(f"bench --learning: {comp.key} arm {index} seed {seed} returned fields {unknown} this grid's "
                           "ArmResult does not have (the bench's code changed under a running grid); "
                           + (f"its cell is kept in {cell}: run the grid again to read it" if cell else "rerun it"))
    return ArmResult(**fields)


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
    from teamrl.trainer.sft import run_demonstrations, warm_start

    policy = _policy_overrides(arm) if arm else ()
    warm_dir = warm_start_dir(comp, seed, workdir, level, arm)
    name = warm_dir.name
    with open(workdir / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (warm_dir / "seconds").is_file():
            cfg = _config(comp, Arm("warm start", policy), quick, one_thread, seed, workdir, name, level=level)
            t0 = time.perf_counter()
            task = make_task(cfg.task)
            demos = run_demonstrations(cfg, task, task.problems()[:WARM_PROBLEMS_QUICK if quick else comp.warm_problems])
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
        # the trainer's gradient norm per role type, over the steps that updated it
        norms = _series(steps, "role_grad_norm/")
        result.role_grad_norms.append({role: statistics.mean(v) for role, v in sorted(norms.items())})
        result.grad_norms.append([max(v for k, v in m.items() if k.startswith("grad_norm/")) for m in steps
                                  if any(k.startswith("grad_norm/") for k in m)])
        result.eval_curves.append([[m["step"], m["eval/accuracy"]] for m in metrics if "eval/accuracy" in m])
        result.role_local_rewards.append(_series(steps, "local_reward/"))
    else:
        result.grad_norms.append([])
        result.eval_curves.append([])
        result.role_local_rewards.append({})
        result.signal.append(None)
        result.signal_groups.append([0, 0])
        result.role_grad_norms.append({})
    held, _ = held_out_config(cfg)
    method = arm.method or ("team" if (arm.rl or arm.warm_start) else "untrained")
    row, *also = evaluate(held, [method, *arm.also_eval], checkpoint=workdir / name if method == "team" else None,
                          limit=eval_problems, progress=False)
    extra = {x.method: _scored(ArmResult(arm.label, seeds=[seed], wall=[x.seconds_per_problem * x.problems], tokens=[trained_tokens],
                                         signal=[None], signal_groups=[[0, 0]], role_grad_norms=[{}], grad_norms=[[]],
                                         eval_curves=[[]], role_local_rewards=[{}]), x)
             for x in also}
    result.also.append({m: dataclasses.asdict(r) for m, r in extra.items()})  # the same trained run, other methods: no second training
    result.seeds.append(seed)
    # each warm-started arm carries the warm start's cost; the extra methods' evaluations are their rows' own
    result.wall.append(time.perf_counter() - t0 + warm_seconds - sum(r.wall[0] for r in extra.values()))
    result.tokens.append(trained_tokens)
    _scored(result, row)


def _series(steps: list[dict], prefix: str) -> dict[str, list[float]]:
    """The step metrics named ``<prefix><name>``: name -> its values, over the steps that logged it."""
    out: dict[str, list[float]] = {}
    for m in steps:
        for k, v in m.items():
            if k.startswith(prefix):
                out.setdefault(k[len(prefix):], []).append(v)
    return out


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
    own: dict[str, list[float]] = {}
    for episode in row.episodes:
        for call in episode["calls"]:
            if call["own_reward"] is not None:
                own.setdefault(call["role"], []).append(call["own_reward"])
    result.held_out_own_rewards.append({role: {"mean": statistics.mean(v), "at_one": sum(x >= 1.0 for x in v) / len(v)}
                                        for role, v in sorted(own.items())})
    return result
