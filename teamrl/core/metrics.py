"""The metrics sink: one JSON line per step in ``metrics.jsonl``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsSink:
    """Appends one JSON object per call; reopening for a resumed run drops steps past ``start_step``."""

    def __init__(self, path: Path, start_step: int = 0) -> None:
        self.path = Path(path)
        if self.path.exists():
            kept = [l for l in self.path.read_text().splitlines() if l.strip() and json.loads(l).get("step", 0) <= start_step]
            self.path.write_text("".join(l + "\n" for l in kept))

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl``."""
    return [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]
