"""``teamrl calibrate``: why a run gets no learning signal, and which settings give it one.

A group-relative algorithm learns only from groups whose rewards differ. Calibration samples a few training
problems in groups of G episodes (the run's workflow through the episode protocol, as ``teamrl eval`` runs it:
:func:`~teamrl.workflows.episode.run_episode`) at a few settings (the run's temperature and a higher one, its
``rollout.max_new_tokens`` and twice that, and any task option swept with ``--set`` / ``--level``), and gives, per
setting and per role, the figures that say why groups do or do not vary (:func:`setting_figures`, computed from the
saved episodes alone), then advice that names the figure it follows from (:func:`advice`) and the setting with the
most varied groups as overrides to paste (:func:`best_setting`). Every episode is saved in ``teamrl eval``'s record
format (:func:`~teamrl.trainer.evaluate.episode_record`), so another tool can keep the successful ones.

``bench/learning.py --calibrate`` measures each difficulty level with :func:`measure` too: one way to measure signal.
"""

from __future__ import annotations

import itertools
import json
import shlex
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Mapping, Sequence

import torch

from teamrl.algorithms.grpo import assign_rewards, reward_view
from teamrl.core.config import Config, ConfigError, config_to_dict
from teamrl.core.seeding import derive_seed, seed_everything
from teamrl.policies.models import check_max_new_tokens
from teamrl.policies.router import declared_role
from teamrl.rollout.engine import SamplingParams
from teamrl.rollout.scheduler import GenerationScheduler
from teamrl.policies.router import role_type
from teamrl.tasks import make_task
from teamrl.tasks.task import batch_instances
from teamrl.trainer.evaluate import episode_record, run_workflow, team_engine
from teamrl.trainer.trainer import progress_bar
from teamrl.workflows import WORKFLOWS
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.episode import run_episode

DEFAULT_PROBLEMS = 8
DEFAULT_GROUP_SIZE = 4  # when the config's group size is 1 (nothing to compare within a group)
SWEEPABLE = ("task.", "rollout.", "workflow.")  # what a setting may change: the model and its policies stay loaded
RESULTS_FILE = "calibration.json"
TRUNCATED_ADVICE = 0.2  # a share of replies cut at max_new_tokens worth raising it for
SUCCESS_ADVICE = 0.25  # best-scoring episodes rarer than this: keep them as a warm start (teamrl sft --self-play)
VALID_ADVICE = 0.5  # a share of replies in their role's format under which a warm start of the format comes first
LITTLE_SIGNAL = 0.25  # a share of varied groups under which larger groups are worth their cost


# ---- what to sample -------------------------------------------------------------------------------------------


def parse_sweep(text: str) -> list[tuple[str, ...]]:
    """``--set KEY=V1,V2``: one setting per value (``|`` separates values that hold commas:
    ``task.kinds=city|city,country``)."""
    key, sep, values = text.partition("=")
    key = key.strip()
    points = [v.strip() for v in values.split("|" if "|" in values else ",")]
    if not sep or not key or not all(points):
        raise ConfigError(f"--set {text!r}: expected KEY=V1,V2,... (e.g. --set task.max_operand=5,10)")
    _check_sweepable(key, f"--set {text!r}")
    return [(f"{key}={v}",) for v in dict.fromkeys(points)]


def parse_level(text: str) -> tuple[str, ...]:
    """``--level "KEY=V KEY2=V2"``: one setting made of several overrides (a task's difficulty level)."""
    overrides = tuple(shlex.split(text))
    if not overrides or any("=" not in o or o.startswith("=") for o in overrides):
        raise ConfigError(f"--level {text!r}: expected space-separated KEY=VALUE overrides "
                          "(e.g. --level 'task.min_size=4 task.max_size=4')")
    for o in overrides:
        _check_sweepable(o.split("=", 1)[0], f"--level {text!r}")
    return overrides


def _check_sweepable(key: str, where: str) -> None:
    if not key.startswith(SWEEPABLE):
        raise ConfigError(f"{where}: {key!r} cannot be swept; calibration sweeps keys under "
                          f"{', '.join(SWEEPABLE)} (the model and policies stay as configured)")


def _number(value: float) -> str:
    return f"{value:g}"


