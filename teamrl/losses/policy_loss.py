"""PPO-style clipped token loss with optional dual clip and k3 KL, and its aggregations.

One loss serves every algorithm: the per-token clipped surrogate of PPO/GRPO, optionally with
the dual clip of Ye et al. (2020) for negative advantages and a k3 KL penalty to a reference
policy (optionally bias-corrected by the importance ratio), reduced over tokens by one of
``AGGREGATIONS`` (``TRL_LOSS_TYPES`` maps TRL's ``loss_type`` names to them). Samples drawn by a
policy other than the one ``old_logprobs`` come from (a stale rollout, a server whose numbers differ)
can be reweighted by a truncated importance weight (:func:`importance_weights`, ``IMPORTANCE_CORRECTIONS``).

Masked positions (prompt, padding, everything after the first EOS) never contribute loss or
gradient: their inputs are replaced with ``torch.where`` *before* any ``exp``, so even garbage
log-probs such as ``+-1e9`` there cannot produce ``inf * 0 = NaN`` in the forward or backward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from teamrl.core.config import LossConfig

__all__ = ["AGGREGATIONS", "IMPORTANCE_CORRECTIONS", "TRL_LOSS_TYPES", "LossConfig", "completion_mask",
           "importance_weights", "policy_loss"]

_CHOICES = {f.name: f.metadata["choices"] for f in dataclasses.fields(LossConfig) if f.metadata.get("choices")}
AGGREGATIONS: tuple[str, ...] = _CHOICES["aggregation"]  # declared once, on LossConfig.aggregation

# TRL GRPOTrainer ``loss_type`` -> the aggregation here that computes the same (None: not offered).
# ``token_mean`` is weighted by tokens across micro-batches, i.e. one token mean over the whole
# batch: TRL's ``dapo``. TRL's ``bnpo`` averages each micro-batch's own token mean, so its result
# depends on the micro-batch size; it is not offered.
TRL_LOSS_TYPES: dict[str, str | None] = {"dapo": "token_mean", "grpo": "seq_mean_token_mean", "dr_grpo": "dr_grpo",
                                         "bnpo": None}

# How the truncated importance weight old / sampling is taken: not at all, per token, or one per sample
# (LossConfig.importance_correction's choices but auto, which LossConfig.resolve turns into one of them).
IMPORTANCE_CORRECTIONS: tuple[str, ...] = tuple(c for c in _CHOICES["importance_correction"] if c != "auto")

def completion_mask(
    completion_ids: torch.Tensor,
    eos_token_id: int | Sequence[int] | None,
    pad_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mask of the completion tokens that carry loss.

    Args:
        completion_ids: long ``[B, T]`` generated token ids.
        eos_token_id: one id or several ids that end a completion; ``None`` (or an empty sequence)
            means no EOS truncation.
        pad_mask: optional bool ``[B, T]``, True for real tokens, False for padding.

    Returns:
        bool ``[B, T]``: True for real tokens up to and including the first EOS; False after the
        first EOS and wherever ``pad_mask`` is False. An EOS id at a padding position is ignored,
        so ``pad_token_id == eos_token_id`` (common) is safe with left or right padding.
    """
    if completion_ids.dim() != 2:
        raise ValueError(f"completion_ids must be [B, T]; got shape {tuple(completion_ids.shape)}")
    if pad_mask is not None and pad_mask.shape != completion_ids.shape:
        raise ValueError(
            f"pad_mask shape {tuple(pad_mask.shape)} does not match completion_ids shape {tuple(completion_ids.shape)}"
        )
    real = (
        torch.ones_like(completion_ids, dtype=torch.bool) if pad_mask is None else pad_mask.to(torch.bool)
    )
    if eos_token_id is None:
        eos_ids: list[int] = []
    elif isinstance(eos_token_id, Sequence):
        eos_ids = [int(i) for i in eos_token_id]
    else:  # a plain int, or an integer scalar such as numpy.int64
        eos_ids = [int(eos_token_id)]
    if not eos_ids:
        return real
    eos_tensor = torch.tensor(eos_ids, dtype=completion_ids.dtype, device=completion_ids.device)
    is_eos = torch.isin(completion_ids, eos_tensor) & real
    # Number of EOS tokens strictly before each position; zero means "not past the first EOS",
    # which keeps the first EOS itself.
    eos_before = torch.cumsum(is_eos.to(torch.int32), dim=1) - is_eos.to(torch.int32)
    return real & (eos_before == 0)


