"""One policy's update from its own samples: log-probs, the PPO-style loss, one optimizer step."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Hashable, Protocol, Sequence

import torch

from teamrl.core.config import Config, InputError, LossConfig, TrainConfig
from teamrl.core.memory import trim_freed_memory
from teamrl.core.sample import Sample
from teamrl.losses import completion_mask, policy_loss
from teamrl.policies.logprobs import (
    SharedPrefixBatch,
    Temperature,
    TokenBatch,
    build_shared_prefix_batch,
    build_token_batch,
    completion_logprobs,
    shared_prefix_backward,
    shared_prefix_logprobs,
    to_device,
)
from teamrl.policies.policy import Policy
from teamrl.policies.router import declared_role, role_type


# The train section's fields that an update reads; their defaults are TrainConfig's (one source)
UPDATE_FIELDS = ("ppo_epochs", "micro_batch_size", "max_grad_norm", "noise_grad_norm", "role_grad_norms")
_TRAIN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in UPDATE_FIELDS}


@dataclass
class UpdateParams:
    """What one policy's update runs with: the resolved ``train.loss``, the ``train`` fields of :data:`UPDATE_FIELDS`
    (``role_grad_norms``: per role type, loss share, entropy, tokens and gradient norm) and the team's roles."""

    loss: LossConfig = field(default_factory=LossConfig)  # resolved (LossConfig.resolve)
    ppo_epochs: int = _TRAIN_DEFAULTS["ppo_epochs"]
    micro_batch_size: int = _TRAIN_DEFAULTS["micro_batch_size"]
    max_grad_norm: float = _TRAIN_DEFAULTS["max_grad_norm"]
    noise_grad_norm: float = _TRAIN_DEFAULTS["noise_grad_norm"]
    role_grad_norms: bool = _TRAIN_DEFAULTS["role_grad_norms"]
    # the team's declared roles: statistics per declared role each sample acts as (generator0 -> generator);
    # empty: per role name without its instance number
    roles: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # a loss built in Python, not by make_update_params: on-policy, and no warm start to pull toward
        if self.loss.importance_correction == "auto" or self.loss.kl_coef is None:
            self.loss = self.loss.resolve()


def make_update_params(cfg: Config, roles: Sequence[str] = ()) -> UpdateParams:
    """The update parameters a config asks for (every policy worker's): ``train.loss`` resolved against
    ``rollout`` (:meth:`LossConfig.resolve`), the ``train`` fields of :data:`UPDATE_FIELDS`;
    ``roles``: the team's declared roles, for per-role statistics."""
    return UpdateParams(loss=cfg.train.loss.resolve(cfg.rollout.max_staleness, cfg.rollout.max_new_tokens),
                        roles=tuple(roles), **{name: getattr(cfg.train, name) for name in UPDATE_FIELDS})


class NonFiniteReward(ValueError):
    """A reward is NaN or infinite (with ``train.nonfinite_reward: error``, the default)."""


def nonfinite_reward_groups(samples: Sequence[Sample], task: str, mode: str) -> set[Hashable]:
    """The comparison groups of ``samples`` that hold a NaN or infinite reward.

    One such reward makes its whole group's advantages NaN (the batch's, in ``batch`` mode), so
    with ``mode`` ``"error"`` the first one raises :class:`NonFiniteReward` naming the task,
    problem and role; with ``"drop_group"`` the groups are returned for the caller to leave out.
    """
    bad = [s for s in samples if isinstance(s.reward, (int, float)) and not math.isfinite(s.reward)]
    if bad and mode == "error":
        s = bad[0]
        raise NonFiniteReward(
            f"task {task!r}: reward {s.reward} for problem {s.problem_id!r}, role {s.role!r} (episode "
            f"{s.episode}, turn {s.turn}); rewards must be finite ({len(bad)} of {len(samples)} are not); "
            "train.nonfinite_reward=drop_group leaves their groups out of the update instead"
        )
    return {s.group for s in bad}


class SamplingLogprobsError(InputError):
    """A sample's sampling log-probs cannot weight the loss: not one per completion token, or not finite
    (the engine or server returned them so); raised before any pass, so nothing reaches the weights."""


def check_sampling_logprobs(samples: Sequence[Sample], mode: str) -> None:
    """Raise :class:`SamplingLogprobsError`, naming the first bad sample, unless every sample with a
    completion has one finite sampling log-prob per completion token (``mode``: the importance correction
    that reads them, for the message)."""
    for s in samples:
        lp = s.sampling_logprobs
        where = (f"policy {s.policy!r}: the sample of problem {s.problem_id!r}, role {s.role!r} (episode {s.episode}, "
                 f"turn {s.turn}, branch {s.branch})")
        fix = (
            f"train.loss.importance_correction={mode} weighs each token by exp(old - sampling log-prob), so it needs "
            "the engine's finite log-prob of every generated token; importance_correction=none trains without it"
        )
        if len(lp) != len(s.completion_ids):
            raise SamplingLogprobsError(
                f"{where} has {len(lp)} sampling log-probs for {len(s.completion_ids)} completion tokens; {fix}"
            )
        bad = next((i for i, x in enumerate(lp) if not math.isfinite(x)), None)
        if bad is not None:
            raise SamplingLogprobsError(f"{where} has sampling log-prob {lp[bad]} at token {bad} of "
                                        f"{len(s.completion_ids)}; {fix}")