def default_axes(cfg: Config) -> list[list[tuple[str, ...]]]:
    """The settings calibration tries unless told otherwise: the run's temperature and a higher one (at least 1.0),
    its ``rollout.max_new_tokens`` and twice that."""
    t, m = cfg.rollout.temperature, cfg.rollout.max_new_tokens
    temperatures = dict.fromkeys([_number(t), _number(max(round(t + 0.2, 3), 1.0))])
    return [[(f"rollout.temperature={v}",) for v in temperatures],
            [(f"rollout.max_new_tokens={v}",) for v in dict.fromkeys([m, 2 * m])]]


def settings_grid(cfg: Config, axes: Sequence[Sequence[tuple[str, ...]]]) -> list[tuple[str, ...]]:
    """Every combination of ``axes`` (each a list of settings: override tuples; ``--set`` / ``--level``), after the
    default temperature and length axes of any key no axis sets; the first setting is the config's own where the
    axes start with it."""
    given = {o.split("=", 1)[0] for axis in axes for point in axis for o in point}
    defaults = [axis for axis in default_axes(cfg) if axis[0][0].split("=", 1)[0] not in given]
    return [tuple(o for point in combo for o in point) for combo in itertools.product(*axes, *defaults)]


# ---- the figures ----------------------------------------------------------------------------------------------


def _share(values: Sequence[bool]) -> float | None:
    return sum(values) / len(values) if values else None


def _figures(rewards: Mapping[Hashable, list[float]], calls: Sequence[Mapping[str, Any]], episodes: int) -> dict:
    """The figures of one row: ``rewards`` per comparison group, ``calls`` the row's calls over ``episodes``."""
    values = [v for group in rewards.values() for v in group]
    varied = sum(len(set(group)) > 1 for group in rewards.values())
    judged = [c["valid"] for c in calls if c.get("valid") is not None]
    return {
        "reward_mean": statistics.fmean(values) if values else None,
        "reward_std": statistics.pstdev(values) if values else None,
        "groups": len(rewards),
        "groups_varied": varied,
        "groups_varied_share": varied / len(rewards) if rewards else 0.0,
        "valid": _share([bool(v) for v in judged]),
        "calls_per_episode": len(calls) / episodes if episodes else 0.0,
        "tool_calls_per_episode": sum(len((c.get("tags") or {}).get("tool_calls") or ()) for c in calls) / episodes
        if episodes else 0.0,
        "truncated": _share([c["finish_reason"] == "length" for c in calls]),
        "completion_tokens": statistics.fmean(c["completion_tokens"] for c in calls) if calls else None,
    }


def setting_figures(records: Sequence[Mapping[str, Any]], roles: Sequence[str]) -> dict[str, Any]:
    """The figures of one setting from its episode records alone (:func:`~teamrl.trainer.evaluate.episode_record`,
    each call with its training ``reward``).

    Rewards are the calls' training rewards (``workflow.reward`` applied to each call, as GRPO applies it), grouped
    as GRPO compares them: by (problem, role, turn) over the G episodes of a problem; the team row holds every
    group, a role's row its own. A group varied when its rewards are not all equal; ``valid``: the share of judged
    replies in their role's format; ``truncated``: the share of replies that ended at max_new_tokens
    (``finish_reason`` length). The team row adds ``score`` (the episodes' mean normalised return) and ``success``
    (the share of episodes whose outcome is correct; None where the workflow reports none); ``silent_roles``:
    declared roles with no call."""
    team: dict[Hashable, list[float]] = {}
    by_role: dict[str, dict[Hashable, list[float]]] = {r: {} for r in roles}
    role_calls: dict[str, list[Mapping[str, Any]]] = {r: [] for r in roles}
    all_calls = []
    for e in records:
        for c in e["calls"]:
            try:
                role = declared_role(c["role"], roles)
            except KeyError:  # a role the team does not declare (a sub-agent): its own row
                role = c["role"]
            group = (e["problem_id"], role, c["turn"])
            team.setdefault(group, []).append(c["reward"])
            by_role.setdefault(role, {}).setdefault(group, []).append(c["reward"])
            role_calls.setdefault(role, []).append(c)
            all_calls.append(c)
    correct = [bool(e["correct"]) for e in records if e.get("correct") is not None]
    return {
        "episodes": len(records),
        **_figures(team, all_calls, len(records)),
        "score": statistics.fmean(e["score"] for e in records) if records else None,
        "success": _share(correct),
        "roles": {r: _figures(by_role[r], role_calls[r], len(records)) for r in by_role},
        "silent_roles": [r for r in roles if not role_calls[r]],
    }