def _check_shapes(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
) -> None:
    """Raise ValueError naming the shapes when the inputs do not line up as [B, T] / [B]."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T]; got shape {tuple(logprobs.shape)}")
    shape = logprobs.shape
    named = {"old_logprobs": old_logprobs, "mask": mask}
    if ref_logprobs is not None:
        named["ref_logprobs"] = ref_logprobs
    for name, tensor in named.items():
        if tensor.shape != shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} does not match logprobs shape {tuple(shape)}")
    if advantages.shape != shape[:1]:
        raise ValueError(f"advantages must be [B] = {tuple(shape[:1])}; got shape {tuple(advantages.shape)}")


def importance_weights(
    old_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    cap: float,
) -> torch.Tensor:
    """The truncated importance weight of each completion token (a constant: no gradient).

    ``token``: ``w_t = min(exp(old_t - sampling_t), cap)``; ``sequence``: one weight per completion,
    ``min(exp(sum_t (old_t - sampling_t)), cap)`` over its masked tokens, on every token of it. ``old``
    is the policy the PPO ratio is measured against, ``sampling`` the one that drew the tokens, so ``w``
    moves the expectation from the sampling policy to ``old`` (TRL GRPOTrainer's and verl's truncated
    importance sampling). A log-ratio too large for ``exp`` gives ``cap``, too small gives 0; never inf or NaN
    from finite inputs.

    Args:
        old_logprobs: float ``[B, T]``.
        sampling_logprobs: float ``[B, T]``; read only where ``mask`` is True.
        mask: bool ``[B, T]``, True where the token carries loss.
        mode: ``"token"`` or ``"sequence"``.
        cap: the upper bound, ``> 0``.

    Returns:
        float ``[B, T]``: the weights; 1 where ``mask`` is False (those tokens carry no loss anyway).
    """
    if mode not in ("token", "sequence"):
        raise ValueError(f"importance_weights: mode must be token or sequence; got {mode!r}")
    m = mask.to(torch.bool)
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    with torch.no_grad():
        # select before exp, as in policy_loss: garbage at a masked position never meets exp
        log_w = torch.where(m, old_logprobs.detach() - sampling_logprobs.detach().to(old_logprobs.dtype), zero)
        if mode == "sequence":
            log_w = log_w.sum(dim=1, keepdim=True).expand_as(log_w)
        w = torch.clamp(torch.exp(log_w), max=cap)
        return torch.where(m, w, torch.ones_like(w))


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
    sampling_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss over a batch of completions.

    Per token (``A`` broadcast from the sequence's advantage)::

        ratio   = exp(logprobs - old_logprobs)
        loss_t  = -min(ratio * A, clamp(ratio, 1 - eps_low, 1 + eps_high) * A)
        loss_t  = min(loss_t, -dual_clip * A)          where A < 0, if dual_clip is set
        loss_t  = w_t * loss_t                     importance_correction token / sequence (w: importance_weights)
        k3      = exp(ref - logprobs) - (ref - logprobs) - 1
        loss_t += kl_coef * k3                     (kl_bias_correction False, the default)
        loss_t += kl_coef * ratio * k3             (kl_bias_correction True: TRL 1.16's default)

    Aggregation (``m`` the mask, ``B`` the batch size):

    * ``token_mean``: ``sum(loss_t * m) / max(sum(m), 1)``; :func:`teamrl.trainer.update.update_policy`
      weights micro-batches by their tokens, so this is one token mean over the whole batch (TRL
      ``"dapo"``; not TRL ``"bnpo"``, which averages each micro-batch's own token mean);
    * ``seq_mean_token_mean``: mean over sequences of ``sum_t(loss_t * m) / max(sum_t m, 1)`` (TRL ``"grpo"``);
    * ``seq_mean_token_sum``: mean over sequences of ``sum_t(loss_t * m)``;
    * ``dr_grpo``: ``sum(loss_t * m) / (B * max_completion_length)`` (TRL ``"dr_grpo"``).

    Args:
        logprobs: float ``[B, T]`` current per-token log-probs of the completion tokens (with grad).
        old_logprobs: float ``[B, T]`` log-probs under the sampling policy (treated as constants).
        advantages: float ``[B]``, one per sequence (treated as constants).
        mask: bool or 0/1 float ``[B, T]``; True where the token carries loss.
        cfg: the loss settings.
        ref_logprobs: float ``[B, T]`` reference-policy log-probs; required when ``cfg.kl_coef > 0``.
        sampling_logprobs: float ``[B, T]`` log-probs of the policy that drew the completions (the engine's),
            treated as constants; required when ``cfg.importance_correction`` is not ``"none"``, never read
            when it is.

    Returns:
        ``(loss, stats)``: the scalar loss and python floats ``"loss"``, ``"clip_frac"`` (fraction of
        masked tokens where the PPO clip is active, i.e. its gradient is cut: ratio above
        ``1 + eps_high`` with ``A > 0`` or below ``1 - eps_low`` with ``A < 0``, as TRL's
        ``clip_ratio``), ``"kl"`` (masked mean of the KL estimate used, k3 or ratio * k3, as TRL logs
        it; 0.0 without ``ref_logprobs``) and
        ``"ratio_mean"`` (masked mean ratio). With the importance correction on, also the weights'
        ``"is_weight_mean"``, ``"is_weight_max"``, ``"is_weight_min"``, ``"is_truncated_frac"`` (share at
        the cap) and ``"is_weight_count"`` (how many there are), over the masked tokens (``token``) or the
        completions with at least one masked token (``sequence``).

    The weight multiplies the clipped policy term only, not the KL term: it corrects the policy-gradient
    estimate for where the tokens came from (as TRL and verl do), while the KL penalty's strength does not
    depend on how stale a sample is.

    Positions where ``mask`` is False contribute neither loss nor gradient, whatever their values.
    """
    _check_shapes(logprobs, old_logprobs, advantages, mask, ref_logprobs)
    if cfg.importance_correction == "auto" or cfg.kl_coef is None:
        cfg = cfg.resolve()  # no rollout to ask: on-policy samples, no correction; no warm start to ask: no KL
    if cfg.aggregation == "dr_grpo" and cfg.max_completion_length is None:
        raise ValueError(
            "LossConfig.max_completion_length: required by aggregation 'dr_grpo' (its constant denominator); "
            "LossConfig.resolve sets it to rollout.max_new_tokens"
        )
    kl_coef = cfg.kl_coef or 0.0  # resolved above: a float
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"LossConfig.kl_coef={cfg.kl_coef} > 0 needs ref_logprobs")
    weighted = cfg.importance_correction != "none"
    if weighted:
        if sampling_logprobs is None:
            raise ValueError(f"LossConfig.importance_correction={cfg.importance_correction!r} needs sampling_logprobs")
        if sampling_logprobs.shape != logprobs.shape:
            raise ValueError(f"sampling_logprobs shape {tuple(sampling_logprobs.shape)} does not match logprobs shape "
                             f"{tuple(logprobs.shape)}")

    batch_size = logprobs.shape[0]
    m = mask.to(torch.bool)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # Old log-probs and advantages are constants of the surrogate; detaching guards against a
    # caller passing tensors that still hang on the graph.
    adv = advantages.detach().to(logprobs.dtype).unsqueeze(1)  # [B, 1]

    # Select before exp: a masked position gets log-ratio 0 and its (zero) upstream gradient never
    # meets an inf from exp(garbage).
    log_ratio = torch.where(m, logprobs - old_logprobs.detach(), zero)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    loss_t = -torch.minimum(ratio * adv, clipped_ratio * adv)
    if cfg.dual_clip is not None:
        # For A < 0 a huge ratio makes -ratio*A unbounded; cap it at -c*A (gradient 0 there).
        loss_t = torch.where(adv < 0, torch.minimum(loss_t, -cfg.dual_clip * adv), loss_t)
    if weighted:
        assert sampling_logprobs is not None  # checked above
        is_w = importance_weights(old_logprobs, sampling_logprobs, m, cfg.importance_correction, cfg.importance_cap)
        loss_t = loss_t * is_w

    if ref_logprobs is not None:
        delta = torch.where(m, ref_logprobs.detach() - logprobs, zero)
        kl_t = torch.exp(delta) - delta - 1.0  # k3: unbiased, non-negative estimate of KL(pi || ref)
        if cfg.kl_bias_correction:
            # samples come from the old policy: reweight to the current one (the ratio keeps its gradient)
            kl_t = kl_t * ratio
        if kl_coef > 0:
            loss_t = loss_t + kl_coef * kl_t
    else:
        kl_t = None

    loss_t = torch.where(m, loss_t, zero)
    m_f = m.to(logprobs.dtype)
    n_tokens = m_f.sum().clamp(min=1.0)
    if cfg.aggregation == "token_mean":
        loss = loss_t.sum() / n_tokens
    elif cfg.aggregation == "seq_mean_token_mean":
        loss = (loss_t.sum(dim=1) / m_f.sum(dim=1).clamp(min=1.0)).sum() / max(batch_size, 1)
    elif cfg.aggregation == "seq_mean_token_sum":
        loss = loss_t.sum(dim=1).sum() / max(batch_size, 1)
    else:  # dr_grpo
        assert cfg.max_completion_length is not None  # checked above
        longest = int(m.sum(dim=1).max().item()) if batch_size else 0
        if longest > cfg.max_completion_length:
            # The constant denominator is only the right normaliser if no completion is longer.
            raise ValueError(
                f"a completion has {longest} masked tokens, more than "
                f"LossConfig.max_completion_length={cfg.max_completion_length} (dr_grpo's denominator)"
            )
        loss = loss_t.sum() / max(batch_size * cfg.max_completion_length, 1)

    with torch.no_grad():
        clip_active = ((ratio > 1.0 + cfg.eps_high) & (adv > 0)) | ((ratio < 1.0 - cfg.eps_low) & (adv < 0))
        stats = {
            "loss": float(loss.detach().item()),
            "clip_frac": float(((clip_active & m).to(m_f.dtype).sum() / n_tokens).item()),
            "kl": 0.0 if kl_t is None else float((torch.where(m, kl_t, zero).sum() / n_tokens).item()),
            "ratio_mean": float((torch.where(m, ratio, zero).sum() / n_tokens).item()),
        }
        if weighted:
            # one weight per masked token, or per completion that has a masked token (read at its first one)
            if cfg.importance_correction == "token":
                values = is_w[m]
            else:
                rows = m.any(dim=1)
                values = is_w[torch.arange(batch_size, device=m.device), m.to(torch.int8).argmax(dim=1)][rows]
            count = int(values.numel())
            stats.update({"is_weight_count": float(count),
                          "is_weight_mean": float(values.mean()) if count else 0.0,
                          "is_weight_max": float(values.max()) if count else 0.0,
                          "is_weight_min": float(values.min()) if count else 0.0,
                          "is_truncated_frac": float((values >= cfg.importance_cap).sum()) / count if count else 0.0})
    return loss, stats
