"""``teamrl eval``: the trained team vs prompt baselines, same task, reward and base model."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from teamrl.core.config import Config, ConfigError
from teamrl.core.seeding import derive_seed, seed_everything
from teamrl.policies.multi_lora import SharedBaseAdapters
from teamrl.policies.router import PolicyRouter
from teamrl.rollout.engine import SamplingParams
from teamrl.rollout.hf_engine import HFEngine
from teamrl.rollout.scheduler import GenerationScheduler
from teamrl.tasks import make_task
from teamrl.tasks.environment import Environment
from teamrl.tasks.research import ResearchEnv
from teamrl.tasks.task import Task, TeamTask, checked_reward
from teamrl.trainer.checkpoint import list_checkpoints, load_checkpoint
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.env_episode import play
from teamrl.workflows.research_team import research_single, research_team
from teamrl.workflows.team_baselines import BASELINES, parallel, single

EVAL_METHODS = ("team", "single", "concat", "sequential", "discussion", "untrained", "swapped")
ENV_METHODS = ("team", "untrained", "single", "swapped")
RESEARCH_METHODS = ("team", "untrained", "single")
BASE = "__base__"  # the policy name that routes to the base model (adapters off)


@dataclass
class EvalRow:
    method: str
    mean: float       # normalised return, mean over problems
    stderr: float
    problems: int
    tokens_per_s: float
    seconds_per_problem: float
    pass_at_1: float | None = None  # for tasks that can say whether an answer is fully correct


def evaluate(cfg: Config, methods: list[str], checkpoint: Path | None = None, limit: int = 20,
             temperature: float = 0.0, progress: bool = True) -> list[EvalRow]:
    """Run each method on the first ``limit`` evaluation problems and return one row per method.

    ``team`` runs every role with its trained policy (the checkpoint's); the baselines run the
    base model (adapters disabled) with the prompts of :mod:`teamrl.workflows.team_baselines`.
    """
    bad = [m for m in methods if m not in EVAL_METHODS]
    if bad:
        raise ConfigError(f"--method: {bad[0]!r} is not known; choose from {list(EVAL_METHODS)}")
    task = make_task(cfg.task)
    if isinstance(task, Task) and {"concat", "sequential", "discussion", "untrained", "swapped"} & set(methods):
        raise ConfigError(f"--method: task {task.name!r} has one agent; use team and single")
    if isinstance(task, ResearchEnv) and set(methods) - set(RESEARCH_METHODS):
        raise ConfigError(f"--method: the research environment takes {list(RESEARCH_METHODS)}")
    if isinstance(task, Environment) and set(methods) - set(ENV_METHODS):
        raise ConfigError(f"--method: environment {task.name!r} takes {list(ENV_METHODS)}")
    if isinstance(task, TeamTask) and {"untrained", "swapped"} & set(methods):
        raise ConfigError("--method: untrained and swapped are for environments; for team tasks the untrained team is concat")
    if {"team", "swapped"} & set(methods) and checkpoint is None:
        raise ConfigError("--method team needs --checkpoint RUN_DIR (a trained run); the untrained team is the concat baseline")
    seed_everything(cfg.seed)
    roles = list(task.roles)
    router = PolicyRouter(cfg.policy.mode, roles, cfg.model, cfg.policy.lora, lr=cfg.train.lr, seed=cfg.seed,
                          need_reference=cfg.policy.lora is None, device=cfg.policy.device, dtype=cfg.policy.dtype,
                          role_map=cfg.policy.roles)
    if checkpoint is not None:
        ckpts = list_checkpoints(Path(checkpoint) / "checkpoints")
        if not ckpts:
            raise FileNotFoundError(f"--checkpoint {checkpoint}: no checkpoints/step_N folder in it")
        load_checkpoint(ckpts[-1], router)

    def models(name: str) -> contextlib.AbstractContextManager:
        if name == BASE:
            return next(iter(router.policies.values())).reference()
        return router.policies[name].generation_model()

    engine = HFEngine(models, router.tokenizer, device=router.device, row_models=SharedBaseAdapters(router.policies))
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=temperature, top_p=cfg.rollout.top_p,
                            top_k=cfg.rollout.top_k, stop=tuple(cfg.rollout.stop))
    problems = task.problems()[:limit]
    max_reward = getattr(task, "max_reward", 1.0)
    rows = []
    for method in methods:
        if isinstance(task, ResearchEnv):
            # team: the trained agents (main + sub, or the single agent of an m_grpo.agents=single run);
            # untrained: main + sub on the base model; single: one agent with the tools, base model
            solo = method == "single" or (method == "team" and cfg.m_grpo.agents == "single")
            workflow = research_single if solo else research_team
            route = router.policy_name if method == "team" else (lambda role: BASE)
        elif isinstance(task, Environment):
            workflow, route = _env_method(task, router, method)
        else:
            workflow = (single if isinstance(task, Task) else parallel) if method == "team" else BASELINES[method]
            route = router.policy_name if method == "team" else (lambda role: BASE)
        scheduler = GenerationScheduler(engine, seed=derive_seed(cfg.seed, 7))
        # One agent writing every part gets the whole team's token budget.
        p_method = params if method != "single" or isinstance(task, ResearchEnv) else SamplingParams(**{**params.__dict__, "max_new_tokens": params.max_new_tokens * len(roles)})
        ctxs = [EpisodeContext(scheduler, route, router.tokenizer, p_method, p.id, 0) for p in problems]
        t0 = time.perf_counter()
        if progress:
            print(f"[teamrl eval] {method}: {len(problems)} problems ...", file=sys.stderr, flush=True)
        with torch.no_grad():
            outputs = scheduler.run([workflow(c, task, p) for c, p in zip(ctxs, problems)])
        wall = time.perf_counter() - t0
        scores = []
        for p, out in zip(problems, outputs):
            if isinstance(task, ResearchEnv):
                r = out.reward
            elif isinstance(task, Environment):
                r = task.team_reward(out)
            else:
                r = task.reward(p, out["agent"]) if isinstance(task, Task) else task.reward(p, out)
                r = checked_reward(task.name, f"reward(problem {p.id!r})", r)
            scores.append(r / max_reward)
        n = len(scores)
        mean = sum(scores) / n
        std = math.sqrt(sum((s - mean) ** 2 for s in scores) / (n - 1)) if n > 1 else 0.0
        tokens = sum(len(s.completion_ids) for c in ctxs for s in c.samples)
        passed = None
        if isinstance(task, ResearchEnv):
            passed = sum(out.correct for out in outputs) / n
        elif isinstance(task, Environment):
            passed = sum(bool(task.success(out)) for out in outputs) / n
        elif hasattr(task, "passed"):  # coding tasks: share of problems whose answer passes every test
            passed = sum(bool(task.passed(p, out)) for p, out in zip(problems, outputs)) / n
        rows.append(EvalRow(method, mean, std / math.sqrt(n), n, tokens / wall, wall / n, passed))
    return rows


def _env_method(env: Environment, router: PolicyRouter, method: str):
    """(workflow, route) of an evaluation method on an environment.

    team: each role with its own trained policy; untrained: the base model for every role
    (the prompt-only team); single: only the last role acts (one agent doing the task alone),
    base model; swapped: each role with the next role's trained policy (specialisation check;
    a no-op under a shared policy).
    """
    roles = list(env.roles)
    if method == "team":
        return (lambda ctx, e, p: play(ctx, e, p)), router.policy_name
    if method == "untrained":
        return (lambda ctx, e, p: play(ctx, e, p)), (lambda role: BASE)
    if method == "single":
        return (lambda ctx, e, p: play(ctx, e, p, roles=roles[-1:])), (lambda role: BASE)
    swap = {r: roles[(i + 1) % len(roles)] for i, r in enumerate(roles)}
    return (lambda ctx, e, p: play(ctx, e, p)), (lambda role: router.policy_name(swap[role]))


def format_table(rows: list[EvalRow]) -> str:
    """A Markdown table of the rows."""
    with_pass = any(r.pass_at_1 is not None for r in rows)
    head = "| method | normalised return (mean +/- stderr) |" + (" pass@1 / success |" if with_pass else "")
    lines = [head + " problems | generated tokens/s | s / problem |", "|---" * (head.count("|") + 2) + "|"]
    for r in rows:
        p = (f" {r.pass_at_1:.3f} |" if r.pass_at_1 is not None else " - |") if with_pass else ""
        lines.append(f"| {r.method} | {r.mean:.3f} +/- {r.stderr:.3f} |{p} {r.problems} | {r.tokens_per_s:.0f} | {r.seconds_per_problem:.2f} |")
    return "\n".join(lines)