# ---- sampling -------------------------------------------------------------------------------------------------


@dataclass
class SettingResult:
    """One setting: its overrides, those that differ from the config (``changes``), its figures and episodes."""

    overrides: tuple[str, ...]
    changes: tuple[str, ...]
    group_size: int
    figures: dict[str, Any]
    episodes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        """The setting in words: its changes, or ``as configured``."""
        return " ".join(self.changes) or "as configured"


@dataclass
class Calibration:
    """What :func:`measure` found: a result per setting sampled, the settings skipped (why), the team's roles."""

    results: list[SettingResult]
    roles: tuple[str, ...]
    skipped: list[dict[str, str]] = field(default_factory=list)
    problems: int = 0
    task_demonstrations: bool = False  # the task writes its own (a demonstrations(problem) method): teamrl sft uses it


def _dotted(data: Mapping[str, Any], key: str) -> Any:
    for part in key.split("."):
        if not isinstance(data, Mapping) or part not in data:
            return None
        data = data[part]
    return data


def _demonstrates(task: Any, roles: Sequence[str]) -> bool:
    """Whether ``task`` writes demonstrations for this team's roles (those of its first problem; a task's solver
    for another team, e.g. math.solve's single ``agent`` under a coder + critic workflow, does not count)."""
    hook = getattr(task, "demonstrations", None)
    problems = task.problems()[:1] if callable(hook) else []
    demos = [row for p in problems for row in hook(p)] if problems else []
    team = set(roles) | {role_type(r) for r in roles}
    role_of = [d.get("role") if isinstance(d, dict) else d[0] if isinstance(d, (tuple, list)) and d else None
               for d in demos]
    return bool(demos) and all(r in team for r in role_of)


def measure(load: Callable[[Sequence[str]], Config], settings: Sequence[tuple[str, ...]],
            problems: int = DEFAULT_PROBLEMS, group_size: int | None = None, checkpoint: Path | None = None,
            progress: bool = True) -> Calibration:
    """Sample ``problems`` training problems in groups of ``group_size`` episodes (default: the config's
    ``rollout.group_size``, or :data:`DEFAULT_GROUP_SIZE` where that is 1) at each setting (``load(overrides)``: the
    config with that setting's overrides) with the run's workflow, on the base weights or ``checkpoint``'s last
    checkpoint (a run directory), sampling as training does (``rollout.*``). Every setting's config is loaded and
    checked before the model; a setting whose ``max_new_tokens`` exceeds the model's context is skipped (said)."""
    base = config_to_dict(load(()))
    cfgs = [load(s) for s in settings]
    runs = []
    for s, cfg in zip(settings, cfgs):
        task = make_task(cfg.task)
        run = run_workflow(cfg, task)
        if runs and run.roles != runs[0][1].roles:
            raise ConfigError(f"calibrate setting {' '.join(s)!r}: its team has roles {list(run.roles)}, the first "
                              f"setting's {list(runs[0][1].roles)}; sweep settings of one team")
        runs.append((task, run))
    roles = runs[0][1].roles
    seed_everything(cfgs[0].seed)
    router, engine = team_engine(cfgs[0], roles, checkpoint)
    model = next(iter(router.policies.values())).model
    out = Calibration([], tuple(roles), task_demonstrations=_demonstrates(runs[0][0], roles))
    bar = progress_bar(len(settings), "calibrate", "setting", progress)
    for s, cfg, (task, run) in zip(settings, cfgs, runs):
        try:
            check_max_new_tokens(model, cfg.rollout.max_new_tokens, cfg.model)
        except ConfigError as e:
            out.skipped.append({"setting": " ".join(s), "why": str(e)})
            bar.update(1)
            continue
        g = group_size or (cfg.rollout.group_size if cfg.rollout.group_size > 1 else DEFAULT_GROUP_SIZE)
        chosen = batch_instances(task.problems()[:problems])
        if not chosen:
            raise ConfigError(f"task {task.name!r}: no training problems to calibrate on (check the task's options)")
        out.problems = len(chosen)
        spec = WORKFLOWS.get_entry(run.name, "workflow.name")
        scheduler = GenerationScheduler(engine, seed=derive_seed(cfg.seed, 17))
        params = SamplingParams.from_rollout(cfg.rollout)  # as training samples
        episodes = [(p, k, EpisodeContext(scheduler, router.policy_name, router.tokenizer, params, p.id, k))
                    for p in chosen for k in range(g)]
        for _, _, ctx in episodes:
            ctx.workflow = run.name
        with torch.no_grad():
            results = scheduler.run([run_episode(lambda c, _p=p: spec.run(c, task, _p, run.settings), ctx)
                                     for p, _, ctx in episodes])
        max_reward = getattr(task, "max_reward", 1.0)
        changes = tuple(o for o in s if _dotted(config_to_dict(cfg), o.split("=", 1)[0])
                        != _dotted(base, o.split("=", 1)[0]))
        label = " ".join(changes) or "as configured"
        records = [_record(p, k, ctx, r, label, cfg.workflow.reward, run.name, max_reward, task, spec.formats)
                   for (p, k, ctx), r in zip(episodes, results)]
        figures = setting_figures(records, roles)
        out.results.append(SettingResult(tuple(s), changes, g, figures, records))
        bar.update(1)
        bar.set_postfix(varied=f"{figures['groups_varied']}/{figures['groups']}",
                        reward=_num(figures["reward_mean"]))
    bar.close()
    return out


