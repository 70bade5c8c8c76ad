"""Training-dynamics diagnostics of the workflow study: role capture and accuracy cliffs.

- **Role capture**: each role type's share of the summed per-role gradient norms. Under a
  shared policy one role (often the one with the most samples or the longest completions)
  can dominate the update; a share near 1 says it has captured the policy.
- **Accuracy cliff**: an evaluation accuracy more than ``drop_points`` percentage points under
  the running peak. Isolated policies can reach higher peaks and then fall off late in
  training, so the trainer warns, keeps the best checkpoint, and can stop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping


def role_capture(grad_norms: Mapping[str, float]) -> dict[str, float]:
    """Each role's share of the summed gradient norms (all 0 when every norm is 0)."""
    bad = {r: v for r, v in grad_norms.items() if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)}
    if bad:
        raise ValueError(f"role_capture: gradient norms must be finite and >= 0, got {bad}")
    total = sum(grad_norms.values())
    return {r: (v / total if total > 0 else 0.0) for r, v in grad_norms.items()}


@dataclass
class CliffEvent:
    """What one evaluation meant: a new ``peak``, a ``cliff``, or nothing (``kind`` None)."""

    kind: str | None
    accuracy: float
    peak: float
    peak_step: int
    drop_points: float  # peak - accuracy, in percentage points (0 at a peak)


class CliffDetector:
    """Tracks the running peak of evaluation accuracy and flags drops of more than ``drop_points``.

    Feed it every evaluation in step order with :meth:`update`; a series can be replayed (on
    resume) by feeding the logged evaluations again.
    """

    def __init__(self, drop_points: float) -> None:
        if not drop_points > 0:
            raise ValueError(f"drop_points={drop_points!r}: must be > 0 (percentage points under the peak)")
        self.drop_points = float(drop_points)
        self.peak: float | None = None
        self.peak_step = -1
        self.cliffs: list[int] = []  # steps at which a cliff was flagged

    def update(self, step: int, accuracy: float) -> CliffEvent:
        """Record the accuracy (in [0, 1]) of the evaluation at ``step``."""
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"accuracy={accuracy!r} at step {step}: must be in [0, 1]")
        if self.peak is None or accuracy > self.peak:
            self.peak, self.peak_step = accuracy, step
            return CliffEvent("peak", accuracy, accuracy, step, 0.0)
        drop = 100.0 * (self.peak - accuracy)
        if drop > self.drop_points:
            self.cliffs.append(step)
            return CliffEvent("cliff", accuracy, self.peak, self.peak_step, drop)
        return CliffEvent(None, accuracy, self.peak, self.peak_step, drop)
