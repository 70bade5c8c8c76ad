"""The metrics sink: one JSON line per step in ``metrics.jsonl``, optionally TensorBoard and W&B too; and the
progress lines of long work outside the training loop (``teamrl sft``, ``teamrl eval``)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from teamrl.core.errors import InputError


class ProgressLines:
    """Progress of long work as lines on stderr, ``{prefix} 3/40 steps, loss 1.234, 00:12 elapsed, eta 02:28``: the
    first update, the last and one every ``every_s`` seconds between; nothing when ``enabled`` is false (``run.progress
    =false``, as for the training bar). Lines rather than a bar, so that a log file reads them too."""

    def __init__(self, prefix: str, total: int, unit: str, enabled: bool = True, every_s: float = 10.0) -> None:
        self.prefix, self.total, self.unit, self.enabled, self.every_s = prefix, total, unit, enabled, every_s
        self.start = time.perf_counter()
        self.shown_at: float | None = None

    def update(self, done: int, **figures: str) -> None:
        """``done`` of the ``total`` finished; ``figures`` (name -> text, such as ``loss="1.234"``) follow the count."""
        from tqdm import tqdm  # its time format, as on the training bar

        now = time.perf_counter()
        due = self.shown_at is None or done >= self.total or now - self.shown_at >= self.every_s
        if not self.enabled or not due:
            return
        elapsed = now - self.start
        parts = [f"{done}/{self.total} {self.unit}", *(f"{k} {v}" for k, v in figures.items()),
                 f"{tqdm.format_interval(elapsed)} elapsed"]
        if 0 < done < self.total:
            parts.append(f"eta {tqdm.format_interval(elapsed / done * (self.total - done))}")
        print(f"{self.prefix} " + ", ".join(parts), file=sys.stderr, flush=True)
        self.shown_at = now


class MetricsSink:
    """Appends one JSON object per step; reopening for a resumed run drops steps past ``start_step``.

    With ``tensorboard`` every numeric value is also written as a scalar under
    ``<run>/tensorboard``; with ``wandb`` to a W&B run (the ``wandb`` package must be installed).
    """

    def __init__(self, path: Path, start_step: int = 0, tensorboard: bool = False, wandb: bool = False,
                 wandb_project: str = "teamrl", run_name: str = "", config: dict | None = None) -> None:
        self.path = Path(path)
        if self.path.exists():
            records, cut = read_metrics_and_cut(self.path)
            if cut:
                print(f"teamrl: {self.path}: {cut}; dropped it (the run stopped while writing it)", file=sys.stderr)
            kept = [r for r in records if r.get("step", 0) <= start_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.path.parent / "tensorboard"), purge_step=start_step + 1)
        self._wandb = None
        if wandb:
            try:
                import wandb as wb
            except ImportError as e:
                raise RuntimeError("run.wandb=true but the wandb package is not installed: pip install wandb") from e
            self._wandb = wb.init(project=wandb_project, name=run_name, config=config, resume="allow")

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        step = int(record.get("step", 0))
        numeric = {
            k: v for k, v in clean.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
        }
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` (a last line cut short is left out: see :func:`read_metrics_and_cut`)."""
    return read_metrics_and_cut(path)[0]


def read_metrics_and_cut(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """(the records of a ``metrics.jsonl``, what was cut: a last line with no newline that is not JSON, as a run
    killed while writing it leaves, is left out and described, else None). Any other line that is not a JSON
    object is an :class:`InputError` naming the file and the line."""
    text = Path(path).read_text(errors="replace")
    lines = text.splitlines()
    records: list[dict[str, Any]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            if n == len(lines) and not text.endswith("\n"):
                return records, f"line {n} is cut short ({len(line)} characters, no end of line)"
            record, why = None, f"{type(e).__name__}: {' '.join(str(e).split())[:80]}"
        else:
            why = f"a JSON {type(record).__name__}"
        if not isinstance(record, dict):
            raise InputError(f"{path}: line {n} is not a JSON record of a step ({why}); remove or fix that line "
                             "(every line is one JSON object)")
        records.append(record)
    return records, None


def training_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of training steps (evaluation-only records, such as step 0's, left out)."""
    return [r for r in records if "reward_mean" in r]


def accuracy_summary(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Held-out accuracy over a run's evaluations: first (untrained), peak and its step, final and
    its step, and the steps flagged as cliffs; None when the run has no evaluation."""
    evals = [r for r in records if "eval/accuracy" in r]
    if not evals:
        return None
    best = max(evals, key=lambda r: r["eval/accuracy"])
    return {"untrained": evals[0]["eval/accuracy"], "peak": best["eval/accuracy"], "peak_step": best["step"],
            "final": evals[-1]["eval/accuracy"], "final_step": evals[-1]["step"],
            "cliffs": [r["step"] for r in evals if r.get("eval/cliff")]}