def _record(problem: Any, episode: int, ctx: EpisodeContext, result: Any, setting: str, reward: str, workflow: str,
            max_reward: float, task: Any, formats: Any) -> dict[str, Any]:
    """``teamrl eval``'s episode record, plus the setting, the episode's place in its group and each call's
    training reward (``workflow.reward`` applied as GRPO applies it)."""
    assign_rewards(ctx.samples, reward_view(result), reward)  # every call's: those in events and the gateway's
    record = episode_record("calibrate", workflow, problem, ctx, result, max_reward, task, formats)
    return {**record, "setting": setting, "episode": episode}


# ---- what it means --------------------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def best_setting(cal: Calibration) -> SettingResult | None:
    """The setting with the most varied groups (share; the earlier one on a tie: the config's own first)."""
    if not cal.results:
        return None
    return max(cal.results, key=lambda r: (r.figures["groups_varied_share"], -cal.results.index(r)))


def _as_configured(cal: Calibration) -> SettingResult | None:
    return next((r for r in cal.results if not r.changes), cal.results[0] if cal.results else None)


def advice(cal: Calibration) -> list[str]:
    """A few lines of advice, each naming the figure it follows from."""
    if not cal.results:
        return ["no setting could be sampled: " + "; ".join(f"{s['setting']}: {s['why']}" for s in cal.skipped)]
    lines = []
    own = _as_configured(cal)
    f = own.figures
    groups = sum(r.figures["groups"] for r in cal.results)
    varied = [r for r in cal.results if r.figures["groups_varied"]]
    scores = [e["score"] for r in cal.results for e in r.episodes]
    rewards = [c["reward"] for r in cal.results for e in r.episodes for c in e["calls"]]
    if not varied:
        where = f"0 of {groups} groups varied at {len(cal.results)} setting{'s' * (len(cal.results) != 1)}"
        if rewards and all(v == 0 for v in rewards) and cal.task_demonstrations:
            lines.append(f"{where}: every reward 0 -> the task is too hard for this model untrained: a warm start "
                         "from the task's own demonstrations first (teamrl sft CONFIG, then teamrl train CONFIG "
                         "--resume), then calibrate that warm start (--checkpoint runs/NAME)")
        elif rewards and all(v == 0 for v in rewards):
            lines.append(f"{where}: every reward 0 -> the task is too hard for this model: a warm start (teamrl sft "
                         "on demonstrations, or teamrl sft --self-play N --player FILE.py:fn from a scripted player's "
                         "successes), an easier level (--set / --level a task option), or a larger model")
        elif all(s == 1 for s in scores):
            lines.append(f"{where}: every reward 1 (the task's maximum) -> the task is too easy for this model: a "
                         "harder level (--set / --level a task option)")
        else:
            span = f"{min(rewards, default=0):.3f}..{max(rewards, default=0):.3f}"
            lines.append(f"{where}: the calls of a group were rewarded alike (rewards {span} across groups) -> the "
                         "reward does not tell this team's samples apart: check workflow.reward and the task's "
                         "reward, or sample larger groups (rollout.group_size)")
    elif not f["groups_varied"]:
        at = ", ".join(f"{r.label} ({r.figures['groups_varied']} of {r.figures['groups']})" for r in varied)
        lines.append(f"0 of {f['groups']} groups varied as configured; groups vary only at {at} -> set "
                     f"{' '.join(best_setting(cal).changes)}")
    # as configured the groups vary enough to learn from: said first, and no warm start is pressed on it (any best
    # score of a continuous reward is rare, which is no reason for one)
    signal = f["groups_varied_share"] >= LITTLE_SIGNAL
    if signal:
        lines.append(f"{f['groups_varied']} of {f['groups']} groups varied ({_pct(f['groups_varied_share'])}) as "
                     "configured: the rewards give a learning signal")
    if f["truncated"] is not None and f["truncated"] >= TRUNCATED_ADVICE:
        longer = [r for r in cal.results
                  if r.changes and all(c.startswith("rollout.max_new_tokens=") for c in r.changes)]
        means = (f["reward_mean"], longer[0].figures["reward_mean"]) if longer else (None, None)
        if None not in means and means[1] < means[0]:
            r = longer[0]
            lines.append(f"{_pct(f['truncated'])} of replies cut at max_new_tokens ({own.label}) ({r.label}: "
                         f"{_pct(r.figures['truncated'])}, reward mean {f['reward_mean']:.3f} -> "
                         f"{r.figures['reward_mean']:.3f}) -> the longer replies scored lower: ask for shorter replies "
                         "(the prompt, a task option) rather than raise rollout.max_new_tokens")
        else:
            also = "".join(f" ({r.label}: {_pct(r.figures['truncated'])})" for r in longer[:1])
            lines.append(f"{_pct(f['truncated'])} of replies cut at max_new_tokens ({own.label}){also} -> raise "
                         "rollout.max_new_tokens (or ask for shorter replies)")
    for role in cal.roles:
        silent = [r for r in cal.results if role in r.figures["silent_roles"]]
        episodes = sum(r.figures["episodes"] for r in silent)
        if len(silent) == len(cal.results):
            lines.append(f"role {role} never acted: 0 calls in {episodes} episodes -> its policy gets no samples and "
                         "learns nothing: check that the workflow calls ctx.generate for it (its name, the condition "
                         "it acts on), or drop it from the team")
        elif silent:
            lines.append(f"role {role} acted at some settings only: 0 calls at {', '.join(r.label for r in silent)}")
    best_score = max(scores, default=0.0)
    reached = sum(v >= best_score for v in scores)
    if not signal and 0 < best_score and reached / len(scores) < SUCCESS_ADVICE:
        lines.append(f"{reached} of {len(scores)} episodes scored {best_score:.3f} (the best) -> a warm start from the "
                     f"team's own successes: teamrl sft --self-play 8 --min-reward {best_score:.3g} (then teamrl train "
                     "--resume)")
    if f["valid"] is not None and f["valid"] < VALID_ADVICE:
        lines.append(f"format validity {_pct(f['valid'])} ({own.label}) -> a warm start of the format (teamrl sft) "
                     "before RL: a reply the task cannot read scores alike")
    best = best_setting(cal)
    share = best.figures["groups_varied_share"]
    if 0 < share < LITTLE_SIGNAL:
        lines.append(f"at best {best.figures['groups_varied']} of {best.figures['groups']} groups varied "
                     f"({_pct(share)}, {best.label}) -> little signal per step: larger groups (rollout.group_size="
                     f"{2 * best.group_size}) or a level nearer half success")
    return lines


