"""``teamrl report RUN_DIR``: PNG plots of a run's metrics and a Markdown page that embeds them."""

from __future__ import annotations

from pathlib import Path

from teamrl.core.metrics import accuracy_summary, read_metrics, training_records

# (file stem, title, metric-name prefixes to draw on that plot)
PLOTS = (
    ("reward", "reward and normalised return", ("reward_mean", "normalised_return", "normalised_return_last_turn", "greedy_reward_mean")),
    ("reward_per_agent", "reward per agent", ("reward/",)),
    ("response_length", "completion length (tokens)", ("completion_len",)),
    ("loss", "loss per policy", ("loss/",)),
    ("grad_norm", "gradient norm per policy (before clipping)", ("grad_norm/",)),
    ("kl", "KL to the reference per policy", ("kl/",)),
    ("accuracy", "episode accuracy (train) and held-out greedy accuracy", ("accuracy", "first_attempt_accuracy", "eval/accuracy", "eval/peak_accuracy")),
    ("role_grad_norm", "gradient norm per role type", ("role_grad_norm/",)),
    ("role_capture", "role capture: share of the summed gradient norm", ("role_capture/",)),
    ("role_loss", "loss share per role type", ("role_loss/",)),
    ("role_entropy", "entropy per role type (and per policy)", ("role_entropy/", "entropy/")),
    ("eval_opt", "Eval-Opt: evaluator verdicts vs truth, iterations", ("evaluator/", "iterations_mean")),
    ("voting", "Voting: generator agreement, oracle, aggregator misses and recoveries", ("voting/",)),
    ("orch_workers", "Orch-Workers: subtasks per plan, over-limit rate", ("orch/",)),
)


def _series(metrics: list[dict], prefixes: tuple[str, ...]) -> "Series":
    names = sorted({k for m in metrics for k in m if any(k == p or (p.endswith("/") and k.startswith(p)) or k.startswith(p + "/") for p in prefixes)})
    out = {}
    for n in names:
        pts = [(m["step"], m[n]) for m in metrics if isinstance(m.get(n), (int, float))]
        if pts:
            out[n] = ([p[0] for p in pts], [p[1] for p in pts])
    return out


Series = dict[str, tuple[list[int], list[float]]]


def save_line_plot(series: Series, title: str, path: Path, ylabel: str | None = None, size: tuple[float, float] = (6, 3.2)) -> None:
    """One PNG: a line per series against step (points marked on short series)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size, dpi=100)
    for name, (x, y) in series.items():
        ax.plot(x, y, marker="." if len(x) < 40 else None, label=name)
    ax.set_xlabel("step")
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7 if len(series) < 8 else 6)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(run_dir: str | Path) -> Path:
    """Write ``RUN_DIR/report/*.png`` and ``RUN_DIR/report/report.md``; return the page's path."""
    run_dir = Path(run_dir)
    mfile = run_dir / "metrics.jsonl"
    if not mfile.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl; is it a run directory (runs/<name>)?")
    everything = read_metrics(mfile)
    metrics = training_records(everything)
    if not metrics:
        raise ValueError(f"{mfile} is empty: the run has not finished a step yet")
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    page = [f"# Run report: {run_dir.name}", ""]
    main = "normalised_return" if "normalised_return" in metrics[0] else "reward_mean"
    values = [m[main] for m in metrics if main in m]  # a step whose turn-0 groups were all dropped has no normalised_return
    k = min(3, len(values))
    first = sum(values[:k]) / k
    last = sum(values[-k:]) / k
    secs = sum(m.get("rollout_s", 0) + m.get("update_s", 0) for m in metrics)
    page += ["| steps | " + main + f", first {k} | " + main + f", last {k} | seconds per step |", "|---|---|---|---|",
             f"| {len(metrics)} | {first:.3f} | {last:.3f} | {secs / len(metrics):.1f} |", ""]
    acc = accuracy_summary(everything)
    if acc:
        page += ["| held-out accuracy: first | peak (step) | final | cliffs at steps |", "|---|---|---|---|",
                 f"| {acc['untrained']:.3f} | {acc['peak']:.3f} ({acc['peak_step']}) | {acc['final']:.3f} | "
                 f"{', '.join(map(str, acc['cliffs'])) or 'none'} |", ""]
    for stem, title, prefixes in PLOTS:
        series = _series(everything, prefixes)
        if not series:
            continue
        save_line_plot(series, title, out / f"{stem}.png")
        page += [f"## {title}", "", f"![{title}]({stem}.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(page))
    return path
