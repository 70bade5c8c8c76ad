"""What a run's report shows, read from its directory: its ``metrics.jsonl`` (:func:`read_report_metrics`), the
latest ``teamrl eval`` results, its workflow, the charts it gets (:data:`PLOTS`, :func:`plot_groups`), the summary
line and the warm start's. Both pages draw on it: the Markdown and PNGs (:mod:`teamrl.trainer.report`) and the
self-contained HTML page (:mod:`teamrl.trainer.report_html`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable



# (file stem, title, metric-name prefixes to draw on that plot)
PLOTS = (
    (
        "reward",
        "reward and normalised return",
        ("reward_mean", "normalised_return", "normalised_return_last_turn", "greedy_reward_mean"),
    ),
    ("reward_per_agent", "reward per agent", ("reward/",)),
    ("response_length", "completion length (tokens)", ("completion_len",)),
    ("loss", "loss per policy", ("loss/",)),
    ("grad_norm", "gradient norm per policy (before clipping)", ("grad_norm/",)),
    ("kl", "KL to the reference per policy", ("kl/",)),
    (
        "timing",
        "seconds per phase of a step: collect (the rollout), learn (advantages and updates), publish (the weight "
        "sync), evaluate",
        ("timing/",),
    ),
    (
        "signal",
        "learning signal: share of groups with a non-zero advantage (per role), of samples in the loss",
        ("signal/groups_varied", "signal/samples_in_loss"),
    ),
    (
        "accuracy",
        "episode accuracy (train) and held-out greedy accuracy",
        ("accuracy", "first_attempt_accuracy", "eval/accuracy", "eval/peak_accuracy"),
    ),
    ("role_grad_norm", "gradient norm per role type", ("role_grad_norm/",)),
    ("role_capture", "role capture: share of the summed gradient norm", ("role_capture/",)),
    ("role_loss", "loss share per role type", ("role_loss/",)),
    ("role_entropy", "entropy per role type (and per policy)", ("role_entropy/", "entropy/")),
    ("eval_opt", "Eval-Opt: evaluator verdicts vs truth, iterations", ("evaluator/", "iterations_mean")),
    ("voting", "Voting: generator agreement, oracle, aggregator misses and recoveries", ("voting/",)),
    ("orch_workers", "Orch-Workers: subtasks per plan, over-limit rate", ("orch/",)),
)


# the PLOTS of one shipped workflow's statistics: titled by that workflow only on its own runs (a user's workflow
# may log orch/* or evaluator/* too; its chart must not claim to be Orch-Workers or Eval-Opt)
WORKFLOW_PLOTS = frozenset({"eval_opt", "voting", "orch_workers"})


def run_workflow(run_dir: Path) -> str | None:
    """The ``workflow.name`` of the run's ``config.yaml``; None without one (or without the file)."""
    conf = Path(run_dir) / "config.yaml"
    if not conf.is_file():
        return None
    import yaml

    try:
        data = yaml.safe_load(conf.read_text()) or {}
    except yaml.YAMLError:
        return None
    workflow = data.get("workflow") if isinstance(data, dict) else None
    name = workflow.get("name") if isinstance(workflow, dict) else None
    return str(name) if name else None


def _family_title(prefixes: Iterable[str]) -> str:
    """A chart title from metric prefixes alone: ``orch/`` -> ``orch/*``."""
    return ", ".join(p + "*" if p.endswith("/") else p for p in prefixes)


def plot_groups(everything: list[dict], workflow: str | None) -> list[tuple[str, str, "Series"]]:
    """(file stem, title, series) of every chart: each :data:`PLOTS` group (a shipped workflow's title only on
    that workflow's run, else one from its prefixes), then one per other family of per-step metrics
    (``critic/*``: the part of the name before its first '/'), titled by its prefix. Empty groups are kept."""
    groups, covered = [], set()
    for stem, title, prefixes in PLOTS:
        series = _series(everything, prefixes)
        covered |= set(series)
        groups.append(
            (stem, title if stem not in WORKFLOW_PLOTS or workflow == stem else _family_title(prefixes), series)
        )
    families: dict[str, list[str]] = {}
    for k in sorted({k for m in everything for k, v in m.items()
                     if "/" in k and isinstance(v, (int, float)) and not isinstance(v, bool)} - covered):
        families.setdefault(k.split("/")[0], []).append(k)
    taken = {stem for stem, _, _ in PLOTS}
    for family, keys in families.items():
        stem = "stats_" + re.sub(r"[^A-Za-z0-9_.-]", "_", family)
        while stem in taken:  # two families that differ only in unsafe characters
            stem += "_"
        taken.add(stem)
        groups.append((stem, _family_title([family + "/"]), _series(everything, tuple(k for k in keys))))
    return groups


