"""The learning benchmark's statistics (``bench/learning.py``): paired differences against the untrained team
and the warm start, accuracy cliffs and the training dynamics."""

from __future__ import annotations

import statistics
from typing import Any

from learning_grid import CLIFF_POINTS, DYNAMICS_WINDOW, Arm, ArmResult, Comparison, _policy_overrides, merge


def paired_vs_untrained(untrained: ArmResult, arm: ArmResult) -> dict[int, dict[str, Any]]:
    """Per seed both ran on the same held-out problems: the paired difference of ``arm`` - ``untrained``
    in normalised return (:func:`teamrl.trainer.evaluate.compare`), its standard error and whether it
    exceeds 2 standard errors."""
    from teamrl.trainer.evaluate import EvalRow, compare

    base = {s: (ids, sc) for s, ids, sc in zip(untrained.seeds, untrained.problem_ids, untrained.problem_scores)}
    out = {}
    for seed, ids, scores in zip(arm.seeds, arm.problem_ids, arm.problem_scores):
        if seed not in base or base[seed][0] != ids or not ids:
            continue  # not the same problems (or no untrained run of this seed yet): nothing to pair

        def row(method: str, values: list[float]) -> EvalRow:
            return EvalRow(method, statistics.mean(values), 0.0, len(values), 0.0, 0.0, scores=values)
        c = compare([row("team", scores), row("untrained", base[seed][1])])
        out[seed] = {"difference": c.difference, "stderr": c.stderr, "problems": c.problems, "beyond_noise": c.beyond_noise}
    return out


def warm_start_alone(comp: Comparison, results: list[ArmResult], arm: Arm | None = None) -> ArmResult | None:
    """The comparison's "warm start only" result (warm-started, not trained by RL), if it has that arm; for ``arm``,
    the one scored as the arm is: of its policy settings (an arm with ``policy.*`` overrides has a warm start of
    its own: per-role adapters) and with the most of its other settings (``task.agents=planner``: the team's warm
    start scored planner-alone), where the grid has it, else the first. Only a result that has run counts."""
    alone = [(a, r) for a, r in zip(comp.arms, results) if a.warm_start and not a.rl]
    if arm is not None:
        own = [(len(a.overrides), r) for a, r in alone if _policy_overrides(a) == _policy_overrides(arm)
               and set(a.overrides) <= set(arm.overrides) and r.scores]
        if own:
            return max(own, key=lambda x: x[0])[1]
    return next((r for _, r in alone), None)


def paired_vs_warm_start(comp: Comparison, results: list[ArmResult]) -> list[dict[int, dict[str, Any]] | None]:
    """Per arm: a warm-started RL arm's paired difference against its warm start alone (RL's own effect, the same
    statistics as :func:`paired_vs_untrained`; :func:`warm_start_alone` of the arm); None for every other arm or
    without a warm-start-only arm."""
    out: list[dict[int, dict[str, Any]] | None] = []
    for a, r in zip(comp.arms, results):
        warm = warm_start_alone(comp, results, a) if a.warm_start and a.rl else None
        out.append(paired_vs_untrained(warm, r) if warm is not None else None)
    return out


# the row label of an arm's run scored by another method (``Arm.also_eval``): "<arm>, <this>"
ALSO_LABELS = {"swapped": "swapped policies"}


def also_rows(arm: Arm, r: ArmResult, warm: ArmResult | None, arm_vs_warm: dict | None
              ) -> list[tuple[str, ArmResult, dict | None]]:
    """(method, result, paired vs the warm start) for each of ``arm.also_eval``: the arm's runs scored by that
    method, a row of their own (its scores per seed from the arm's cells; the training budget, episodes and
    tokens, is the arm's), paired with the warm start ``warm`` where the arm itself is (``arm_vs_warm``)."""
    rows = []
    for method in arm.also_eval:
        row = ArmResult(f"{r.label}, {ALSO_LABELS.get(method, method)}", episodes=r.episodes)
        for per_seed in r.also:
            if method in per_seed:
                merge(row, ArmResult(**per_seed[method]))
        rows.append((method, row, None if arm_vs_warm is None else paired_vs_untrained(warm, row)))
    return rows


