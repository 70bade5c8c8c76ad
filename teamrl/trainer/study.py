"""``teamrl study CONFIG``: the workflow study's grid, run cell by cell, summarised as one table.

A study config names a base training config, the grid (workflows x policy sharing x tasks x
models x seeds) and the baselines::

    name: study_cpu
    base: configs/study_base.yaml      # a training config (its workflow/policy/task/model/seed are set per cell)
    overrides: [train.steps=4]         # applied to every cell
    workflows: [voting, eval_opt]      # eval_opt, voting, orch_workers
    policies: [sp, ip]                 # sp: one LoRA adapter for every role; ip: one per role type
    tasks: [{name: math.solve, num_problems: 40, test_size: 8}]
    models: [smollm2-135m]
    seeds: [0]
    single_agent: true                 # also train the single-agent RL baseline per task x model x seed

Every cell is a normal run directory ``<run.dir>/<study name>/<cell>`` trained with evaluation
during training (``train.eval_every``); its step-0 evaluation is the untrained workflow's
accuracy. A finished cell writes ``summary.json`` and is skipped when the study runs again; an
unfinished one resumes from its last checkpoint. The study writes ``study.md``: per workflow and
policy, untrained, peak and final held-out accuracy (means over seeds), multi-agent RL minus
single-agent RL in points, and cliffs; plus ``accuracy.png`` and ``role_capture.png``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from teamrl.core.config import ConfigError, build_dataclass, load_config, option, read_yaml_mapping
from teamrl.core.options import check_memory
from teamrl.core.metrics import accuracy_summary, read_metrics, training_records

POLICY_MODES = {"sp": "shared", "ip": "lora_per_role"}
# Every cell is a training run, and every cell's config is built and checked before the first trains: a grid is
# bounded in cells, and in the memory those configs take (a checked cell config holds about 2.4 KB)
MAX_STUDY_CELLS = 10_000
BYTES_PER_STUDY_CELL = 2048


@dataclass
class StudyConfig:
    name: str = option("study", doc="study name; cells go to <run.dir>/<name>/")
    base: str = option("", doc="the training config every cell starts from (a YAML path); empty: the defaults")
    overrides: list[str] = option(factory=list, doc="key.sub=value overrides applied to every cell")
    workflows: list[str] = option(factory=lambda: ["eval_opt", "voting", "orch_workers"], doc="multi-agent workflows")
    policies: list[str] = option(
        factory=lambda: ["sp", "ip"], doc="sp (shared policy) and/or ip (one adapter per role type)"
    )
    tasks: list[dict[str, Any]] = option(
        factory=lambda: [{"name": "math.solve"}], doc="task mappings (math.solve, code.solve)"
    )
    models: list[str] = option(factory=lambda: ["smollm2-135m"], doc="model names")
    seeds: list[int] = option(factory=lambda: [0], doc="seeds")
    single_agent: bool = option(True, doc="also train the single-agent RL baseline (workflow single)")


@dataclass(frozen=True)
class Cell:
    """One run of the grid."""

    task_json: str  # the task mapping, as sorted JSON (a cell is hashable)
    model: str
    workflow: str
    policy: str  # sp | ip (the single-agent baseline: sp)
    seed: int

    @property
    def task(self) -> dict[str, Any]:
        return json.loads(self.task_json)

    @property
    def name(self) -> str:
        model = Path(self.model).name.replace("/", "_")
        return f"{self.task['name']}-{model}-{self.workflow}-{self.policy}-s{self.seed}"

    def overrides(self) -> list[str]:
        task = yaml.safe_dump(self.task, default_flow_style=True, width=10_000).strip()
        return [f"task={task}", f"model={self.model}", f"workflow.name={self.workflow}",
                f"policy.mode={POLICY_MODES[self.policy]}", f"seed={self.seed}"]


def load_study(path: str | Path) -> StudyConfig:
    """Read and validate a study config."""
    p = Path(path)
    study = build_dataclass(StudyConfig, read_yaml_mapping(p, "study config"))
    if study.base and not Path(study.base).is_file() and (p.parent / study.base).is_file():
        study.base = str(p.parent / study.base)  # relative to the study file rather than the current directory
    if study.base and not Path(study.base).is_file():
        raise ConfigError(
            f"base: {study.base!r} does not exist (a path relative to the current directory or to {p.parent})"
        )
    for w in study.workflows:
        if w not in ("eval_opt", "voting", "orch_workers"):
            raise ConfigError(
                f"workflows: {w!r} is not a multi-agent workflow; choose from eval_opt, voting, orch_workers"
            )
    for pol in study.policies:
        if pol not in POLICY_MODES:
            raise ConfigError(f"policies: {pol!r} is not known; choose from {sorted(POLICY_MODES)}")
    for t in study.tasks:
        if "name" not in t:
            raise ConfigError(f"tasks: {t!r} has no name (math.solve or code.solve)")
    if not (study.workflows and study.policies and study.tasks and study.models and study.seeds):
        raise ConfigError("workflows, policies, tasks, models and seeds must each list at least one value")
    check_grid_size(study)
    return study


def check_grid_size(study: StudyConfig) -> None:
    """Refuse, before any cell is built, a grid of more than MAX_STUDY_CELLS cells or whose cells' configs need
    more memory than this machine has: a :class:`ConfigError` naming the grid's factors."""
    runs = len(study.workflows) * len(study.policies) + int(study.single_agent)
    count = len(study.tasks) * len(study.models) * len(study.seeds) * runs
    how = (f"{len(study.tasks)} tasks x {len(study.models)} models x {len(study.seeds)} seeds x {runs} runs each: "
           f"{len(study.workflows)} workflows x {len(study.policies)} policies"
           + (" + the single-agent baseline" if study.single_agent else ""))
    if count > MAX_STUDY_CELLS:
        raise ConfigError(f"study grid: {count} cells ({how}); a study trains at most {MAX_STUDY_CELLS} runs: list "
                          "fewer tasks, models, seeds, workflows or policies (or split the grid into studies)")
    check_memory(f"study grid ({count} cells)", count * BYTES_PER_STUDY_CELL,
                 f"{how}; {BYTES_PER_STUDY_CELL} bytes per cell's checked config")


