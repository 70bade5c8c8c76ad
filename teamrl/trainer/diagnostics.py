"""Training-dynamics diagnostics: role capture, accuracy cliffs and the learning signal.

- **Role capture**: each role type's share of the summed per-role gradient norms. Under a
  shared policy one role (often the one with the most samples or the longest completions)
  can dominate the update; a share near 1 says it has captured the policy.
- **Accuracy cliff**: an evaluation accuracy more than ``drop_points`` percentage points under
  the running peak. Isolated policies can reach higher peaks and then fall off late in
  training, so the trainer warns, keeps the best checkpoint, and can stop.
- **Learning signal**: the share of comparison groups with a non-zero advantage (per role too)
  and of samples that reach the loss, every step (:func:`learning_signal`), and one line for a
  whole run (:func:`signal_summary`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Sequence


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


# ---- learning signal ---------------------------------------------------------------------------
# A comparison group whose samples all scored alike gets advantage 0 for every member: it teaches
# the policy nothing (the commonest cause of a GRPO run that "trains" and does not move). These
# metrics say, every step, how much of the batch carried signal.

def learning_signal(samples: Sequence[Any], roles: Sequence[str] = (),
                    contributes: Callable[[Any], bool] | None = None) -> dict[str, float]:
    """Per-step signal diagnostics of the trained samples (their advantages already assigned).

    - ``signal/groups``: comparison groups (``Sample.group``) among ``samples``;
    - ``signal/groups_with_signal``: those with a non-zero advantage (rewards not all equal; with
      ``train.advantage=max``, a reward unlike the greedy baseline's);
    - ``signal/groups_varied``: their share; ``signal/groups_varied/<role>`` the share among the groups
      holding samples of that declared role (``roles``; an instance ``generator0`` counts as ``generator``);
    - ``signal/samples_in_loss``: the share of samples for which ``contributes`` (the update's own rule,
      :func:`teamrl.trainer.update.contributes_to_loss`) is true, i.e. that reach the loss (default: advantage != 0).
    """
    from teamrl.policies.router import declared_role

    if not samples:
        return {}
    contributes = contributes or (lambda s: (s.advantage or 0.0) != 0)
    groups: dict[Hashable, bool] = {}
    members: dict[str, set[Hashable]] = {}
    types = list(dict.fromkeys(roles))
    for s in samples:
        groups[s.group] = groups.get(s.group, False) or (s.advantage or 0.0) != 0
        try:
            role = declared_role(s.role, types) if types else s.role
        except KeyError:  # a role outside the declared ones (a sub-agent): its own name
            role = s.role
        members.setdefault(role, set()).add(s.group)
    varied = sum(groups.values())
    out = {"signal/groups": float(len(groups)), "signal/groups_with_signal": float(varied),
           "signal/groups_varied": varied / len(groups),
           "signal/samples_in_loss": sum(bool(contributes(s)) for s in samples) / len(samples)}
    for role, own in members.items():
        out[f"signal/groups_varied/{role}"] = sum(groups[g] for g in own) / len(own)
    return out


def signal_summary(metrics: Sequence[Mapping[str, Any]]) -> str | None:
    """One line on a run's learning signal over its logged steps (None where no step logged it):
    ``no learning signal: 0 of N groups varied ...`` when every advantage was 0, else
    ``learning signal: k of N groups varied (x%) ...`` (``little learning signal`` under 5%)."""
    steps = [m for m in metrics if "signal/groups" in m]
    if not steps:
        return None
    n = int(sum(m["signal/groups"] for m in steps))
    k = int(sum(m["signal/groups_with_signal"] for m in steps))
    where = f"over {len(steps)} step{'s' * (len(steps) != 1)}"
    if k == 0:
        return (
            f"no learning signal: 0 of {n} groups varied {where} (every sample of a group scored alike, so every "
            "advantage was 0 and the rewards taught nothing: make the task easier, warm start, or sample larger groups)"
        )
    share = k / n
    in_loss = sum(m.get("signal/samples_in_loss", 0.0) for m in steps) / len(steps)
    return (
        f"{'little ' if share < 0.05 else ''}learning signal: {k} of {n} groups varied ({100 * share:.0f}%) {where}; "
        f"{100 * in_loss:.0f}% of trained samples reached the loss"
    )