def _series(metrics: list[dict], prefixes: tuple[str, ...]) -> "Series":
    names = sorted(
        {
            k
            for m in metrics
            for k in m
            if any(k == p or (p.endswith("/") and k.startswith(p)) or k.startswith(p + "/") for p in prefixes)
        }
    )
    out = {}
    for n in names:
        pts = [(m["step"], m[n]) for m in metrics if isinstance(m.get(n), (int, float))]
        if pts:
            out[n] = ([p[0] for p in pts], [p[1] for p in pts])
    return out


Series = dict[str, tuple[list[int], list[float]]]


def warm_start_note(run_dir: Path) -> str | None:
    """What a run that holds a warm start (``teamrl sft`` wrote ``sft.jsonl``) and no RL step yet has, in one line
    (the demonstration loss per policy, first step -> last); None for a folder without a warm start."""
    path = Path(run_dir) / "sft.jsonl"
    if not path.is_file():
        return None
    losses: dict[str, list[float]] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and isinstance(r.get("policy"), str) and isinstance(r.get("loss"), (int, float)):
            losses.setdefault(r["policy"], []).append(float(r["loss"]))
    loss = "; ".join(f"policy {name}: demonstration loss {v[0]:.3f} -> {v[-1]:.3f} over {len(v)} steps"
                     for name, v in losses.items())
    return (f"This run holds a warm start (teamrl sft{': ' + loss if loss else ''}) and no RL step yet: continue "
            f"with teamrl train ... name={Path(run_dir).name} --resume.")
def warm_start_summary(run_dir: Path, everything: list[dict[str, Any]]) -> str | None:
    """One line on the run's warm start (``RUN_DIR/warm_start.json``): that RL resumed from it, what it was
    trained on, and its held-out accuracy (the step-0 evaluation) where the run evaluated; None without one."""
    from teamrl.trainer.checkpoint import describe_warm_start, warm_start_of

    record = warm_start_of(run_dir)
    if record is None:
        return None
    line = describe_warm_start(record)
    step0 = next((r["eval/accuracy"] for r in everything if r.get("step") == 0 and "eval/accuracy" in r), None)
    if step0 is not None and record.get("rl_resumed_from"):
        line += f"; its held-out accuracy (step 0): {step0:.3f}"
    return line[0].upper() + line[1:]


def read_report_metrics(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """(the records of ``metrics.jsonl`` that are records of a step, the numbers of the lines that are not). A record
    is a JSON object with an integer ``step`` whose values are numbers, booleans or null (a NaN the run logged);
    anything else (a list, a string step, no step, a string where a number goes) is skipped and counted."""
    records, skipped = [], []
    for n, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError:
            r = None
        ok = (isinstance(r, dict) and type(r.get("step")) is int
              and all(v is None or isinstance(v, (int, float)) for v in r.values()))
        if ok:
            records.append(r)
        else:
            skipped.append(n)
    return records, skipped


def read_results(path: Path) -> dict[str, Any]:
    """``results.json`` of ``teamrl eval``: a JSON object whose ``methods`` maps each method to an object; anything
    else is a ValueError naming the file."""
    try:
        results = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not a results file of teamrl eval ({e})") from None
    methods = results.get("methods") if isinstance(results, dict) else None
    if not isinstance(methods, dict) or not all(isinstance(m, dict) for m in methods.values()):
        raise ValueError(f"{path}: not a results file of teamrl eval (it must be an object whose 'methods' maps each "
                         "method to an object)")
    return results


def latest_results(run_dir: Path) -> Path | None:
    """The newest ``RUN_DIR/eval/*/results.json`` (the last written), or None."""
    found = sorted(Path(run_dir).glob("eval/*/results.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def summary(metrics: list[dict]) -> tuple[str, int, float, float, float]:
    """(the main reward key, k, its mean over the first k steps, over the last k, seconds per step)."""
    main = "normalised_return" if "normalised_return" in metrics[0] else "reward_mean"
    # a step whose turn-0 groups were all dropped has none
    values = [m[main] for m in metrics if isinstance(m.get(main), (int, float))]
    k = min(3, len(values))
    first = sum(values[:k]) / k if k else float("nan")
    last = sum(values[-k:]) / k if k else float("nan")
    # the asynchronous loop's rollouts overlap the updates: a step costs its update and the wait for its rollout
    secs = sum(m.get("update_s", 0) + m.get("async/trainer_wait_s", m.get("rollout_s", 0)) for m in metrics)
    return main, k, first, last, secs / len(metrics)
