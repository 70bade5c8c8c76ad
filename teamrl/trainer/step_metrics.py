"""The metrics record of one training step: what was collected, what the learner reported, per role and per policy.

The trainer calls these after the learn and publish phases of a step
(:meth:`teamrl.trainer.trainer.Trainer.train_step`); each returns a part of the record written to ``metrics.jsonl``.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import torch

from teamrl.algorithms.base import FinishedEpisode
from teamrl.core.sample import Sample
from teamrl.policies.router import declared_role
from teamrl.trainer.diagnostics import role_capture
from teamrl.trainer.update import IMPORTANCE_STATS, combine_importance_stats

# Statistics of several optimizer steps of one policy (policy.equalize_steps false) that add up; every other one is
# the mean over the steps that have it (a role's gradient norm: the mean over the steps that trained it, as the
# workflow study defines it and verl's reduce_metrics averages).
SUMMED_OVER_STEPS = ("tokens", "skipped_steps", "skipped_no_signal")


def over_steps(stat: str, values: Sequence[float]) -> float:
    """One statistic of a policy's (or role's) optimizer steps of an iteration: the sum for :data:`SUMMED_OVER_STEPS`,
    else the mean."""
    return sum(values) if stat in SUMMED_OVER_STEPS else sum(values) / len(values)


def learner_metrics(steps: dict[str, list[dict[str, float]]], parts: dict[str, list[list[Sample]]]
                    ) -> tuple[dict[str, float], dict[str, float]]:
    """(``<stat>/<policy>`` over each policy's optimizer steps, ``<stat>@<role>`` over the steps that measured it)
    from the learner's per-step statistics ``steps`` of the ``parts`` it trained."""
    record: dict[str, float] = {}
    role_stats: dict[str, list[float]] = {}
    for name, policy_parts in parts.items():
        policy_stats: dict[str, list[float]] = {}
        for part_stats in steps[name]:
            for k, v in part_stats.items():
                if "@" in k:
                    role_stats.setdefault(k, []).append(v)
                elif k not in IMPORTANCE_STATS:  # those are of every step's weights (below)
                    policy_stats.setdefault(k, []).append(v)
        record.update({f"{k}/{name}": over_steps(k, v) for k, v in policy_stats.items()})
        record.update({f"{k}/{name}": v for k, v in combine_importance_stats(steps[name]).items()})
        record[f"optimizer_steps/{name}"] = len([p for p in policy_parts if p]) - int(
            record.get(f"skipped_steps/{name}", 0)
        )
    return record, {k: over_steps(k.split("@", 1)[0], v) for k, v in role_stats.items()}


def sample_metrics(train_samples: list[Sample]) -> dict[str, float]:
    """Reward and length of the trained samples, their share that ended at EOS."""
    rewards = torch.tensor([s.reward for s in train_samples])
    lengths = torch.tensor([len(s.completion_ids) for s in train_samples], dtype=torch.float32)
    out = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
           "reward_max": float(rewards.max()), "completion_len": float(lengths.mean()),
           "eos_frac": sum(s.finish_reason == "eos" for s in train_samples) / len(train_samples)}
    return out


def role_metrics(samples: list[Sample], roles: Sequence[str], role_stats: dict[str, float], record: dict[str, Any],
                 route: Callable[[str], str], shared: bool) -> dict[str, float]:
    """Per declared role (its instances ``generator0..`` included): reward, response length and, when measured, loss,
    entropy, gradient norm and role capture (share of the summed gradient norms). ``role_stats``: the learner's
    ``<stat>@<role>``; without them and not ``shared``, a role's gradient norm is its policy's (``record``)."""
    out: dict[str, float] = {}
    types = list(dict.fromkeys(roles))
    for t in types:
        own = [s for s in samples if declared_role(s.role, types) == t]
        if own:
            out[f"reward/{t}"] = sum(s.reward for s in own) / len(own)
            out[f"completion_len/{t}"] = sum(len(s.completion_ids) for s in own) / len(own)
    norms = {t: role_stats[f"grad_norm@{t}"] for t in types if f"grad_norm@{t}" in role_stats}
    for t in types:
        for k in ("loss", "entropy"):
            if f"{k}@{t}" in role_stats:
                out[f"role_{k}/{t}"] = role_stats[f"{k}@{t}"]
    if not norms and not shared:  # one policy per role type: its norm is the role's
        norms = {t: record[f"grad_norm/{route(t)}"] for t in types if f"grad_norm/{route(t)}" in record}
    for t, v in norms.items():
        out[f"role_grad_norm/{t}"] = v
    if len(norms) > 1 and sum(norms.values()) > 0:  # no gradient (all advantages 0): capture is undefined
        out.update({f"role_capture/{t}": v for t, v in role_capture(norms).items()})
    return out


def staleness_metrics(policies: Sequence[str], versions: dict[str, int], train_samples: list[Sample], k: int,
                      dropped: tuple[int, int]) -> dict[str, float]:
    """``async/*`` of a collector ahead of the learner: per policy, how many trained samples were n = 0..k updates
    behind its version now (``versions``) and the mean, and the share dropped as too stale (``dropped``: (dropped,
    looked at))."""
    out: dict[str, float] = {}
    for name in policies:
        behind = [versions[name] - s.policy_version for s in train_samples if s.policy == name]
        if not behind:
            continue
        for n in range(k + 1):
            out[f"async/staleness/{name}/{n}"] = float(sum(b == n for b in behind))
        out[f"async/staleness_mean/{name}"] = sum(behind) / len(behind)
    out["async/dropped_stale_share"] = dropped[0] / dropped[1] if dropped[1] else 0.0
    return out


def episode_outcome_line(e: FinishedEpisode) -> str:
    """One line of ``episodes/outcomes_<step>.jsonl`` (JSON): which episode (``where``: e.g. MAGRPO's path of
    joint actions), its team return and final reward, and what the workflow returned (correct, answer, stats;
    a stats value JSON cannot hold is written as its ``str``, a whole ``stats`` with non-text keys as its ``repr``)."""
    outcome = e.result.outcome
    record = {
        "problem_id": e.problem_id,
        "episode": e.episode,
        **e.where,
        "team_return": e.result.team_return,
        "final_reward": e.result.final_reward,
        **(
            {"correct": outcome.correct, "answer": outcome.answer, "stats": outcome.stats}
            if outcome is not None
            else {}
        ),
    }
    try:
        return json.dumps(record, default=str)
    except TypeError:  # a dict key json cannot write (a tuple) inside stats
        return json.dumps({**record, "stats": repr(record.get("stats"))}, default=str)
