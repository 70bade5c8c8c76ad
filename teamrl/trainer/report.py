"""``teamrl report RUN_DIR``: ``RUN_DIR/report/index.html``, one self-contained page, plus PNG plots
and a Markdown page that embeds them.

Here: the PNG plots and the Markdown page, and :func:`write_report`, which writes all three. What they show is read
from the run by :mod:`teamrl.trainer.report_data`; the HTML page, self-contained and opening offline, is
:mod:`teamrl.trainer.report_html`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from teamrl.core.metrics import accuracy_summary, training_records
from teamrl.trainer.report_data import (Series, latest_results, plot_groups, read_report_metrics, read_results,
                                        run_workflow, summary, warm_start_note, warm_start_summary)
from teamrl.trainer.report_html import render_html


def save_line_plot(
    series: Series, title: str, path: Path, ylabel: str | None = None, size: tuple[float, float] = (6, 3.2)
) -> None:
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
    """Write ``RUN_DIR/report/index.html``, ``RUN_DIR/report/*.png`` and ``RUN_DIR/report/report.md``;
    return the HTML page's path."""
    run_dir = Path(run_dir)
    mfile = run_dir / "metrics.jsonl"
    if not mfile.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl; is it a run directory (runs/<name>)?")
    everything, skipped = read_report_metrics(mfile)
    metrics = training_records(everything)
    warm = None if metrics else warm_start_note(run_dir)
    if not metrics and warm is None:
        raise ValueError(f"{mfile} is empty: the run has not finished a step yet")
    out = run_dir / "report"
    try:
        out.mkdir(exist_ok=True)
    except FileExistsError:
        raise ValueError(f"{out} is a file, not a folder: remove or rename it, and the report goes there") from None
    page = [f"# Run report: {run_dir.name}", ""]
    if skipped:
        note = (f"{mfile}: skipped {len(skipped)} malformed line{'s' if len(skipped) > 1 else ''} (line "
                f"{', '.join(map(str, skipped[:5]))}{', ...' if len(skipped) > 5 else ''}): not a record of a step")
        print(f"teamrl report: {note}", file=sys.stderr)
        page += [note, ""]
    if warm is not None:
        page += [warm, ""]
    else:
        main, k, first, last, secs = summary(metrics)
        page += ["| steps | " + main + f", first {k} | " + main + f", last {k} | seconds per step |",
                 "|---|---|---|---|", f"| {len(metrics)} | {first:.3f} | {last:.3f} | {secs:.1f} |", ""]
        resumed = warm_start_summary(run_dir, everything)
        if resumed:
            page += [resumed, ""]
    acc = accuracy_summary(everything)
    if acc:
        page += ["| held-out accuracy: first | peak (step) | final | cliffs at steps |", "|---|---|---|---|",
                 f"| {acc['untrained']:.3f} | {acc['peak']:.3f} ({acc['peak_step']}) | {acc['final']:.3f} | "
                 f"{', '.join(map(str, acc['cliffs'])) or 'none'} |", ""]
    results_file = latest_results(run_dir)
    results = read_results(results_file) if results_file else None
    page += ["The HTML report, with every eval transcript and the training episodes: [index.html](index.html)", ""]
    try:
        if results is not None:
            from teamrl.trainer.evaluate import format_table, rows_from_results

            page[-2:-2] = [
                f"## Latest eval ({results_file.parent.name})",
                "",
                format_table(rows_from_results(results)),
                "",
            ]
        # first: it reads the eval's and episodes' files
        html_page = render_html(run_dir, everything, results_file, results)
    except (KeyError, TypeError, AttributeError) as e:  # a field missing or of another type than eval writes
        raise ValueError(f"{results_file}: not a results file of teamrl eval ({type(e).__name__}: {e})") from None
    for stem, title, series in plot_groups(everything, run_workflow(run_dir)):
        if not series:
            continue
        save_line_plot(series, title, out / f"{stem}.png")
        page += [f"## {title}", "", f"![{title}]({stem}.png)", ""]
    (out / "report.md").write_text("\n".join(page))
    path = out / "index.html"
    path.write_text(html_page)
    return path