def paste_overrides(cal: Calibration) -> str:
    """The best setting as ``key=value`` overrides to add to ``teamrl train`` ('' when it is the config's own)."""
    best = best_setting(cal)
    return "" if best is None else " ".join(shlex.quote(c) for c in best.changes)


def format_report(cal: Calibration) -> str:
    """The table (one row per setting and role: the team first) and the advice."""
    head = ("| setting | role | reward mean +/- std | groups varied | normalised return | success | valid replies | "
            "calls / episode | tool calls / episode | cut at max_new_tokens | completion tokens |")
    lines = [f"{cal.problems} training problems, G episodes each; reward: each call's training reward "
             "(workflow.reward), a group: a (problem, role, turn)'s calls over the G episodes", "", head,
             "|---" * 11 + "|"]
    for r in cal.results:
        # a one-role team's role row is its team row again
        rows = [("team", r.figures)] + (list(r.figures["roles"].items()) if len(r.figures["roles"]) > 1 else [])
        for role, f in rows:
            reward = "-" if f["reward_mean"] is None else f"{f['reward_mean']:.3f} +/- {f['reward_std']:.3f}"
            tokens = "-" if f["completion_tokens"] is None else f"{f['completion_tokens']:.1f}"
            lines.append(f"| {r.label} (G={r.group_size}) | {role} | {reward} | {f['groups_varied']} of {f['groups']} "
                         f"({_pct(f['groups_varied_share'])}) | {_num(f.get('score'))} | {_pct(f.get('success'))} | "
                         f"{_pct(f['valid'])} | "
                         f"{f['calls_per_episode']:.2f} | {f['tool_calls_per_episode']:.2f} | {_pct(f['truncated'])} | "
                         f"{tokens} |")
    for s in cal.skipped:
        lines.append(f"skipped {s['setting']}: {s['why']}")
    lines += ["", "advice:"] + [f"- {a}" for a in advice(cal)]
    best = best_setting(cal)
    if best is not None:
        paste = paste_overrides(cal)
        lines.append(f"most varied groups: {best.label} ({best.figures['groups_varied']} of {best.figures['groups']}); "
                     + (f"train with: {paste}" if paste else "the config's own settings"))
    return "\n".join(lines)