def cells(study: StudyConfig) -> list[Cell]:
    """Every run of the grid, the single-agent baselines first (per task x model x seed)."""
    out = []
    for t in study.tasks:
        task = json.dumps(t, sort_keys=True)
        for model in study.models:
            for seed in study.seeds:
                if study.single_agent:
                    out.append(Cell(task, model, "single", "sp", seed))
                out += [Cell(task, model, w, p, seed) for w in study.workflows for p in study.policies]
    return out


def cell_config(study: StudyConfig, cell: Cell):
    """The validated training config of one cell (evaluation during training is switched on if off)."""
    cfg = load_config(study.base or None, [*study.overrides, *cell.overrides(), f"name={cell.name}"])
    if cell.workflow == "single":  # workflow.options are the study workflows'; the single-agent baseline declares none
        cfg.workflow.options = {}
    if not cfg.train.eval_every:
        cfg.train.eval_every = max(1, cfg.train.steps // 4)
    cfg.run.dir = str(Path(cfg.run.dir) / study.name)
    return cfg


def summarise_run(run_dir: Path) -> dict[str, Any]:
    """Untrained, peak and final held-out accuracy, cliffs and the mean role capture of a run."""
    recs = read_metrics(run_dir / "metrics.jsonl")
    acc = accuracy_summary(recs)
    if acc is None:
        raise ValueError(f"{run_dir}: no evaluation records (train.eval_every)")
    train = training_records(recs)
    capture: dict[str, list[float]] = {}
    for r in train:
        for k, v in r.items():
            if k.startswith("role_capture/"):
                capture.setdefault(k.split("/", 1)[1], []).append(v)
    return {**acc, "steps": len(train), "seconds": sum(r.get("rollout_s", 0) + r.get("update_s", 0) for r in train),
            "role_capture": {k: sum(v) / len(v) for k, v in capture.items()}}


def run_study(study: StudyConfig, only_table: bool = False) -> Path:
    """Train every unfinished cell (resuming a killed one), then write the table; return its path."""
    from teamrl.trainer.trainer import Trainer

    grid = cells(study)
    configs = {c: cell_config(study, c) for c in grid}  # every cell's config is checked before anything trains
    root = Path(next(iter(configs.values())).run.dir)
    root.mkdir(parents=True, exist_ok=True)
    summaries: dict[Cell, dict[str, Any]] = {}
    for i, c in enumerate(grid, 1):
        cfg = configs[c]
        run_dir = root / c.name
        done = run_dir / "summary.json"
        if done.is_file():
            summaries[c] = json.loads(done.read_text())
            print(f"[{i}/{len(grid)}] {c.name}: done (skipped)", file=sys.stderr)
            continue
        if only_table:
            continue
        print(f"[{i}/{len(grid)}] {c.name}: training {cfg.train.steps} steps", file=sys.stderr)
        Trainer(cfg, resume=True).train()
        summaries[c] = summarise_run(run_dir)
        done.write_text(json.dumps(summaries[c], indent=1))
    return write_study_table(study, root, summaries)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def write_study_table(study: StudyConfig, root: Path, summaries: dict[Cell, dict[str, Any]]) -> Path:
    """``study.md`` (Table 1 style) and the dynamics plots; returns the page's path."""
    rows = [
        f"# Study {study.name}",
        "",
        "Held-out greedy accuracy (%), mean over seeds. Untrained = the workflow before training (step 0); "
        "Δ = multi-agent RL minus single-agent RL, in points. Cliffs: evaluations more than "
        "train.cliff_points under the running peak.",
        "",
        "| task | model | workflow | policy | seeds | untrained | peak | final | Δ peak vs SA-RL | Δ final vs SA-RL "
        "| cliffs | role capture | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = list(dict.fromkeys((c.task_json, c.model, c.workflow, c.policy) for c in summaries))
    for task_key, model, workflow, policy in keys:
        mine = [
            s
            for c, s in summaries.items()
            if (c.task_json, c.model, c.workflow, c.policy) == (task_key, model, workflow, policy)
        ]
        base = [s for c, s in summaries.items() if (c.task_json, c.model, c.workflow) == (task_key, model, "single")]
        peak, final = 100 * _mean([s["peak"] for s in mine]), 100 * _mean([s["final"] for s in mine])
        if workflow == "single" or not base:
            d_peak = d_final = "—"
        else:
            d_peak = f"{peak - 100 * _mean([s['peak'] for s in base]):+.1f}"
            d_final = f"{final - 100 * _mean([s['final'] for s in base]):+.1f}"
        capture = {}
        for s in mine:
            for r, v in s["role_capture"].items():
                capture.setdefault(r, []).append(v)
        cap = ", ".join(f"{r} {_mean(v):.2f}" for r, v in capture.items()) or "—"
        cliffs = sum(len(s["cliffs"]) for s in mine)
        secs = _mean([s["seconds"] / max(1, s["steps"]) for s in mine])
        rows.append(
            f"| {json.loads(task_key)['name']} | {Path(model).name} | {workflow} | {policy.upper()} | {len(mine)} | "
            f"{100 * _mean([s['untrained'] for s in mine]):.1f} | {peak:.1f} | {final:.1f} | {d_peak} | {d_final} | "
            f"{cliffs} | {cap} | {secs:.1f} |"
        )
    rows += ["", "Per-cell reports (per-role gradient norms, capture, entropy, workflow diagnostics): "
             "`teamrl report` on each cell directory, linked below.", ""]
    rows += [f"- [{c.name}]({c.name}/report/report.md)" for c in summaries]
    _plots(root, summaries, rows)
    path = root / "study.md"
    path.write_text("\n".join(rows) + "\n")
    return path


def _plots(root: Path, summaries: dict[Cell, dict[str, Any]], rows: list[str]) -> None:
    """``accuracy.png`` and ``role_capture.png`` over every cell, and each cell's own report."""
    from teamrl.trainer.report import save_line_plot, write_report

    accuracy, capture = {}, {}
    for c in summaries:
        recs = read_metrics(root / c.name / "metrics.jsonl")
        ev = [(r["step"], 100 * r["eval/accuracy"]) for r in recs if "eval/accuracy" in r]
        accuracy[f"{c.workflow}-{c.policy}-s{c.seed}"] = ([e[0] for e in ev], [e[1] for e in ev])
        for role in sorted({k.split("/", 1)[1] for r in recs for k in r if k.startswith("role_capture/")}):
            pts = [(r["step"], r[f"role_capture/{role}"]) for r in recs if f"role_capture/{role}" in r]
            capture[f"{c.workflow}-{c.policy}: {role}"] = ([p[0] for p in pts], [p[1] for p in pts])
        write_report(root / c.name)
    for series, stem, title, ylabel in ((accuracy, "accuracy", "held-out accuracy", "%"),
                                        (capture, "role_capture", "role capture (share of summed grad norm)", "share")):
        if series:
            save_line_plot(series, title, root / f"{stem}.png", ylabel=ylabel, size=(7, 3.6))
            rows += ["", f"![{title}]({stem}.png)"]