def held_out_cliffs(results: list[ArmResult], points: float = CLIFF_POINTS) -> str:
    """The trained arms whose held-out accuracy fell more than ``points`` percentage points under the
    untrained team's (results[0]) on the same seed: an accuracy cliff (one line of Markdown)."""
    base = dict(zip(results[0].seeds, results[0].success))
    found = [f"{r.label} (seed {seed}: {100 * acc:.0f}% vs {100 * base[seed]:.0f}%)" for r in results[1:]
             for seed, acc in zip(r.seeds, r.success) if seed in base and 100 * (base[seed] - acc) > points]
    return (f"Accuracy cliffs (held-out accuracy more than {points:g} points under the untrained team's, same seed): "
            + ("; ".join(found) if found else "none") + ".")


def study_dynamics(results: list[ArmResult], window: int = DYNAMICS_WINDOW) -> list[dict[str, Any] | None]:
    """Per arm (None where it did not train): per seed, the training curve's peak (the highest mean of
    ``window`` consecutive steps, and the last step of that window), its final value (the mean of the last
    ``window`` steps) and how far it fell from the peak; the gradient norm per role, mean over seeds. A step
    samples a few problems only, so a window, not one step, makes a peak."""
    out: list[dict[str, Any] | None] = []
    for r in results:
        if not r.curves:
            out.append(None)
            continue
        peak, peak_step, final = [], [], []
        for curve in r.curves:
            w = min(window, len(curve))
            means = [statistics.mean(curve[i - w:i]) for i in range(w, len(curve) + 1)]
            best = max(range(len(means)), key=lambda i: (means[i], -i))  # the first of equal peaks
            peak.append(means[best])
            peak_step.append(best + w)
            final.append(means[-1])
        roles = sorted({role for norms in r.role_grad_norms for role in norms})
        out.append({"peak": peak, "peak_step": peak_step, "final": final,
                    "fell_from_peak": [p - f for p, f in zip(peak, final)],
                    "role_grad_norm": {role: statistics.mean(n[role] for n in r.role_grad_norms if role in n) for role in roles},
                    "held_out": [held_out_dynamics(curve) for curve in r.eval_curves]})
    return out


def held_out_dynamics(curve: list[list[float]], points: float = CLIFF_POINTS) -> dict[str, Any] | None:
    """One run's held-out accuracy evaluated during training ([step, accuracy] pairs, from step 0): its peak and
    that step, its final value, and its cliffs (evaluations more than ``points`` percentage points under the running
    peak, as the trainer's ``train.cliff_points`` counts them); None when the run evaluated nothing."""
    from teamrl.trainer.diagnostics import CliffDetector

    if not curve:
        return None
    watch = CliffDetector(points)
    for step, acc in curve:
        watch.update(int(step), acc)
    return {"start": curve[0][1], "peak": watch.peak, "peak_step": watch.peak_step, "final": curve[-1][1],
            "cliffs": len(watch.cliffs)}


SPIKE_FACTOR = 3.0  # a step whose gradient norm is over this many times its run's median is a spike


def grad_norm_stats(r: ArmResult, factor: float = SPIKE_FACTOR) -> list[dict[str, Any] | None]:
    """Per seed (None where the run recorded none): the median and the largest of its steps' gradient norms (before
    clipping) and its spikes, the steps over ``factor`` times the median (Dr. MAS's instability)."""
    out: list[dict[str, Any] | None] = []
    for norms in r.grad_norms:
        if not norms:
            out.append(None)
            continue
        median = statistics.median(norms)
        out.append({"median": median, "max": max(norms), "steps": len(norms),
                    "spikes": sum(n > factor * median for n in norms) if median > 0 else 0})
    return out