# ---- on disk --------------------------------------------------------------------------------------------------


def calibrate_output_dir(cfg: Config, out: Path | None = None) -> Path:
    """``out`` if given, else ``run.dir/<name>/calibrate/<timestamp>`` (``-2``, ... on a clash)."""
    if out is not None:
        return Path(out)
    base = Path(cfg.run.dir) / cfg.name / "calibrate" / time.strftime("%Y%m%d-%H%M%S")
    path, k = base, 2
    while path.exists():
        path, k = base.with_name(f"{base.name}-{k}"), k + 1
    return path


def write_calibration(cal: Calibration, out_dir: Path, cfg: Config, command: Sequence[str],
                      checkpoint: Path | None = None) -> Path:
    """Write ``out_dir/calibration.json`` (every setting's figures, the advice, the best setting) and one
    ``setting<N>.jsonl`` per setting (its episodes, one line each, in ``teamrl eval``'s record format plus
    ``setting`` and ``episode``: the group member); return ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = []
    for i, r in enumerate(cal.results):
        name = f"setting{i}.jsonl"
        with (out_dir / name).open("w") as fh:
            for e in r.episodes:
                fh.write(json.dumps(e) + "\n")
        settings.append({"label": r.label, "overrides": list(r.overrides), "changes": list(r.changes),
                         "group_size": r.group_size, "figures": r.figures, "episodes_file": name})
    best = best_setting(cal)
    results = {
        "command": " ".join(shlex.quote(a) for a in command),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "checkpoint": None if checkpoint is None else str(checkpoint),
        "problems": cal.problems,
        "roles": list(cal.roles),
        "settings": settings,
        "skipped": cal.skipped,
        "advice": advice(cal),
        "best": None if best is None else {"label": best.label, "overrides": list(best.changes)},
        "config": json.loads(json.dumps(config_to_dict(cfg), default=str)),
    }
    (out_dir / RESULTS_FILE).write_text(json.dumps(results, indent=1) + "\n")
    return out_dir