# The importance-weight statistics of one update_policy step (train.loss.importance_correction token / sequence).
IMPORTANCE_STATS = ("is_weight_mean", "is_weight_max", "is_weight_min", "is_truncated_frac", "is_weight_count")


def combine_importance_stats(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """The importance-weight statistics of several :func:`update_policy` steps of one policy (``policy.equalize_steps``
    false: one step per role instance) as those of all their weights: counts add, the mean and the truncated share
    are weighted by count, the max and min are over every step. One step's are returned as they are; ``{}`` when no
    step has any."""
    weighted = [s for s in steps if s.get("is_weight_count")]
    if len(weighted) <= 1:
        return {k: weighted[0][k] for k in IMPORTANCE_STATS} if weighted else {}
    n = sum(s["is_weight_count"] for s in weighted)
    return {"is_weight_mean": sum(s["is_weight_mean"] * s["is_weight_count"] for s in weighted) / n,
            "is_weight_max": max(s["is_weight_max"] for s in weighted),
            "is_weight_min": min(s["is_weight_min"] for s in weighted),
            "is_truncated_frac": sum(s["is_truncated_frac"] * s["is_weight_count"] for s in weighted) / n,
            "is_weight_count": n}


def _padded(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """Per-sample float rows as one right-padded ``[B, width]`` float32 tensor (0 where a row is shorter)."""
    out = torch.nn.utils.rnn.pad_sequence([torch.tensor(list(r), dtype=torch.float32) for r in rows], batch_first=True)
    return torch.nn.functional.pad(out, (0, width - out.shape[1]))


# A micro-batch in which prompt padding would be more than this share of its token positions is split instead.
MAX_PADDING_SHARE = 0.05


def _plan_micro_batches(prompts: list[tuple[int, ...]], completion_lens: list[int], size: int) -> list[slice]:
    """Micro-batches of whole prompt groups, at most ``size`` samples unless one group alone is larger,
    that waste little compute on prompt padding.

    ``prompts`` is per sample, the samples of one prompt consecutive. Each distinct prompt runs once
    (shared prefix), left-padded to the micro-batch's longest, so a prompt's samples are never split
    over micro-batches (a group larger than ``size`` runs its completions in passes of at most
    ``size``, :func:`_rows_per_pass`). When adding a prompt would make its padding more than
    ``MAX_PADDING_SHARE`` of the micro-batch's token positions (padded prompts plus completions), a
    new micro-batch starts. Long prompts of different lengths (e.g. 480 and 570 tokens, with
    32-token completions) then run separately instead of paying ~8% extra forward and backward for
    padding; the weighting in :func:`update_policy` keeps the result equal to the full batch's
    whatever the split.
    """
    parts: list[slice] = []
    start, lens = 0, []  # lens: the distinct prompts' lengths in the current micro-batch
    for i, p in enumerate(prompts):
        new_prompt = i == 0 or p != prompts[i - 1]
        if not new_prompt:
            continue
        group_end = i + 1
        while group_end < len(prompts) and prompts[group_end] == p:
            group_end += 1
        full = bool(lens) and group_end - start > size
        if not full and lens:
            grown = lens + [len(p)]
            padded = max(grown) * len(grown)
            positions = padded + (group_end - start) * max(completion_lens[start:group_end])
            full = (padded - sum(grown)) / positions > MAX_PADDING_SHARE
        if full:
            parts.append(slice(start, i))
            start, lens = i, []
        lens.append(len(p))
    if start < len(prompts):
        parts.append(slice(start, len(prompts)))
    return parts


def _rows_per_pass(rows: int, size: int) -> int:
    """Completions per forward/backward pass when a micro-batch of ``rows`` completions must run in passes of at
    most ``size``: as even as possible (5 with size 4: 3 + 2, not 4 + 1)."""
    passes = -(-rows // size)
    return -(-rows // passes)


def _loss_mask(completions: Sequence[Sequence[int]], eos_ids: Sequence[int], pad_id: int) -> torch.Tensor:
    """The completion tokens that carry loss (up to and including the first EOS), ``[B, T]``."""
    rows = [torch.tensor(c, dtype=torch.long) for c in completions]
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad_id)
    real = torch.nn.utils.rnn.pad_sequence(
        [torch.ones(len(c), dtype=torch.bool) for c in completions], batch_first=True
    )
    return completion_mask(ids, list(eos_ids), real)


# How far the advantages of one set of identical samples may sum from 0 and still cancel, relative to the sum of their
# sizes: advantages come out of float32 (losses.group_advantages), each within 6e-8 of its value, so a set whose exact
# sum is 0 sums to a few 1e-7 of its sizes; 1e-5 leaves room for sets of ~100 samples.
ADVANTAGE_SUM_RTOL = 1e-5


def _loss_inputs_digest(sample: Sample, loss: LossConfig) -> bytes:
    """A digest of what a sample's loss gradient depends on besides its advantage (at ratio 1, without a KL term): its
    tokens, the temperature its log-probs are taken at and, when an importance correction reads them, its sampling
    log-probs. Samples with one digest have the same per-token gradient: only their advantages weigh it."""
    inputs = (tuple(sample.prompt_ids), tuple(sample.completion_ids), sample.temperature or 1.0,
              tuple(sample.sampling_logprobs) if loss.importance_correction != "none" else ())
    return hashlib.blake2b(repr(inputs).encode(), digest_size=16).digest()


def advantages_cancel(samples: Sequence[Sample], loss: LossConfig, ranks: Ranks | None = None) -> bool:
    """Whether the advantages of ``samples`` cancel: grouped by identical loss inputs (prompt and completion ids,
    temperature, sampling log-probs when an importance correction reads them), every group's advantages sum to 0
    (within :data:`ADVANTAGE_SUM_RTOL`). At ratio 1 and without a KL term the exact gradient is then 0, whatever the
    loss aggregation (identical samples have identical lengths): a role whose completions were identical in a group
    that varied only through another role's calls. With ``ranks``: over every rank's samples (a collective)."""
    sums: dict[bytes, tuple[float, float]] = {}
    for s in samples:
        key = _loss_inputs_digest(s, loss)
        net, size = sums.get(key, (0.0, 0.0))
        sums[key] = (net + s.advantage, size + abs(s.advantage))
    if ranks is not None:
        merged: dict[bytes, tuple[float, float]] = {}
        for part in ranks.all_objects(sums):  # in rank order: every rank adds up the same floats
            for key, (net, size) in part.items():
                had = merged.get(key, (0.0, 0.0))
                merged[key] = (had[0] + net, had[1] + size)
        sums = merged
    return all(abs(net) <= ADVANTAGE_SUM_RTOL * size for net, size in sums.values())


def _flat_grad(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def _pack(prompts: list[list[int]], completions: list[list[int]], pad_id: int, share: bool = True):
    """A shared-prefix batch when prompts repeat (one prompt pass per distinct prompt) and ``share``, else a plain
    one."""
    if share and len({tuple(p) for p in prompts}) < len(prompts):
        return build_shared_prefix_batch(prompts, completions, pad_id)
    return build_token_batch(prompts, completions, pad_id)


def sample_temperatures(samples: Sequence[Sample]) -> Temperature:
    """The temperatures ``samples`` were drawn at, for their log-probs: one float when they share it (the usual case),
    else one per sample (a tensor); greedy (0 or unset) counts as 1."""
    temps = [s.temperature or 1.0 for s in samples]
    return temps[0] if len(set(temps)) <= 1 else torch.tensor(temps, dtype=torch.float32)


def _logprobs(model, batch, temperature: Temperature, with_entropy: bool = False):
    if hasattr(batch, "prompt_index"):
        return shared_prefix_logprobs(model, batch, temperature, with_entropy)
    return completion_logprobs(model, batch, temperature, with_entropy)


def policy_logprobs(
    policy: Policy, samples: Sequence[Sample], settings: UpdateParams, pad_id: int, ranks: Ranks | None = None
) -> list[torch.Tensor]:
    """Each sample's completion log-probs under ``policy``'s current weights (1-D, no gradient).

    Taken before a policy's first optimizer step of an iteration, they are the sampling
    policy's log-probs that every later step's ratio and clip are measured against.
    """
    out: list[torch.Tensor] = []
    if not samples and ranks is None:
        return out
    dev = next(iter(policy.parameters())).device
    extra = _extra_passes(ranks, -(-len(samples) // settings.micro_batch_size))
    with policy.active() as model, torch.no_grad():
        model.train()  # the mode update_policy computes its log-probs in
        for start in range(0, len(samples), settings.micro_batch_size):
            part = samples[start:start + settings.micro_batch_size]
            batch = _pack([s.prompt_ids for s in part], [s.completion_ids for s in part], pad_id, ranks is None)
            if dev.type != "cpu":
                batch = to_device(batch, dev)
            logp = _logprobs(model, batch, sample_temperatures(part))[0].float().cpu()
            out += [row[:len(s.completion_ids)] for row, s in zip(logp, part)]
        if extra:
            ranks.empty_passes(policy, extra, backward=False)
    return out


class Ranks(Protocol):
    """The ranks of one data-parallel group that an update of one policy is split over, each with a disjoint part of
    its samples (:mod:`teamrl.trainer.sharded_learner`). Every rank makes the same calls in the same order; ``None``
    wherever an update takes ``ranks``: this process alone, the update as it always was."""

    def all_sum(self, values: Sequence[float]) -> list[float]:
        """Each value summed over the ranks."""
        ...

    def all_max(self, values: Sequence[float]) -> list[float]:
        """Each value's maximum over the ranks."""
        ...

    def all_objects(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order."""
        ...

    def empty_passes(self, policy: Policy, passes: int, backward: bool) -> None:
        """Run ``passes`` empty forward passes of ``policy``'s model (each with its backward pass: ``backward``) that
        add nothing, so that this rank runs as many passes as the rank that runs most (see :func:`_extra_passes`)."""
        ...

    def local_grads(self, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
        """This rank's share of each (reduced) gradient of ``params`` (zeros where a parameter has none)."""
        ...


def _extra_passes(ranks: Ranks | None, planned: int) -> int:
    """How many empty passes this rank must add to its ``planned`` ones of a phase so that every rank runs as many
    (each pass's collectives then pair up across the ranks); 0 without ranks. A collective: before the phase."""
    return 0 if ranks is None else int(ranks.all_max([planned])[0]) - planned


def contributes_to_loss(sample: Sample, loss: LossConfig) -> bool:
    """Whether ``sample`` adds to the loss or its gradient: without a KL term, one with advantage 0
    adds exactly nothing (its forward and backward passes can be skipped)."""
    return (loss.kl_coef or 0) > 0 or sample.advantage != 0  # kl_coef null (unresolved): no warm start, no KL


def _old_logprobs(policy: Policy, samples: Sequence[Sample], settings: UpdateParams, pad_id: int,
                  ranks: Ranks | None = None) -> list[torch.Tensor]:
    """:func:`policy_logprobs` for the samples :func:`update_policy` will compute; zeros (unread) for
    those it skips."""
    computed = iter(policy_logprobs(policy, [s for s in samples if contributes_to_loss(s, settings.loss)], settings,
                                    pad_id, ranks))
    return [next(computed) if contributes_to_loss(s, settings.loss) else torch.zeros(len(s.completion_ids))
            for s in samples]


def update_policy_steps(policy: Policy, parts: Sequence[Sequence[Sample]], settings: UpdateParams, pad_id: int,
                        eos_ids: Sequence[int], ranks: Ranks | None = None) -> list[dict[str, float]]:
    """One :func:`update_policy` step per non-empty part, in order; returns each step's statistics.

    With several steps, the old log-probs of every part are computed once, before the first
    step, so that each later step's ratio and clip are measured against the policy that sampled
    (not against weights the earlier steps already moved).

    With ``ranks``, ``parts`` are this rank's shares of steps whose samples have a completion on some rank (the
    learner dropped the others): every part is a step, an empty one included.
    """
    parts = [list(p) for p in parts if ranks is not None or any(s.completion_ids for s in p)]
    if len(parts) < 2:
        return [update_policy(policy, p, settings, pad_id, eos_ids, ranks=ranks) for p in parts]
    old = [_old_logprobs(policy, p, settings, pad_id, ranks) for p in parts]
    version = policy.version  # the weights the old log-probs are of (a skipped step leaves them)
    return [update_policy(policy, p, settings, pad_id, eos_ids, old_logprobs=o, ranks=ranks,
                          moved=policy.version != version) for p, o in zip(parts, old)]


def update_policy(policy: Policy, samples: Sequence[Sample], settings: UpdateParams, pad_id: int,
                  eos_ids: Sequence[int], old_logprobs: Sequence[torch.Tensor] | None = None,
                  ranks: Ranks | None = None, moved: bool = False) -> dict[str, float]:
    """Train ``policy`` on ``samples`` (which must all be its own) and return loss statistics.

    Micro-batches accumulate gradients with weights that make the result equal to one
    full-batch loss for every aggregation (token counts for ``token_mean``, sequence counts
    otherwise). ``old_logprobs`` (one 1-D tensor per sample, e.g. from :func:`policy_logprobs`
    before an earlier step of the same iteration) are the sampling policy's log-probs for every
    epoch. Without them: with one PPO epoch the old log-probs are the detached current ones
    (ratio 1, as TRL does); with more, they are computed once before the first update.

    With ``settings.role_grad_norms`` the micro-batches never mix role types, and the gradient
    accumulated by each role type's micro-batches (its part of the joint gradient: the parts
    sum to it exactly) gives ``grad_norm@<role>``; ``loss@<role>`` is its weighted share of the
    loss (the shares sum to ``loss``), ``entropy@<role>`` and ``tokens@<role>`` its own. No
    extra forward or backward pass is needed, only a copy of the gradient per role type.

    Without a KL term, samples with advantage 0 add exactly nothing to the loss or its gradient:
    their passes are skipped (the normalisation still counts them, so the step is the full
    batch's), and ``entropy`` is measured on the samples computed.

    A step without signal is not taken (weights, optimizer state and version stay as they were; the statistics say
    ``skipped_no_signal`` 1, and ``skipped_steps`` counts it): Adam divides a gradient by its own running size, so it
    would turn float rounding into a full-size step. Without a KL term and at ratio 1 (``moved`` false: the weights are
    those the old log-probs are of) that is the case when the advantages cancel (:func:`advantages_cancel`; every
    advantage 0 included), decided before any pass; and always when the gradient's norm (before clipping) is at most
    ``settings.noise_grad_norm`` (rounding level), decided after the backward passes.

    With ``settings.loss.importance_correction`` ``token`` or ``sequence``, each sample's
    ``sampling_logprobs`` (checked first: one finite value per completion token, else
    :class:`SamplingLogprobsError` naming the sample, before any pass) weight its clipped token losses
    against the old log-probs above (:func:`teamrl.losses.policy_loss.importance_weights`), and the
    statistics gain ``is_weight_mean``, ``is_weight_max``, ``is_weight_min``, ``is_truncated_frac`` and
    ``is_weight_count`` over the samples computed. With ``none`` the sampling log-probs are not read.

    With ``ranks`` (:class:`Ranks`), ``samples`` are this rank's share of the step's: the normalisers (tokens,
    samples, computed tokens), the gradient and its norms and every statistic are those of all ranks' samples together,
    so that N ranks take the step one process takes on all of them.
    """
    foreign = {s.policy for s in samples} - {policy.name}
    if foreign:
        raise ValueError(f"policy {policy.name!r} was given samples of {sorted(foreign)}")
    given_old = _given_old_logprobs(samples, old_logprobs)
    samples = [s for s in samples if s.completion_ids]
    if not samples and ranks is None:
        return {}
    if settings.loss.importance_correction != "none":  # before any pass: a bad log-prob must not reach the weights
        check_sampling_logprobs(samples, settings.loss.importance_correction)
    plan = _plan_update(samples, settings, pad_id, eos_ids, next(iter(policy.parameters())).device, ranks)
    # the exact gradient is 0 (every rank decides alike: plan.computes is every rank's, advantages_cancel too)
    if not plan.computes or (settings.loss.kl_coef == 0 and not moved and advantages_cancel(samples, settings.loss,
                                                                                            ranks)):
        return {**plan.zero_roles, "loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "grad_norm": 0.0,
                "tokens": float(plan.total_tokens), "skipped_steps": 1.0, "skipped_no_signal": 1.0}
    with policy.active() as model:
        model.train()
        _constant_logprobs(policy, model, plan, given_old, settings, ranks)
        totals = _UpdateTotals()
        grad_norm = _optimizer_steps(policy, model, plan, settings, totals, ranks)
        if ranks is not None and grad_norm is not None:
            totals.reduce(ranks)
    if grad_norm is None:  # skipped: the other statistics would be NaN or describe a step that was not taken
        return {"skipped_steps": 1.0, "tokens": float(plan.total_tokens)}
    if totals.steps:
        return totals.as_stats(plan, grad_norm)
    # a first epoch's gradient at rounding level (every rank's norm): no step; its statistics when they were measured
    # (one PPO epoch: the last one is the first)
    stats = totals.as_stats(plan, grad_norm) if settings.ppo_epochs == 1 else {"grad_norm": grad_norm,
                                                                                "tokens": float(plan.total_tokens)}
    return {**stats, "skipped_steps": 1.0, "skipped_no_signal": 1.0}


@dataclass
class _MicroBatch:
    """One micro-batch of an update: its rows of the sorted samples (one role type), packed, with what its loss
    compares against (old, reference and sampling log-probs: constants of the update)."""

    rows: slice
    role: str
    batch: TokenBatch | SharedPrefixBatch
    mask: torch.Tensor
    temperature: Temperature
    old: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    sampling: torch.Tensor | None = None


@dataclass
class _UpdatePlan:
    """What :func:`update_policy` computes: the samples that contribute (sorted), their micro-batches and advantages,
    and the normalisers of the whole batch (every sample, those with advantage 0 included)."""

    samples: list[Sample]
    micro_batches: list[_MicroBatch]
    advantages: torch.Tensor
    total_tokens: int
    total_samples: int
    computed_tokens: int
    zero_roles: dict[str, float]
    roles: list[str]  # the role types of the micro-batches (of every rank's, with ranks), in one order
    computes: bool  # some micro-batch (of some rank) runs


def _given_old_logprobs(
    samples: Sequence[Sample], old_logprobs: Sequence[torch.Tensor] | None
) -> dict[int, torch.Tensor]:
    """``old_logprobs`` by sample id, checked against the samples (one tensor per sample, one value per token)."""
    if old_logprobs is None:
        return {}
    if len(old_logprobs) != len(samples):
        raise ValueError(f"old_logprobs: {len(old_logprobs)} tensors for {len(samples)} samples")
    for s, o in zip(samples, old_logprobs):
        if len(o) != len(s.completion_ids):
            raise ValueError(f"old_logprobs: {len(o)} log-probs for a completion of {len(s.completion_ids)} tokens")
    return {id(s): o for s, o in zip(samples, old_logprobs)}


def _plan_update(samples: list[Sample], settings: UpdateParams, pad_id: int, eos_ids: Sequence[int],
                 dev: torch.device, ranks: Ranks | None = None) -> _UpdatePlan:
    """The micro-batches of an update of ``samples`` (each with a completion), on ``dev``; with ``ranks``, the
    normalisers and roles are those of every rank's samples."""
    cfg = settings.loss
    # The loss is normalised over every sample, those with advantage 0 included ...
    tokens = int(_loss_mask([s.completion_ids for s in samples], eos_ids, pad_id).sum()) if samples else 0
    total_samples = len(samples)
    role_of = ((lambda s: declared_role(s.role, settings.roles) if settings.roles else role_type(s.role))
               if settings.role_grad_norms else (lambda s: ""))
    # a role whose samples all have advantage 0 has no gradient: its norm and loss share are 0
    zero_roles = (
        {f"{k}@{role_of(s)}": 0.0 for s in samples for k in ("grad_norm", "loss")} if settings.role_grad_norms else {}
    )
    # ... but only those that add to it are computed (GRPO groups whose samples all scored alike do not)
    samples = [s for s in samples if contributes_to_loss(s, cfg)]
    # Keep completions of one prompt together so that micro-batches can share the prompt's pass,
    # prompts of similar length next to each other so that micro-batches pad little, and (for
    # role statistics) each role type's samples together.
    roles: dict[str, int] = {}
    first: dict[tuple[int, ...], tuple[int, int]] = {}
    for s in samples:
        first.setdefault(tuple(s.prompt_ids), (len(s.prompt_ids), len(first)))
    samples = sorted(samples, key=lambda s: (roles.setdefault(role_of(s), len(roles)), first[tuple(s.prompt_ids)]))
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    names = [role_of(s) for s in samples]
    parts, size = [], settings.micro_batch_size
    for r in roles:  # micro-batches never mix role types
        start, end = names.index(r), len(names) - names[::-1].index(r)
        # with ranks, plain passes of at most micro_batch_size (every pass then has one shape of collectives)
        parts += [slice(sl.start + start, sl.stop + start) for sl in _plan_micro_batches(
            [tuple(s.prompt_ids) for s in samples[start:end]], [len(s.completion_ids) for s in samples[start:end]],
            size)] if ranks is None else [slice(i, min(i + size, end)) for i in range(start, end, size)]
    micro_batches = []
    for sl in parts:
        b = _pack([s.prompt_ids for s in samples[sl]], [s.completion_ids for s in samples[sl]], pad_id, ranks is None)
        m = completion_mask(b.completion_ids, list(eos_ids), b.completion_pad_mask)
        # each sample's log-probs at the temperature it was drawn at (roles of one policy may sample at different ones)
        t = sample_temperatures(samples[sl])
        if dev.type != "cpu":  # batches are packed on the CPU; move them to the model's device once
            b, m, t = to_device(b, dev), m.to(dev), (t.to(dev) if isinstance(t, torch.Tensor) else t)
        micro_batches.append(_MicroBatch(sl, names[sl.start], b, m, t))
    if dev.type != "cpu":
        adv = adv.to(dev)
    computed = int(sum(int(mb.mask.sum()) for mb in micro_batches))
    counts = [tokens, total_samples, computed, len(micro_batches)]
    role_list = list(roles)
    if ranks is not None:  # the normalisers of all ranks' samples: N ranks' losses add up to the one-process loss
        counts = [int(c) for c in ranks.all_sum(counts)]
        keys = ranks.all_objects((list(zero_roles), role_list))
        zero_roles = {k: 0.0 for z, _ in keys for k in z}
        role_list = list(dict.fromkeys(r for _, rs in keys for r in rs))
    return _UpdatePlan(samples, micro_batches, adv, max(1, counts[0]), counts[1], max(1, counts[2]), zero_roles,
                       role_list, counts[3] > 0)


def _constant_logprobs(policy: Policy, model: torch.nn.Module, plan: _UpdatePlan, given_old: dict[int, torch.Tensor],
                       settings: UpdateParams, ranks: Ranks | None = None) -> None:
    """Fill each micro-batch's old log-probs (given, or computed once before the first of several PPO epochs; with one
    epoch they are the detached current ones), reference log-probs (KL term) and sampling log-probs (importance
    correction)."""
    cfg, dev = settings.loss, plan.advantages.device
    # passes of the policy's own model per micro-batch (a full-weight policy's reference is another model)
    per_batch = int(not given_old and settings.ppo_epochs > 1) + int(cfg.kl_coef > 0 and policy.adapter is not None)
    extra = _extra_passes(ranks, per_batch * len(plan.micro_batches))
    with torch.no_grad():
        for mb in plan.micro_batches:
            if given_old:
                rows = [given_old[id(s)] for s in plan.samples[mb.rows]]
                old = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).to(device=dev)
                mb.old = torch.nn.functional.pad(old, (0, mb.batch.completion_len - old.shape[1]))
            elif settings.ppo_epochs > 1:
                mb.old = _logprobs(model, mb.batch, mb.temperature)[0]
            if cfg.kl_coef > 0:
                with policy.reference() as ref_model:
                    mb.ref = _logprobs(ref_model, mb.batch, mb.temperature)[0]
            if cfg.importance_correction != "none":
                mb.sampling = _padded([s.sampling_logprobs for s in plan.samples[mb.rows]],
                                      mb.batch.completion_len).to(device=dev)
        if extra:
            ranks.empty_passes(policy, extra, backward=False)


@dataclass
class _UpdateTotals:
    """The statistics of an update, summed over its micro-batches (of the last PPO epoch; entropy of the first)."""

    loss: float = 0.0
    kl: float = 0.0
    clip_frac: float = 0.0
    entropy: float = 0.0
    by_role: dict[str, float] = field(default_factory=dict)  # loss@, tokens@, entropy@ (a sum), grad_norm@ per role
    # the importance weights' count, sum, count at the cap, max and min
    is_n: float = 0.0
    is_sum: float = 0.0
    is_truncated: float = 0.0
    is_max: float = -math.inf
    is_min: float = math.inf
    finite: bool = True  # every micro-batch's loss of the current epoch
    steps: int = 0  # optimizer steps taken

    def add_role(self, key: str, value: float) -> None:
        self.by_role[key] = self.by_role.get(key, 0.0) + value

    def reduce(self, ranks: Ranks) -> None:
        """Every rank's sums, maxima and minima (the per-role gradient norms are already every rank's)."""
        keys = sorted({k for part in ranks.all_objects(sorted(self.by_role)) for k in part
                       if not k.startswith("grad_norm@")})
        sums = ranks.all_sum([self.loss, self.kl, self.clip_frac, self.entropy, self.is_n, self.is_sum,
                              self.is_truncated, *[self.by_role.get(k, 0.0) for k in keys]])
        self.loss, self.kl, self.clip_frac, self.entropy, self.is_n, self.is_sum, self.is_truncated = sums[:7]
        self.by_role.update(zip(keys, sums[7:]))
        self.is_max, neg_min = ranks.all_max([self.is_max, -self.is_min])
        self.is_min = -neg_min

    def as_stats(self, plan: _UpdatePlan, grad_norm: float) -> dict[str, float]:
        by_role = dict(self.by_role)
        for key in [k for k in by_role if k.startswith("entropy@")]:
            by_role[key] /= max(1.0, by_role["tokens@" + key.split("@", 1)[1]])
        stats = {**plan.zero_roles, "loss": self.loss, "kl": self.kl, "clip_frac": self.clip_frac,
                 "entropy": self.entropy, **by_role, "grad_norm": grad_norm}
        if self.is_n:
            stats.update(is_weight_mean=self.is_sum / self.is_n, is_weight_max=self.is_max, is_weight_min=self.is_min,
                         is_truncated_frac=self.is_truncated / self.is_n, is_weight_count=self.is_n)
        stats["tokens"] = float(plan.total_tokens)
        stats["skipped_steps"] = stats["skipped_no_signal"] = 0.0
        return stats


def _micro_batch_loss(mb: _MicroBatch, plan: _UpdatePlan, settings: UpdateParams, totals: _UpdateTotals, last: bool,
                      rows: slice, logp: torch.Tensor, ent: torch.Tensor | None) -> torch.Tensor:
    """The loss of ``mb``'s completions ``rows``, weighted by their share of the whole batch (so that micro-batches
    add up to the full batch's loss for every aggregation); its statistics go into ``totals``."""
    cfg = settings.loss
    mr = mb.mask[rows]
    old_lp = logp.detach() if mb.old is None else mb.old[rows]
    loss, st = policy_loss(logp, old_lp, plan.advantages[mb.rows][rows], mr, cfg,
                           ref_logprobs=None if mb.ref is None else mb.ref[rows],
                           sampling_logprobs=None if mb.sampling is None else mb.sampling[rows])
    totals.finite = totals.finite and math.isfinite(st["loss"])
    token_share = int(mr.sum()) / plan.total_tokens
    weight = token_share if cfg.aggregation == "token_mean" else mr.shape[0] / plan.total_samples
    if last:
        totals.loss += st["loss"] * weight
        # token means over the micro-batch: weighted by tokens whatever the aggregation, so that they are the whole
        # batch's token means at any micro-batch size
        totals.kl += st["kl"] * token_share
        totals.clip_frac += st["clip_frac"] * token_share
        if settings.role_grad_norms:
            totals.add_role(f"loss@{mb.role}", st["loss"] * weight)
            totals.add_role(f"tokens@{mb.role}", float(mr.sum()))
        if st.get("is_weight_count"):  # the weights do not change over PPO epochs: the last one's
            n = st["is_weight_count"]
            totals.is_n += n
            totals.is_sum += st["is_weight_mean"] * n
            totals.is_truncated += st["is_truncated_frac"] * n
            totals.is_max, totals.is_min = (
                max(totals.is_max, st["is_weight_max"]),
                min(totals.is_min, st["is_weight_min"]),
            )
    if ent is not None:
        totals.entropy += float((ent * mr).sum()) / plan.computed_tokens
        if settings.role_grad_norms:
            totals.add_role(f"entropy@{mb.role}", float((ent * mr).sum()))
    return loss * weight


def _backward(model: torch.nn.Module, mb: _MicroBatch, plan: _UpdatePlan, settings: UpdateParams,
              totals: _UpdateTotals, last: bool, epoch: int) -> None:
    """Forward and backward passes of one micro-batch: its weighted loss's gradient adds to the accumulated one."""
    loss_of = functools.partial(_micro_batch_loss, mb, plan, settings, totals, last)
    completions = mb.mask.shape[0]
    trim_freed_memory()  # the last micro-batch's freed activations, off the resident set before this one's
    if isinstance(mb.batch, SharedPrefixBatch) and completions > settings.micro_batch_size:
        # one prompt group larger than a micro-batch: its prompt runs once, its completions in passes
        shared_prefix_backward(model, mb.batch, _rows_per_pass(completions, settings.micro_batch_size), loss_of,
                               mb.temperature, with_entropy=epoch == 0)
    else:
        logp, ent = _logprobs(model, mb.batch, mb.temperature, with_entropy=epoch == 0)
        loss_of(slice(0, completions), logp, ent).backward()


def _ranked_backward(policy: Policy, model: torch.nn.Module, plan: _UpdatePlan, settings: UpdateParams,
                     totals: _UpdateTotals, last: bool, epoch: int, ranks: Ranks) -> float:
    """This rank's passes of one PPO epoch, role type by role type in the order every rank shares; the gradient summed
    over the ranks (per role type too, with ``role_grad_norms``) and clipped by its norm, which is returned."""
    params = list(policy.parameters())
    by_role = last and settings.role_grad_norms
    before = None
    for role in plan.roles:
        mine = [mb for mb in plan.micro_batches if mb.role == role]
        extra = _extra_passes(ranks, len(mine))
        for mb in mine:
            _backward(model, mb, plan, settings, totals, last, epoch)
        if extra:
            ranks.empty_passes(policy, extra, backward=True)
        if by_role:  # the gradient this role type's micro-batches added, on every rank
            now = torch.cat([g.reshape(-1) for g in ranks.local_grads(params)])
            part = now if before is None else now - before
            totals.by_role[f"grad_norm@{role}"] = math.sqrt(ranks.all_sum([float(part.norm()) ** 2])[0])
            before = now
    # per-parameter norms, as clip_grad_norm_ takes them (no flat copy of the gradient)
    grad_norm = math.sqrt(ranks.all_sum([sum(float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2
                                              for g in ranks.local_grads(params))])[0])
    coef = min(1.0, settings.max_grad_norm / (grad_norm + 1e-6))  # as clip_grad_norm_ clips
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return grad_norm


def _optimizer_steps(policy: Policy, model: torch.nn.Module, plan: _UpdatePlan, settings: UpdateParams,
                     totals: _UpdateTotals, ranks: Ranks | None = None) -> float | None:
    """One optimizer step per PPO epoch over every micro-batch; returns the last epoch's gradient norm, or None when a
    non-finite loss or gradient skipped the step (the weights stay as they were; with ``ranks``, on every rank when it
    was so on one). A first epoch's gradient norm at most ``settings.noise_grad_norm`` (rounding, not signal) takes no
    step, nor do the epochs after it (they would compute the same gradient); ``totals.steps`` counts the steps taken."""
    params = list(policy.parameters())
    grad_norm = None
    for epoch in range(settings.ppo_epochs):
        policy.optimizer.zero_grad(set_to_none=True)
        last = epoch == settings.ppo_epochs - 1
        before = None
        totals.finite = True
        if ranks is not None:
            grad_norm = _ranked_backward(policy, model, plan, settings, totals, last, epoch, ranks)
            totals.finite = ranks.all_max([0.0 if totals.finite else 1.0])[0] == 0.0
        for i, mb in enumerate(plan.micro_batches if ranks is None else ()):
            _backward(model, mb, plan, settings, totals, last, epoch)
            role_done = i + 1 == len(plan.micro_batches) or plan.micro_batches[i + 1].role != mb.role
            if last and settings.role_grad_norms and role_done:  # the gradient this role type's micro-batches added
                now = _flat_grad(params)
                totals.by_role[f"grad_norm@{mb.role}"] = float(
                    (now - before).norm() if before is not None else now.norm()
                )
                before = now
        if ranks is None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), settings.max_grad_norm))
        if not (totals.finite and math.isfinite(grad_norm)):
            # A NaN/inf would reach every weight (and the optimizer's moments): skip the step instead.
            from tqdm import tqdm

            tqdm.write(f"warning: policy {policy.name!r}: non-finite loss or gradient (gradient norm {grad_norm}, "
                       f"PPO epoch {epoch + 1}); optimizer step skipped, weights unchanged", file=sys.stderr)
            policy.optimizer.zero_grad(set_to_none=True)
            return None
        if epoch == 0 and grad_norm <= settings.noise_grad_norm:
            break  # (later epochs follow real steps: their gradient is the PPO objective's, however small)
        policy.step()
        totals.steps += 1
    policy.optimizer.zero_grad(set_to_none=True)
    return grad_norm
