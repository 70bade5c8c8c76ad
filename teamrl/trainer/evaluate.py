"""``teamrl eval``: the trained team vs the untrained team and prompt baselines, same task, reward and base model.

A run trained with ``workflow.name`` is evaluated with its workflow: ``team`` (the checkpoint's
weights), ``untrained`` (the same workflow on the base weights) and ``single`` (the ``single``
workflow on the base weights), each row with the workflow's own statistics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from teamrl.algorithms import make_algorithm, workflow_settings
from teamrl.algorithms.grpo import outcome_metrics
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
from teamrl.tasks.task import Task, TeamTask, checked_reward, reply_valid
from teamrl.trainer.checkpoint import list_checkpoints, load_checkpoint
from teamrl.workflows import WORKFLOWS, EpisodeOutcome
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.env_episode import play
from teamrl.workflows.research_team import research_single, research_team
from teamrl.workflows.team_baselines import BASELINES, parallel, single

EVAL_METHODS = ("team", "single", "concat", "sequential", "discussion", "untrained", "swapped")
ENV_METHODS = ("team", "untrained", "single", "swapped")
RESEARCH_METHODS = ("team", "untrained", "single")
WORKFLOW_METHODS = ("team", "untrained", "single")
BASE = "__base__"  # the policy name that routes to the base model (adapters off)
# the workflows whose statistics outcome_metrics summarises; any other workflow's numeric stats are reported as means
SUMMARISED_WORKFLOWS = ("eval_opt", "voting", "orch_workers", "single")


@dataclass
class EvalRow:
    method: str
    mean: float       # normalised return, mean over problems
    stderr: float
    problems: int
    tokens_per_s: float
    seconds_per_problem: float
    pass_at_1: float | None = None  # for tasks that can say whether an answer is fully correct
    valid: float | None = None  # share of replies the task reads as a valid answer/action (None: the task cannot tell)
    replies_per_problem: float = 0.0
    scores: list[float] = field(default_factory=list)  # normalised return per problem, in problem order
    stats: dict[str, float] = field(default_factory=dict)  # a workflow run's diagnostics (accuracy, verdicts, votes, ...)


@dataclass(frozen=True)
class Comparison:
    """The paired difference ``trained - untrained`` over the same problems."""

    trained: str
    untrained: str
    difference: float
    stderr: float
    problems: int

    @property
    def beyond_noise(self) -> bool:
        """Whether the difference exceeds two standard errors of the paired difference."""
        return abs(self.difference) > 2 * self.stderr


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error of the mean; 0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, std / math.sqrt(n)


def compare(rows: Sequence[EvalRow], trained: str = "team", untrained: str = "untrained") -> Comparison | None:
    """The paired comparison of the ``trained`` and ``untrained`` rows (None when either is missing)."""
    by = {r.method: r for r in rows}
    if trained not in by or untrained not in by:
        return None
    a, b = by[trained].scores, by[untrained].scores
    if len(a) != len(b) or not a:
        raise ValueError(f"compare: rows {trained!r} and {untrained!r} scored {len(a)} and {len(b)} problems; "
                         "a paired comparison needs the same problems")
    diff, se = mean_and_stderr([x - y for x, y in zip(a, b)])
    return Comparison(trained, untrained, diff, se, len(a))


def format_comparison(c: Comparison) -> str:
    """One line: the paired difference, its standard error and whether it exceeds the noise."""
    verdict = "exceeds 2 standard errors" if c.beyond_noise else "within 2 standard errors (not distinguishable from noise)"
    return (f"{c.trained} - {c.untrained}: {c.difference:+.3f} +/- {c.stderr:.3f} normalised return "
            f"(paired over the same {c.problems} problems): {verdict}")


def workflow_stats(workflow: str, outcomes: Sequence[EpisodeOutcome]) -> dict[str, float]:
    """The study diagnostics of :func:`outcome_metrics` and, for a user's workflow, the mean of every
    numeric (or boolean) entry of ``EpisodeOutcome.stats`` (text entries cannot be averaged)."""
    out = outcome_metrics(workflow, outcomes)
    if workflow in SUMMARISED_WORKFLOWS:
        return out
    keys = dict.fromkeys(k for o in outcomes for k in o.stats)
    for k in keys:
        values = [o.stats.get(k) for o in outcomes]
        if all(isinstance(v, (bool, int, float)) and math.isfinite(v) for v in values):
            out.setdefault(k, sum(float(v) for v in values) / len(values))
    return out


def held_out_config(cfg: Config) -> tuple[Config, str]:
    """(the config with the task's held-out problems, what they are): ``task.split=test`` where the
    task has a split option, else a fresh ``task.seed`` where it generates its problems, else the
    training problems themselves (said so)."""
    from teamrl.tasks import TASKS

    fields = getattr(TASKS.get_entry(cfg.task.get("name"), "task.name").Options, "__dataclass_fields__", {})
    if "split" in fields:
        return dataclasses.replace(cfg, task={**cfg.task, "split": "test"}), "held-out problems (task.split=test)"
    if "seed" in fields:
        seed = int(cfg.task.get("seed", fields["seed"].default)) + 1
        return dataclasses.replace(cfg, task={**cfg.task, "seed": seed}), f"held-out problems (freshly generated: task.seed={seed})"
    return cfg, "the training problems (the task holds none out)"


@dataclass(frozen=True)
class NamedWorkflow:
    """A run's ``workflow.name``: the workflow, the settings it receives and its roles."""

    workflow: str
    settings: Any
    roles: tuple[str, ...]


def _workflow_algorithm(cfg: Config, task: Any) -> NamedWorkflow | None:
    """The run's named workflow (``workflow.name``), or None."""
    if not cfg.workflow.name:
        return None
    make_algorithm(cfg, task)  # checks the workflow name, options and task kind as train does
    spec = WORKFLOWS.get_entry(cfg.workflow.name, "workflow.name")
    return NamedWorkflow(cfg.workflow.name, workflow_settings(cfg), spec.roles_for(task))


def evaluate(cfg: Config, methods: list[str], checkpoint: Path | None = None, limit: int = 20,
             temperature: float = 0.0, progress: bool = True) -> list[EvalRow]:
    """Run each method on the first ``limit`` evaluation problems and return one row per method.

    ``team`` runs every role with its trained policy (the checkpoint's); ``untrained`` the same
    team on the base model; the baselines run the base model (adapters disabled) with the prompts
    of :mod:`teamrl.workflows.team_baselines`. A ``workflow.name`` run takes team, untrained and
    single (the ``single`` workflow).
    """
    bad = [m for m in methods if m not in EVAL_METHODS]
    if bad:
        raise ConfigError(f"--method: {bad[0]!r} is not known; choose from {list(EVAL_METHODS)}")
    task = make_task(cfg.task)
    study = _workflow_algorithm(cfg, task)
    if study is not None and set(methods) - set(WORKFLOW_METHODS):
        raise ConfigError(f"--method: workflow {cfg.workflow.name!r} takes {list(WORKFLOW_METHODS)}")
    if study is None and isinstance(task, Task) and {"concat", "sequential", "discussion", "swapped"} & set(methods):
        raise ConfigError(f"--method: task {task.name!r} has one agent; use team, untrained and single")
    if isinstance(task, ResearchEnv) and set(methods) - set(RESEARCH_METHODS):
        raise ConfigError(f"--method: the research environment takes {list(RESEARCH_METHODS)}")
    if isinstance(task, Environment) and set(methods) - set(ENV_METHODS):
        raise ConfigError(f"--method: environment {task.name!r} takes {list(ENV_METHODS)}")
    if isinstance(task, TeamTask) and "swapped" in methods:
        raise ConfigError("--method: swapped is for environments (roles acting on one state in turn)")
    if {"team", "swapped"} & set(methods) and checkpoint is None:
        raise ConfigError("--method team needs --checkpoint RUN_DIR (a trained run); the untrained team is the untrained method")
    seed_everything(cfg.seed)
    roles = list(study.roles) if study is not None else list(task.roles)
    if isinstance(task, ResearchEnv) and cfg.m_grpo.agents == "single":
        roles = ["main"]  # the single-agent baseline trains no sub-agent: its checkpoint has no 'sub' policy
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
    if not problems:
        raise ConfigError(f"task {task.name!r}: no problems to evaluate (check task.split / task.test_size / --limit)")
    max_reward = getattr(task, "max_reward", 1.0)
    rows = []
    for method in methods:
        route = router.policy_name if method == "team" else (lambda role: BASE)
        if study is not None:
            spec = WORKFLOWS.get_entry("single" if method == "single" else study.workflow, "workflow.name")
            workflow = (lambda ctx, t, p, _run=spec.run: _run(ctx, t, p, study.settings))
        elif isinstance(task, ResearchEnv):
            # team: the trained agents (main + sub, or the single agent of an m_grpo.agents=single run);
            # untrained: main + sub on the base model; single: one agent with the tools, base model
            solo = method == "single" or (method == "team" and cfg.m_grpo.agents == "single")
            workflow = research_single if solo else research_team
        elif isinstance(task, Environment):
            workflow, route = _env_method(task, router, method)
        elif method in ("team", "untrained"):  # the trained team and the same team on the base weights
            workflow = single if isinstance(task, Task) else parallel
        else:
            workflow = BASELINES[method]
        scheduler = GenerationScheduler(engine, seed=derive_seed(cfg.seed, 7))
        # One agent writing every part of a team task gets the whole team's token budget.
        widen = method == "single" and isinstance(task, TeamTask)
        p_method = SamplingParams(**{**params.__dict__, "max_new_tokens": params.max_new_tokens * len(roles)}) if widen else params
        ctxs = [EpisodeContext(scheduler, route, router.tokenizer, p_method, p.id, 0) for p in problems]
        t0 = time.perf_counter()
        if progress:
            print(f"[teamrl eval] {method}: {len(problems)} problems ...", file=sys.stderr, flush=True)
        with torch.no_grad():
            outputs = scheduler.run([workflow(c, task, p) for c, p in zip(ctxs, problems)])
        wall = time.perf_counter() - t0
        scores = []
        for p, out in zip(problems, outputs):
            if isinstance(task, ResearchEnv) or study is not None:
                r = out.reward
            elif isinstance(task, Environment):
                r = task.team_reward(out)
            else:
                r = task.reward(p, out["agent"]) if isinstance(task, Task) else task.reward(p, out)
                r = checked_reward(task.name, f"reward(problem {p.id!r})", r)
            scores.append(r / max_reward)
        n = len(scores)
        mean, stderr = mean_and_stderr(scores)
        replies = [s for c in ctxs for s in c.samples]
        tokens = sum(len(s.completion_ids) for s in replies)
        passed, stats = None, {}
        if study is not None:
            stats = workflow_stats("single" if method == "single" else study.workflow, outputs)
            passed = stats["accuracy"]
        elif isinstance(task, ResearchEnv):
            passed = sum(out.correct for out in outputs) / n
        elif isinstance(task, Environment):
            passed = sum(bool(task.success(out)) for out in outputs) / n
        elif hasattr(task, "passed"):  # coding tasks: share of problems whose answer passes every test
            passed = sum(bool(task.passed(p, out)) for p, out in zip(problems, outputs)) / n
        by_id = {p.id: p for p in problems}
        verdicts = [v for v in (reply_valid(task, by_id[c.problem_id], s.text) for c in ctxs for s in c.samples) if v is not None]
        valid = sum(verdicts) / len(verdicts) if verdicts else None
        rows.append(EvalRow(method, mean, stderr, n, tokens / wall, wall / n, passed, valid, len(replies) / n, scores, stats))
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
    """A Markdown table of the rows; a workflow run's statistics follow in a second table (one
    column per method), and the paired trained-vs-untrained comparison in one line."""
    with_pass = any(r.pass_at_1 is not None for r in rows)
    with_valid = any(r.valid is not None for r in rows)
    head = ("| method | normalised return (mean +/- stderr) |" + (" pass@1 / success |" if with_pass else "")
            + (" valid replies |" if with_valid else ""))
    lines = [head + " problems | generated tokens/s | s / problem |", "|---" * (head.count("|") + 2) + "|"]
    for r in rows:
        p = (f" {r.pass_at_1:.3f} |" if r.pass_at_1 is not None else " - |") if with_pass else ""
        v = (f" {r.valid:.3f} |" if r.valid is not None else " - |") if with_valid else ""
        lines.append(f"| {r.method} | {r.mean:.3f} +/- {r.stderr:.3f} |{p}{v} {r.problems} | {r.tokens_per_s:.0f} | {r.seconds_per_problem:.2f} |")
    keys = list(dict.fromkeys(k for r in rows for k in r.stats))
    if keys:
        lines += ["", "| statistic | " + " | ".join(r.method for r in rows) + " |", "|---" * (len(rows) + 1) + "|"]
        lines += [f"| {k} | " + " | ".join(f"{r.stats[k]:.3f}" if k in r.stats else "-" for r in rows) + " |" for k in keys]
    comparison = compare(rows)
    if comparison is not None:
        lines += ["", format_comparison(comparison)]
    return "\n".join(lines)
