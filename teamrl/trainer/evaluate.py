"""``teamrl eval``: the trained team vs the untrained team and baselines, same task, reward and base model.

Every method runs a workflow through the episode protocol (:func:`~teamrl.workflows.episode.run_episode`):
``team`` is the run's workflow (:func:`~teamrl.algorithms.workflow_name`) with the checkpoint's
weights, ``untrained`` the same workflow on the base weights, and the baselines are those declared
for that workflow (:func:`~teamrl.workflows.eval_baselines`); a method the workflow has no baseline
for is refused with the methods it takes. An episode's score is its team return over the task's
``max_reward``; pass@1 / success is the share of episodes whose outcome is correct, where the
workflow returns an :class:`~teamrl.workflows.EpisodeOutcome`. Each row keeps every problem's episode
(:func:`episode_record`); :func:`write_results` saves them with the figures (``results.json`` and one
``<method>.jsonl`` per method), which ``teamrl eval`` does into :func:`eval_output_dir`.

A run warm-started by ``teamrl sft`` also has a ``warm_start`` row (the same workflow on the warm
start's weights, kept in ``RUN_DIR/warm_start/``), and its comparisons say what RL itself did
(``team - warm start``) apart from what the warm start did (``warm start - untrained``):
:func:`paired_comparisons`. ``baseline`` is the same workflow on any other checkpoint's weights
(``teamrl eval --baseline``), paired with ``team`` over the same problems.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from teamrl.algorithms import configured_workflow_options, workflow_name
from teamrl.algorithms.episodes import workflow_options_or_defaults
from teamrl.core.config import Config, ConfigError
from teamrl.core.metrics import ProgressLines
from teamrl.policies.models import check_max_new_tokens
from teamrl.core.seeding import derive_seed, rng_state, seed_everything, set_rng_state
from teamrl.policies.multi_lora import SharedBaseAdapters
from teamrl.policies.router import PolicyRouter
from teamrl.rollout.engine import SamplingParams
from teamrl.rollout.hf_engine import HFEngine
from teamrl.rollout.scheduler import GenerationScheduler
from teamrl.tasks import make_task
from teamrl.tasks.task import reply_valid
from teamrl.trainer.checkpoint import (CheckpointMismatch, load_checkpoint, resolve_checkpoint, settings_mismatch,
                                      warm_start_checkpoint, warm_start_of)
from teamrl.workflows import WORKFLOWS, Baseline, EpisodeOutcome, Workflow, check_task, eval_baselines, outcome_metrics
from teamrl.workflows.context import EpisodeContext, RewardEvent
from teamrl.workflows.episode import run_episode
from teamrl.workflows.outcome import own_reward, stat_means

EVAL_METHODS = (
    "team", "warm_start", "baseline", "single", "concat", "sequential", "discussion", "untrained", "swapped"
)
# the methods that run the run's own workflow on a checkpoint's weights, and which one: --checkpoint's, the run's warm
# start, --baseline's
CHECKPOINT_WEIGHTS = ("trained", "warm_start", "baseline")
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
    # share of judged replies in their role's format (reply_valid; None: nothing could be judged)
    valid: float | None = None
    replies_per_problem: float = 0.0
    scores: list[float] = field(default_factory=list)  # normalised return per problem, in problem order
    # a workflow run's diagnostics (accuracy, verdicts, votes, ...)
    stats: dict[str, float] = field(default_factory=dict)
    # per problem, in problem order: :func:`episode_record`
    episodes: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""  # a line the table opens with: :func:`training_problems_note`
    scored_by: str = ""  # what its scores measure (:func:`score_measure`); rows that differ are not comparable
    weights: str = ""  # the checkpoint folder its weights came from ('' for the base weights)


@dataclass(frozen=True)
class Comparison:
    """The paired difference ``trained - untrained`` (two rows' methods) over the same problems."""

    trained: str
    untrained: str
    difference: float
    stderr: float
    problems: int
    same_measure: bool = True  # both rows scored by one measure (else the difference compares unlike numbers)
    note: str = ""  # what the difference measures (RL's own effect, ...) or which checkpoint, shown after the names

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
    return Comparison(trained, untrained, diff, se, len(a), by[trained].scored_by == by[untrained].scored_by)


# how a comparison line names a method (the row keeps its method name)
COMPARISON_LABELS = {"warm_start": "warm start"}


def format_comparison(c: Comparison) -> str:
    """One line: the paired difference, its standard error and whether it exceeds the noise."""
    verdict = (
        "exceeds 2 standard errors" if c.beyond_noise else "within 2 standard errors (not distinguishable from noise)"
    )
    unlike = "" if c.same_measure else " [scored by different measures: not comparable]"
    names = " - ".join(COMPARISON_LABELS.get(m, m) for m in (c.trained, c.untrained))
    return (f"{names}{f' ({c.note})' if c.note else ''}: {c.difference:+.3f} +/- {c.stderr:.3f} normalised return "
            f"(paired over the same {c.problems} problems): {verdict}{unlike}")


def score_measure(workflow: str, spec: Workflow, task: Any) -> str:
    """What a row's normalised return measures. The shipped workflows and baselines score an episode by
    the task's own reward; a user's workflow by whatever it returns and reports (its team return), which
    need not be the task's reward, so a user workflow's rows and the baselines' are labelled apart."""
    module = getattr(spec.run, "__module__", "") or ""
    if module == "teamrl" or module.startswith("teamrl."):
        return f"task reward ({getattr(task, 'name', '?')})"
    return f"workflow {workflow!r} return"


def workflow_stats(workflow: Workflow, outcomes: Sequence[EpisodeOutcome]) -> dict[str, float]:
    """Accuracy and the workflow's registered summary (:func:`~teamrl.workflows.outcome_metrics`); a
    workflow that registers none (a user's, an adapter) shows the mean of every numeric (or boolean)
    entry of its ``EpisodeOutcome.stats`` instead (text entries cannot be averaged)."""
    out = outcome_metrics(workflow, outcomes)
    if workflow.summary is None and outcomes:
        for k, v in stat_means(outcomes).items():
            out.setdefault(k, v)
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
        return dataclasses.replace(
            cfg, task={**cfg.task, "seed": seed}
        ), f"held-out problems (freshly generated: task.seed={seed})"
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
    settings = configured_workflow_options(cfg) if cfg.workflow.name else workflow_options_or_defaults(spec)
    if dataclasses.is_dataclass(settings) and "pass_at_1" in {f.name for f in dataclasses.fields(settings)}:
        settings = dataclasses.replace(settings, pass_at_1=True)
    own = {"team": Baseline(name, None, weights="trained"),
           "warm_start": Baseline(name, None, weights="warm_start", by_default=False, doc="the run's warm start"),
           "untrained": Baseline(name, None),
           "baseline": Baseline(name, None, weights="baseline", by_default=False, doc="--baseline's checkpoint")}
    return RunWorkflow(name, settings, spec.roles_for(task), {**own, **eval_baselines(name)})


def default_methods(cfg: Config, has_checkpoint: bool, warm_start: bool = False) -> list[str]:
    """What ``teamrl eval`` runs when no ``--method`` is given: ``team`` (with a checkpoint), ``warm_start``
    (``warm_start``: the checkpoint's run has one, :func:`warm_start_to_compare`), ``untrained`` and the run's
    workflow's default baselines."""
    run = run_workflow(cfg, make_task(cfg.task))
    return [m for m, b in run.methods.items()
            if (m != "team" or has_checkpoint) and (b.by_default or (m == "warm_start" and warm_start))]


def warm_start_to_compare(checkpoint: Path | None) -> Path | None:
    """The warm start of ``checkpoint``'s run (a run directory or a checkpoint folder) that its weights can be
    compared with: None without one, or where the checkpoint is that warm start itself (no RL step yet)."""
    if checkpoint is None:
        return None
    run_dir, ckpt = resolve_checkpoint(checkpoint, "--checkpoint")
    record = warm_start_of(run_dir)
    if record is None:
        return None
    warm = warm_start_checkpoint(run_dir)
    same = ckpt.resolve() == warm.resolve() or (ckpt.parent.name == "checkpoints" and ckpt.name == warm.name)
    return None if same else warm


def _method_checked(run: RunWorkflow, method: str, task: Any) -> Baseline:
    """The method's :class:`Baseline`, or a one-line refusal naming what the run's workflow takes."""
    if method not in EVAL_METHODS:
        raise ConfigError(f"--method: {method!r} is not known; choose from {list(EVAL_METHODS)}")
    baseline = run.methods.get(method)
    if baseline is None:
        raise ConfigError(
            f"--method {method}: workflow {run.name!r} has no {method} baseline; it takes {list(run.methods)}"
        )
    if baseline.workflow is not None:
        try:
            check_task(baseline.name, baseline.workflow, task)
        except ConfigError as e:
            raise ConfigError(f"--method {method} (workflow {run.name!r}): {e}") from None
    return baseline


def _route(baseline: Baseline, router: PolicyRouter, roles: Sequence[str]) -> Callable[[str], str]:
    """Which policy each role's calls go to: a checkpoint's (trained, the warm start, --baseline's: loaded
    before the method runs), base (adapters off), or the next role's trained policy."""
    if baseline.weights in CHECKPOINT_WEIGHTS:
        return router.policy_name
    if baseline.weights == "swapped":
        swap = {r: roles[(i + 1) % len(roles)] for i, r in enumerate(roles)}
        return lambda role: router.policy_name(swap.get(role, role))
    return lambda role: BASE


def team_engine(cfg: Config, roles: Sequence[str], checkpoint: Path | None = None) -> tuple[PolicyRouter, HFEngine]:
    """The team's policies (``checkpoint``: a run directory, its newest checkpoint loaded, or a checkpoint folder)
    and the engine that samples them; the policy :data:`BASE` routes to the base model (adapters off)."""
    router = PolicyRouter(cfg.policy.mode, list(roles), cfg.model, cfg.policy.lora, lr=cfg.train.lr, seed=cfg.seed,
                          need_reference=cfg.policy.lora is None, device=cfg.policy.device, dtype=cfg.policy.dtype,
                          role_map=cfg.policy.roles)
    check_max_new_tokens(next(iter(router.policies.values())).model, cfg.rollout.max_new_tokens, cfg.model)
    if checkpoint is not None:
        load_checkpoint(resolve_checkpoint(Path(checkpoint), "--checkpoint")[1], router)

    def models(name: str):
        if name == BASE:
            return next(iter(router.policies.values())).reference()
        return router.policies[name].generation_model()

    return router, HFEngine(models, router.tokenizer, device=router.device,
                            row_models=SharedBaseAdapters(router.policies))


def _method_weights(cfg: Config, chosen: Mapping[str, Baseline], checkpoint: Path | None,
                    baseline: Path | None) -> dict[str, Path]:
    """The checkpoint folder each chosen method's weights come from (methods on the base weights: none); a
    method whose checkpoint is missing, or a ``baseline`` trained with another model or LoRA setting, is refused
    in one line."""
    needs = {m: b.weights for m, b in chosen.items() if b.weights != "base"}
    if needs and checkpoint is None:
        raise ConfigError(f"--method {next(iter(needs))} needs --checkpoint RUN_DIR (a trained run); the untrained "
                          "team is the untrained method")
    if baseline is not None and "baseline" not in needs:
        raise ConfigError("--baseline is compared by the baseline method; add it to --method (or leave --method out)")
    if not needs:
        return {}
    run_dir, team = resolve_checkpoint(checkpoint, "--checkpoint")
    sources = {"trained": team, "swapped": team}
    if "warm_start" in needs.values():
        warm = warm_start_checkpoint(run_dir)
        if warm is None:
            raise ConfigError(f"--method warm_start: run {run_dir} has no warm start ({run_dir}/warm_start.json, "
                              "which teamrl sft writes); leave warm_start out")
        sources["warm_start"] = warm
    if "baseline" in needs.values():
        if baseline is None:
            raise ConfigError("--method baseline needs --baseline RUN_DIR or CHECKPOINT_DIR (the weights to compare "
                              "with)")
        other_run, sources["baseline"] = resolve_checkpoint(baseline, "--baseline")
        mismatch = settings_mismatch(other_run, cfg)
        if mismatch is not None:
            key, old, new, saved_file = mismatch
            raise CheckpointMismatch(f"--baseline {baseline}: trained with {key}={old!r} ({saved_file}), the evaluated "
                                     f"run with {new!r}; compare checkpoints of one model and LoRA setting")
    return {m: sources[w] for m, w in needs.items()}


def evaluate(cfg: Config, methods: list[str], checkpoint: Path | None = None, limit: int | None = None,
             temperature: float = 0.0, progress: bool = True, limit_name: str = "--limit",
             baseline: Path | None = None) -> list[EvalRow]:
    """Run each method on the first ``limit`` evaluation problems (None: all of them) and return one row per method.
    A ``limit`` that leaves problems out is said on stderr in one line, naming it as ``limit_name``.

    ``team`` runs the run's workflow with every role on its trained policy (``checkpoint``: a run
    directory's newest checkpoint, or a checkpoint folder); ``warm_start`` the same on the run's warm
    start; ``baseline`` on ``baseline``'s (a run directory or a checkpoint folder of the same model and
    LoRA settings); ``untrained`` the same workflow on the base model; the baselines are the run's
    workflow's (:func:`~teamrl.workflows.eval_baselines`), on the base model (``swapped``: each role on
    the next role's trained policy).
    """
    task = make_task(cfg.task)
    run = run_workflow(cfg, task)
    chosen = {m: _method_checked(run, m, task) for m in methods}
    weights = _method_weights(cfg, chosen, checkpoint, baseline)
    seed_everything(cfg.seed)
    roles = list(run.roles)
    router, engine = team_engine(cfg, roles)
    loaded: list[Path] = []

    def load(path: Path | None) -> None:
        """Put ``path``'s weights in the policies (once per switch), leaving the RNG as it was: a row does not
        depend on the checkpoints loaded before it."""
        if path is None or loaded[-1:] == [path]:
            return
        state = rng_state()
        load_checkpoint(path, router)
        set_rng_state(state)
        loaded.append(path)

    for path in dict.fromkeys(weights.values()):  # every checkpoint reads whole and fits, before any method runs
        load(path)
    # as before: the benchmark settings ignore_eos / min_new_tokens are not applied to evaluation
    params = SamplingParams.from_rollout(cfg.rollout, temperature=temperature, ignore_eos=False, min_new_tokens=0)
    every = task.problems()
    problems = every[:limit]
    if not problems:
        raise ConfigError(f"task {task.name!r}: no problems to evaluate (check task.split / task.test_size / --limit)")
    if len(problems) < len(every):  # never a silent subset
        print(f"scoring {len(problems)} of {len(every)} problems ({limit_name} {limit})", file=sys.stderr, flush=True)
    max_reward = getattr(task, "max_reward", 1.0)
    rows = []
    for method, way in chosen.items():
        load(weights.get(method))
        spec = way.workflow or WORKFLOWS.get_entry(run.name, "workflow.name")
        run_fn = spec.run
        settings = run.settings if way.workflow is None else None
        scheduler = GenerationScheduler(engine, seed=derive_seed(cfg.seed, 7))
        # One agent writing every part of a team task gets the whole team's token budget.
        p_method = (
            dataclasses.replace(params, max_new_tokens=params.max_new_tokens * len(roles)) if way.widen else params
        )
        ctxs = [
            EpisodeContext(scheduler, _route(way, router, roles), router.tokenizer, p_method, p.id, 0)
            for p in problems
        ]
        for ctx in ctxs:
            ctx.workflow = way.name
        t0 = time.perf_counter()
        shown = ProgressLines(f"[teamrl eval] {method}:", len(problems), "problems", enabled=progress)
        shown.update(0)
        finished = 0

        async def counted(episode):
            nonlocal finished
            result = await episode
            finished += 1
            shown.update(finished)
            return result

        with torch.no_grad():
            results = scheduler.run([counted(run_episode(lambda c, _p=p: run_fn(c, task, _p, settings), ctx))
                                     for p, ctx in zip(problems, ctxs)])
        wall = time.perf_counter() - t0
        scores = [r.team_return / max_reward for r in results]
        n = len(scores)
        mean, stderr = mean_and_stderr(scores)
        replies = [s for c in ctxs for s in c.samples]
        tokens = sum(len(s.completion_ids) for s in replies)
        outcomes = [r.outcome for r in results if r.outcome is not None]
        stats = workflow_stats(spec, outcomes) if len(outcomes) == n else {}
        passed = stats.get("accuracy")
        episodes = [
            episode_record(method, way.name, p, ctx, r, max_reward, task, spec.formats)
            for p, ctx, r in zip(problems, ctxs, results)
        ]
        verdicts = [c["valid"] for e in episodes for c in e["calls"] if c["valid"] is not None]
        valid = sum(verdicts) / len(verdicts) if verdicts else None
        rows.append(
            EvalRow(
                method,
                mean,
                stderr,
                n,
                tokens / wall,
                wall / n,
                passed,
                valid,
                len(replies) / n,
                scores,
                stats,
                episodes,
                scored_by=score_measure(way.name, spec, task),
                weights=str(weights[method]) if method in weights else "",
            )
        )
    run_dir = None if checkpoint is None else resolve_checkpoint(checkpoint, "--checkpoint")[0]
    note = training_problems_note(cfg, run_dir)
    for r in rows:
        r.note = note
    return rows


def format_table(rows: list[EvalRow]) -> str:
    """A Markdown table of the rows; a workflow run's statistics follow in a second table (one
    column per method), and the paired trained-vs-untrained comparison in one line. A row's ``note``
    (the problems are the run's training problems) opens the table."""
    with_pass = any(r.pass_at_1 is not None for r in rows)
    with_valid = any(r.valid is not None for r in rows)
    # a user workflow's own return beside the baselines' task reward: say so, row by row
    unlike = len({r.scored_by for r in rows}) > 1
    note = next((r.note for r in rows if r.note), "")
    notes = [note] if note else []
    if unlike:
        notes.append(
            "note: the rows are scored by different measures (the scored by column), so their normalised returns and "
            "paired differences do not compare"
            + ("; pass@1 / success (correctness) does, where rows have it" if with_pass else "")
        )
    head = ("| method | normalised return (mean +/- stderr) |" + (" scored by |" if unlike else "")
            + (" pass@1 / success |" if with_pass else "") + (" valid replies |" if with_valid else ""))
    lines = (notes + [""] if notes else []) + [head + " problems | generated tokens/s | s / problem |",
                                               "|---" * (head.count("|") + 2) + "|"]
    for r in rows:
        m = f" {r.scored_by} |" if unlike else ""
        p = (f" {r.pass_at_1:.3f} |" if r.pass_at_1 is not None else " - |") if with_pass else ""
        v = (f" {r.valid:.3f} |" if r.valid is not None else " - |") if with_valid else ""
        lines.append(f"| {r.method} | {r.mean:.3f} +/- {r.stderr:.3f} |{m}{p}{v} {r.problems} | {r.tokens_per_s:.0f} | "
                     f"{r.seconds_per_problem:.2f} |")
    keys = list(dict.fromkeys(k for r in rows for k in r.stats))
    if keys:
        lines += ["", "| statistic | " + " | ".join(r.method for r in rows) + " |", "|---" * (len(rows) + 1) + "|"]
        lines += [
            f"| {k} | " + " | ".join(f"{r.stats[k]:.3f}" if k in r.stats else "-" for r in rows) + " |" for k in keys
        ]
    headline = [c for c in paired_comparisons(rows) if (c.trained, c.untrained) in HEADLINE_PAIRS]
    if headline:
        lines += ["", *map(format_comparison, headline)]
    return "\n".join(lines)


# ---- what eval saw, on disk -------------------------------------------------------------------
# ``RUN_DIR/eval/<timestamp>/``: results.json (every method's metrics, the paired differences, the command,
# the resolved config, which problems) and <method>.jsonl (one line per problem: the whole episode).

RESULTS_FILE = "results.json"


def _plain(value: Any) -> Any:
    """``value`` as JSON-friendly data: what json cannot write (a tuple key, an object) becomes its ``str``."""
    return json.loads(json.dumps(value, default=str))


def episode_record(method: str, workflow: str, problem: Any, ctx: EpisodeContext, result: Any, max_reward: float,
                   task: Any, formats: Mapping[str, Callable[[str], bool] | None] | None = None) -> dict[str, Any]:
    """One evaluated episode as a JSON-friendly dict: its score and outcome, every call (role, policy,
    turn, the prompt messages and rendered prompt, the completion, token counts and the exact token ids
    (``prompt_ids``, ``completion_ids``: what ``teamrl sft --from-episodes`` trains), the call's own reward,
    whether it is a valid reply of its role: :func:`~teamrl.tasks.task.reply_valid` with the workflow's
    ``formats``) and every reward the workflow reported, in order
    (``after_call``: the index of the last call issued before it). Calls the gateway answered (an OpenAI-API
    team's, recorded in ``ctx.samples`` only) follow with ``call`` and ``messages`` None; a call whose sample has
    its training reward (``teamrl calibrate``) carries it as ``reward``."""
    calls, rewards, last_call = [], [], None

    def call(index: int | None, messages: Any, s: Any) -> dict[str, Any]:
        return {
            "call": index, "role": s.role, "policy": s.policy, "turn": s.turn, "branch": s.branch,
            "messages": _plain(messages), "prompt": s.prompt_text, "completion": s.text,
            "finish_reason": s.finish_reason, "prompt_tokens": len(s.prompt_ids),
            "completion_tokens": len(s.completion_ids), "temperature": s.temperature, "own_reward": own_reward(s),
            "prompt_ids": list(s.prompt_ids), "completion_ids": list(s.completion_ids),
            "valid": reply_valid(task, problem, s.text, role=s.role, formats=formats),
            **({"reward": s.reward} if s.reward is not None else {}),
            **({"tags": _plain(s.tags)} if s.tags else {}),
        }

    in_events = set()
    for event in ctx.events:
        if isinstance(event, RewardEvent):
            rewards.append({"after_call": last_call, "role": event.role, "value": event.value})
            continue
        last_call = event.index
        for s in event.samples:
            in_events.add(id(s))
            calls.append(call(event.index, event.messages, s))
    calls += [call(None, None, s) for s in getattr(ctx, "samples", ()) if id(s) not in in_events]
    outcome = result.outcome
    return {
        "method": method,
        "workflow": workflow,
        "problem_id": _plain(problem.id),
        "score": result.team_return / max_reward,
        "team_return": result.team_return,
        "final_reward": result.final_reward,
        "correct": None if outcome is None else outcome.correct,
        "outcome": None if outcome is None else _plain(dataclasses.asdict(outcome)),
        "returned": None if outcome is not None or result.returned is None else _plain(result.returned),
        "calls": calls,
        "rewards": rewards,
    }


# the comparisons the table ends with, in this order (a run without a warm start or --baseline: team - untrained)
HEADLINE_PAIRS = (("team", "warm_start"), ("warm_start", "untrained"), ("team", "untrained"), ("team", "baseline"))


def paired_comparisons(rows: Sequence[EvalRow]) -> list[Comparison]:
    """The paired differences of the rows: with a warm start, ``team - warm start`` (RL's own effect) and
    ``warm start - untrained`` (the warm start's) first; then the trained team (else the untrained team)
    against every other row, ``untrained`` first (``team - untrained`` is the warm start and RL together)."""
    by = {r.method: r for r in rows}
    first = "team" if "team" in by else "untrained" if "untrained" in by else None
    if first is None:
        return []
    warm = "warm_start" in by
    notes = {("team", "warm_start"): "RL's own effect", ("warm_start", "untrained"): "the warm start's effect"}
    if warm:
        notes[("team", "untrained")] = "warm start and RL together"
    if "baseline" in by:
        notes[(first, "baseline")] = f"weights of {by['baseline'].weights}"
    pairs = [p for p in (("team", "warm_start"), ("warm_start", "untrained")) if p[0] in by and p[1] in by]
    # untrained first: the comparison train and eval print without a warm start
    pairs += [(first, m) for m in sorted((m for m in by if m != first), key=lambda m: m != "untrained")
              if (first, m) not in pairs and (m, first) not in pairs]
    out = []
    for trained, untrained in pairs:
        c = compare(rows, trained, untrained)
        if c is not None:
            out.append(dataclasses.replace(c, note=notes.get((trained, untrained), "")))
    return out


def problem_source(cfg: Config, training_task: dict | None) -> dict[str, Any]:
    """Which problems an eval scored: the task section, and whether they are held out from the
    training problems (``held_out``: None where it cannot tell, i.e. without the run's config)."""
    from teamrl.tasks import TASKS

    fields = getattr(TASKS.get_entry(cfg.task.get("name"), "task.name").Options, "__dataclass_fields__", {})
    out: dict[str, Any] = {"task": _plain(cfg.task), "held_out": None}
    for key in ("split", "seed"):
        if key in fields:
            used = cfg.task.get(key, fields[key].default)
            out[key] = used
            if training_task is not None and training_task.get("name") == cfg.task.get("name"):
                trained_on = training_task.get(key, fields[key].default)
                out["held_out"] = used != trained_on
                out["description"] = (f"task.{key}={used} (trained on task.{key}={trained_on})" if used != trained_on
                                      else f"the training problems (task.{key}={used}, as in training)")
            break
    else:  # the task has no split and generates no problems: the training problems, if it trained on this task
        if training_task is not None and training_task.get("name") == cfg.task.get("name"):
            out["held_out"], out["description"] = False, "the training problems (the task holds none out)"
    return out


def training_problems_note(cfg: Config, checkpoint: Path | None) -> str:
    """One line for the table when the problems scored are those the checkpoint's run trained on: ``no held-out
    split: ...`` for a task that holds none out, ``not held out: ...`` for one evaluated on its training split or
    seed; '' otherwise (problems held out, or no checkpoint: nothing was trained on them)."""
    conf = Path(checkpoint) / "config.yaml" if checkpoint is not None else None
    if conf is None or not conf.is_file():
        return ""
    import yaml

    source = problem_source(cfg, (yaml.safe_load(conf.read_text()) or {}).get("task"))
    if source["held_out"] is not False:
        return ""
    lead = "not held out" if ("split" in source or "seed" in source) else "no held-out split"
    return f"{lead}: scored on {source['description']}"


def eval_output_dir(checkpoint: Path | None, cfg: Config, out: Path | None = None) -> Path:
    """Where an eval writes: ``out`` if given, else ``RUN_DIR/eval/<timestamp>`` for a checkpoint's run (a run
    directory or a checkpoint folder of it), else ``run.dir/eval-<timestamp>`` (an eval of the base model); a fresh
    folder (``-2``, ... on a clash)."""
    if out is not None:
        return Path(out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = resolve_checkpoint(checkpoint, "--checkpoint")[0] if checkpoint is not None else None
    base = run_dir / "eval" / stamp if run_dir is not None else Path(cfg.run.dir) / f"eval-{stamp}"
    path, k = base, 2
    while path.exists():
        path, k = base.with_name(f"{base.name}-{k}"), k + 1
    return path


def write_results(rows: Sequence[EvalRow], out_dir: Path, cfg: Config, command: Sequence[str],
                  checkpoint: Path | None = None, limit: int | None = None, temperature: float = 0.0) -> Path:
    """Write ``out_dir/results.json`` and one ``<method>.jsonl`` per method (its episodes, one line per
    problem, in problem order); return ``out_dir``."""
    from teamrl.core.config import config_to_dict

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    training_task, step, warm = None, None, None
    if checkpoint is not None:
        run_dir, ckpt = resolve_checkpoint(checkpoint, "--checkpoint")
        conf = run_dir / "config.yaml"
        if conf.is_file():
            import yaml

            training_task = (yaml.safe_load(conf.read_text()) or {}).get("task")
        step = int(ckpt.name.rsplit("_", 1)[-1])  # checkpoints/step_000002 -> 2
        warm = warm_start_of(run_dir)
    methods = {}
    for r in rows:
        with (out_dir / f"{r.method}.jsonl").open("w") as f:
            for e in r.episodes:
                f.write(json.dumps(e) + "\n")
        row = {k: v for k, v in dataclasses.asdict(r).items() if k != "episodes"}
        methods[r.method] = {**row, "episodes_file": f"{r.method}.jsonl"}
    results = {
        "command": " ".join(shlex.quote(a) for a in command),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "checkpoint": None if checkpoint is None else str(checkpoint),
        "checkpoint_step": step,
        "warm_start": warm,  # what the run's warm start was (RUN_DIR/warm_start.json), if it has one
        "limit": limit,
        "temperature": temperature,
        "problems": {
            **problem_source(cfg, training_task),
            "ids": [e["problem_id"] for e in rows[0].episodes] if rows else [],
        },
        "methods": methods,
        "comparisons": [{**dataclasses.asdict(c), "beyond_noise": c.beyond_noise} for c in paired_comparisons(rows)],
        # set only when the rows' measures differ (a user workflow's own return beside the task's reward)
        "measures_differ": len({r.scored_by for r in rows}) > 1,
        "config": _plain(config_to_dict(cfg)),
    }
    (out_dir / RESULTS_FILE).write_text(json.dumps(results, indent=1) + "\n")
    return out_dir


def rows_from_results(results: dict[str, Any]) -> list[EvalRow]:
    """The :class:`EvalRow` of each method of a ``results.json`` (without its episodes)."""
    names = {f.name for f in dataclasses.fields(EvalRow)}
    return [EvalRow(**{k: v for k, v in m.items() if k in names}) for m in results["methods"].values()]
