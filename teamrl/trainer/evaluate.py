"""``teamrl eval``: the trained team vs the untrained team and baselines, same task, reward and base model.

Every method runs a workflow through the episode protocol (:func:`~teamrl.workflows.episode.run_episode`):
``team`` is the run's workflow (:func:`~teamrl.algorithms.workflow_name`) with the checkpoint's
weights, ``untrained`` the same workflow on the base weights, and the baselines are those declared
for that workflow (:func:`~teamrl.workflows.eval_baselines`); a method the workflow has no baseline
for is refused with the methods it takes. An episode's score is its team return over the task's
``max_reward``; pass@1 / success is the share of episodes whose outcome is correct, where the
workflow returns an :class:`~teamrl.workflows.EpisodeOutcome`.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from teamrl.algorithms import workflow_name, workflow_settings
from teamrl.algorithms.episodes import workflow_settings as default_settings
from teamrl.algorithms.grpo import outcome_metrics
from teamrl.core.config import Config, ConfigError
from teamrl.core.seeding import derive_seed, seed_everything
from teamrl.policies.multi_lora import SharedBaseAdapters
from teamrl.policies.router import PolicyRouter
from teamrl.rollout.engine import SamplingParams
from teamrl.rollout.hf_engine import HFEngine
from teamrl.rollout.scheduler import GenerationScheduler
from teamrl.tasks import make_task
from teamrl.tasks.task import reply_valid
from teamrl.trainer.checkpoint import list_checkpoints, load_checkpoint
from teamrl.workflows import WORKFLOWS, Baseline, EpisodeOutcome, check_task, eval_baselines
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.episode import run_episode

EVAL_METHODS = ("team", "single", "concat", "sequential", "discussion", "untrained", "swapped")
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
class RunWorkflow:
    """The workflow a run trained (``workflow.name`` or the task's default), its settings, roles and eval methods."""

    name: str
    settings: Any
    roles: tuple[str, ...]
    methods: dict[str, Baseline]  # every method it takes: team, untrained and its declared baselines


def run_workflow(cfg: Config, task: Any) -> RunWorkflow:
    """The run's workflow, checked against the task (and its ``workflow.options``) as train checks it.
    Without ``workflow.name`` it runs with its default settings (one team turn: the normalised return of
    a turn's joint answer); a workflow with a ``pass_at_1`` option is asked for its test verdict."""
    name = workflow_name(cfg, task)
    spec = WORKFLOWS.get_entry(name, "workflow.name")
    check_task(name, spec, task)
    settings = workflow_settings(cfg) if cfg.workflow.name else default_settings(spec)
    if dataclasses.is_dataclass(settings) and "pass_at_1" in {f.name for f in dataclasses.fields(settings)}:
        settings = dataclasses.replace(settings, pass_at_1=True)
    own = {"team": Baseline(name, None, weights="trained"), "untrained": Baseline(name, None)}
    return RunWorkflow(name, settings, spec.roles_for(task), {**own, **eval_baselines(name)})


def default_methods(cfg: Config, has_checkpoint: bool) -> list[str]:
    """What ``teamrl eval`` runs when no ``--method`` is given: ``team`` (with a checkpoint), ``untrained``
    and the run's workflow's default baselines."""
    run = run_workflow(cfg, make_task(cfg.task))
    return [m for m, b in run.methods.items() if (m != "team" or has_checkpoint) and b.by_default]


def _method_checked(run: RunWorkflow, method: str, task: Any) -> Baseline:
    """The method's :class:`Baseline`, or a one-line refusal naming what the run's workflow takes."""
    if method not in EVAL_METHODS:
        raise ConfigError(f"--method: {method!r} is not known; choose from {list(EVAL_METHODS)}")
    baseline = run.methods.get(method)
    if baseline is None:
        raise ConfigError(f"--method {method}: workflow {run.name!r} has no {method} baseline; it takes {list(run.methods)}")
    if baseline.workflow is not None:
        try:
            check_task(baseline.name, baseline.workflow, task)
        except ConfigError as e:
            raise ConfigError(f"--method {method} (workflow {run.name!r}): {e}") from None
    return baseline


def _route(baseline: Baseline, router: PolicyRouter, roles: Sequence[str]) -> Callable[[str], str]:
    """Which policy each role's calls go to: trained, base (adapters off), or the next role's trained policy."""
    if baseline.weights == "trained":
        return router.policy_name
    if baseline.weights == "swapped":
        swap = {r: roles[(i + 1) % len(roles)] for i, r in enumerate(roles)}
        return lambda role: router.policy_name(swap.get(role, role))
    return lambda role: BASE


def evaluate(cfg: Config, methods: list[str], checkpoint: Path | None = None, limit: int = 20,
             temperature: float = 0.0, progress: bool = True) -> list[EvalRow]:
    """Run each method on the first ``limit`` evaluation problems and return one row per method.

    ``team`` runs the run's workflow with every role on its trained policy (the checkpoint's);
    ``untrained`` the same workflow on the base model; the baselines are the run's workflow's
    (:func:`~teamrl.workflows.eval_baselines`), on the base model (``swapped``: each role on the
    next role's trained policy).
    """
    task = make_task(cfg.task)
    run = run_workflow(cfg, task)
    chosen = {m: _method_checked(run, m, task) for m in methods}
    if any(b.weights != "base" for b in chosen.values()) and checkpoint is None:
        raise ConfigError("--method team needs --checkpoint RUN_DIR (a trained run); the untrained team is the untrained method")
    seed_everything(cfg.seed)
    roles = list(run.roles)
    router = PolicyRouter(cfg.policy.mode, roles, cfg.model, cfg.policy.lora, lr=cfg.train.lr, seed=cfg.seed,
                          need_reference=cfg.policy.lora is None, device=cfg.policy.device, dtype=cfg.policy.dtype,
                          role_map=cfg.policy.roles)
    if checkpoint is not None:
        ckpts = list_checkpoints(Path(checkpoint) / "checkpoints")
        if not ckpts:
            raise FileNotFoundError(f"--checkpoint {checkpoint}: no checkpoints/step_N folder in it")
        load_checkpoint(ckpts[-1], router)

    def models(name: str):
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
    for method, baseline in chosen.items():
        run_fn = (baseline.workflow or WORKFLOWS.get_entry(run.name, "workflow.name")).run
        settings = run.settings if baseline.workflow is None else None
        scheduler = GenerationScheduler(engine, seed=derive_seed(cfg.seed, 7))
        # One agent writing every part of a team task gets the whole team's token budget.
        p_method = dataclasses.replace(params, max_new_tokens=params.max_new_tokens * len(roles)) if baseline.widen else params
        ctxs = [EpisodeContext(scheduler, _route(baseline, router, roles), router.tokenizer, p_method, p.id, 0) for p in problems]
        for ctx in ctxs:
            ctx.workflow = baseline.name
        t0 = time.perf_counter()
        if progress:
            print(f"[teamrl eval] {method}: {len(problems)} problems ...", file=sys.stderr, flush=True)
        with torch.no_grad():
            results = scheduler.run([run_episode(lambda c, _p=p: run_fn(c, task, _p, settings), ctx)
                                     for p, ctx in zip(problems, ctxs)])
        wall = time.perf_counter() - t0
        scores = [r.team_return / max_reward for r in results]
        n = len(scores)
        mean, stderr = mean_and_stderr(scores)
        replies = [s for c in ctxs for s in c.samples]
        tokens = sum(len(s.completion_ids) for s in replies)
        outcomes = [r.outcome for r in results if r.outcome is not None]
        stats = workflow_stats(baseline.name, outcomes) if len(outcomes) == n else {}
        passed = stats.get("accuracy")
        by_id = {p.id: p for p in problems}
        verdicts = [v for v in (reply_valid(task, by_id[c.problem_id], s.text) for c in ctxs for s in c.samples) if v is not None]
        valid = sum(verdicts) / len(verdicts) if verdicts else None
        rows.append(EvalRow(method, mean, stderr, n, tokens / wall, wall / n, passed, valid, len(replies) / n, scores, stats))
    return rows


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
