"""Tests for teamrl.losses: advantages, completion masks, the clipped policy loss and its aggregations.

Expected numbers are worked out by hand in the comments; the TRL reference functions at the bottom
are written independently from TRL GRPOTrainer's documented formulas.
"""

from __future__ import annotations

import math

import pytest
import torch

from teamrl.losses import (
    ADVANTAGE_MODES,
    AGGREGATIONS,
    LossConfig,
    completion_mask,
    group_advantages,
    group_ids_from_keys,
    policy_loss,
)

F64 = torch.float64

# Shared advantage example: two groups, rewards [1, 0, 1, 1 | 0, 2].
REWARDS = [1.0, 0.0, 1.0, 1.0, 0.0, 2.0]
GROUPS = [0, 0, 0, 0, 1, 1]


def _adv(mode: str, rewards=REWARDS, groups=GROUPS, baselines=None, dtype=F64) -> torch.Tensor:
    b = None if baselines is None else torch.tensor(baselines, dtype=dtype)
    return group_advantages(torch.tensor(rewards, dtype=dtype), torch.tensor(groups), mode=mode, baselines=b)


def _close(actual: torch.Tensor, expected: list[float], tol: float = 1e-12) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------------
# Advantages, by hand
# --------------------------------------------------------------------------------------------


def test_mode_list() -> None:
    assert ADVANTAGE_MODES == ("group", "mean", "batch", "none", "rloo", "max")
    assert AGGREGATIONS == ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo")


def test_group_mode_by_hand() -> None:
    # Group 0: [1, 0, 1, 1], mean 0.75, deviations [0.25, -0.75, 0.25, 0.25],
    #   sum of squares 3 * 0.0625 + 0.5625 = 0.75, unbiased var 0.75 / 3 = 0.25, std 0.5.
    # Group 1: [0, 2], mean 1, deviations [-1, 1], unbiased var (1 + 1) / 1 = 2, std sqrt(2).
    s0 = 0.5 + 1e-4
    s1 = math.sqrt(2.0) + 1e-4
    _close(_adv("group"), [0.25 / s0, -0.75 / s0, 0.25 / s0, 0.25 / s0, -1.0 / s1, 1.0 / s1])


def test_mean_and_none_modes_by_hand() -> None:
    # r - mean_g: group 0 mean 0.75, group 1 mean 1.
    expected = [0.25, -0.75, 0.25, 0.25, -1.0, 1.0]
    _close(_adv("mean"), expected)
    _close(_adv("none"), expected)  # TRL's scale_rewards="none" (Dr. GRPO) is the same thing


def test_batch_mode_by_hand() -> None:
    # Whole batch [1, 0, 1, 1, 0, 2]: mean 5/6, deviations [1/6, -5/6, 1/6, 1/6, -5/6, 7/6],
    #   sum of squares (1 + 25 + 1 + 1 + 25 + 49) / 36 = 102/36 = 17/6, unbiased var (17/6) / 5 = 17/30.
    # Numerator is still the per-group centring: [0.25, -0.75, 0.25, 0.25, -1, 1].
    s = math.sqrt(17.0 / 30.0) + 1e-4
    _close(_adv("batch"), [0.25 / s, -0.75 / s, 0.25 / s, 0.25 / s, -1.0 / s, 1.0 / s])


def test_rloo_mode_by_hand() -> None:
    # Group 0: r=1 vs others [0, 1, 1] (mean 2/3) -> 1/3; r=0 vs others [1, 1, 1] (mean 1) -> -1.
    # Group 1: r=0 vs [2] -> -2; r=2 vs [0] -> 2.
    _close(_adv("rloo"), [1 / 3, -1.0, 1 / 3, 1 / 3, -2.0, 2.0])


def test_max_mode_by_hand() -> None:
    # ReMax: greedy completion of group 0 scored 1, of group 1 scored 0.
    # [1-1, 0-1, 1-1, 1-1, 0-0, 2-0]
    _close(_adv("max", baselines=[1.0, 1.0, 1.0, 1.0, 0.0, 0.0]), [0.0, -1.0, 0.0, 0.0, 0.0, 2.0])


def test_max_mode_baseline_required_and_exclusive() -> None:
    r, g = torch.tensor(REWARDS), torch.tensor(GROUPS)
    with pytest.raises(ValueError, match="'max'"):
        group_advantages(r, g, mode="max")
    with pytest.raises(ValueError, match="'max'"):
        group_advantages(r, g, mode="group", baselines=torch.zeros(6))
    with pytest.raises(ValueError, match=r"\(5,\)"):
        group_advantages(r, g, mode="max", baselines=torch.zeros(5))


def test_non_contiguous_group_ids_and_order() -> None:
    # Same two groups as above, but ids 7 and -3, interleaved: group 7 = [1, 0, 1, 1], group -3 = [0, 2].
    rewards = [0.0, 1.0, 0.0, 2.0, 1.0, 1.0]
    groups = [-3, 7, 7, -3, 7, 7]
    # group 7 mean 0.75 -> [.., 0.25, -0.75, .., 0.25, 0.25]; group -3 mean 1 -> [-1, .., .., 1, ..]
    _close(_adv("mean", rewards, groups), [-1.0, 0.25, -0.75, 1.0, 0.25, 0.25])
    # rloo: group 7 as in test_rloo_mode_by_hand, group -3: 0 - 2 = -2, 2 - 0 = 2.
    _close(_adv("rloo", rewards, groups), [-2.0, 1 / 3, -1.0, 2.0, 1 / 3, 1 / 3])
    s0, s1 = 0.5 + 1e-4, math.sqrt(2.0) + 1e-4
    _close(_adv("group", rewards, groups), [-1 / s1, 0.25 / s0, -0.75 / s0, 1 / s1, 0.25 / s0, 0.25 / s0])


@pytest.mark.parametrize("mode", ["group", "mean", "batch", "none", "rloo"])
def test_singleton_groups_are_zero(mode: str) -> None:
    # Group 5 = [3] alone, group 1 = [1, 2]. Singleton -> exactly 0; the pair is non-zero.
    adv = _adv(mode, [3.0, 1.0, 2.0], [5, 1, 1])
    assert adv[0].item() == 0.0
    assert adv[1].item() < 0 < adv[2].item()


def test_singleton_group_in_max_mode_keeps_external_baseline() -> None:
    # The baseline is the greedy reward, not a group statistic: 3 - 1 = 2.
    _close(_adv("max", [3.0], [0], baselines=[1.0]), [2.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["group", "mean", "batch", "none", "rloo"])
def test_zero_variance_groups_are_exactly_zero(mode: str, dtype: torch.dtype) -> None:
    # 0.1 + 0.1 + 0.1 != 0.3 in floating point, so sum/n need not equal 0.1; the result must still be 0.
    rewards = [0.1, 0.1, 0.1, 0.7, 0.7, 0.3, 0.9]
    adv = _adv(mode, rewards, [0, 0, 0, 2, 2, 4, 4], dtype=dtype)
    assert not torch.isnan(adv).any()
    assert torch.equal(adv[:5], torch.zeros(5, dtype=dtype))
    assert adv[5].item() < 0 < adv[6].item()


@pytest.mark.parametrize("mode", ["group", "mean", "batch", "none", "rloo"])
def test_whole_batch_constant_or_single_sample_has_no_nan(mode: str) -> None:
    adv = _adv(mode, [0.3, 0.3, 0.3, 0.3], [0, 0, 1, 1], dtype=torch.float32)
    assert torch.equal(adv, torch.zeros(4))
    adv1 = _adv(mode, [0.3], [0], dtype=torch.float32)
    assert torch.equal(adv1, torch.zeros(1))


def test_advantage_validation_errors() -> None:
    r = torch.tensor([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="group, mean, batch, none, rloo, max"):
        group_advantages(r, torch.tensor([0, 0, 1]), mode="zscore")
    with pytest.raises(ValueError, match=r"\(3,\).*\(2,\)"):
        group_advantages(r, torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="integer"):
        group_advantages(r, torch.tensor([0.0, 0.0, 1.0]))


def test_group_ids_from_keys_first_appearance_order() -> None:
    keys = [("p1", "a", 0), ("p0", "b", 1), ("p1", "a", 0), ("p2", "a", 0), ("p0", "b", 1), "solo"]
    ids = group_ids_from_keys(keys)
    assert ids.dtype == torch.long
    assert ids.tolist() == [0, 1, 0, 2, 1, 3]
    assert group_ids_from_keys([]).tolist() == []


# --------------------------------------------------------------------------------------------
# completion_mask
# --------------------------------------------------------------------------------------------

EOS = 2


def test_completion_mask_eos_positions() -> None:
    ids = torch.tensor(
        [
            [5, 6, 2, 7, 8],  # EOS in the middle: keep through the EOS
            [2, 5, 6, 7, 8],  # EOS at position 0: only the EOS itself
            [5, 6, 7, 8, 9],  # no EOS (truncated): everything
            [5, 2, 6, 2, 7],  # second EOS does not re-open anything
        ]
    )
    expected = torch.tensor(
        [
            [1, 1, 1, 0, 0],
            [1, 0, 0, 0, 0],
            [1, 1, 1, 1, 1],
            [1, 1, 0, 0, 0],
        ],
        dtype=torch.bool,
    )
    out = completion_mask(ids, EOS)
    assert out.dtype == torch.bool
    assert torch.equal(out, expected)


def test_completion_mask_padding_and_multiple_eos_ids() -> None:
    ids = torch.tensor(
        [
            [5, 6, 7, 0, 0],  # right padding, no EOS
            [2, 2, 5, 6, 2],  # left padding with pad id == EOS id: padded EOS must not count
            [5, 3, 9, 9, 9],  # second EOS id (3)
        ]
    )
    pad = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    expected = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(completion_mask(ids, [EOS, 3], pad), expected)
    # No EOS id: the pad mask alone.
    assert torch.equal(completion_mask(ids, None, pad), pad)


# --------------------------------------------------------------------------------------------
# policy_loss: aggregations by hand
# --------------------------------------------------------------------------------------------


def _tiny_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # B=2, T=3. Ratios [[1.0, 1.1, 0.9], [1.0, 1.1, 0.9]] (inside [0.8, 1.2], so no clipping),
    # advantages [1, -2], mask [[1, 1, 0], [1, 1, 1]]; position (0, 2) holds garbage.
    ratio = torch.tensor([[1.0, 1.1, 0.9], [1.0, 1.1, 0.9]], dtype=F64)
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]], dtype=F64)
    logprobs = old + ratio.log()
    logprobs[0, 2] = -1e9
    adv = torch.tensor([1.0, -2.0], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    return logprobs, old, adv, mask


# Per-token loss -ratio*A: row 0 [-1.0, -1.1, (masked)], row 1 [2.0, 2.2, 1.8].
# Row sums: -2.1 (2 tokens) and 6.0 (3 tokens); total 3.9 over 5 tokens.
@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("token_mean", 3.9 / 5),  # 0.78
        ("seq_mean_token_mean", (-2.1 / 2 + 6.0 / 3) / 2),  # (-1.05 + 2.0) / 2 = 0.475
        ("seq_mean_token_sum", (-2.1 + 6.0) / 2),  # 1.95
        ("dr_grpo", 3.9 / (2 * 4)),  # B=2, max_completion_length=4: 0.4875
    ],
)
def test_aggregations_by_hand(aggregation: str, expected: float) -> None:
    logprobs, old, adv, mask = _tiny_batch()
    cfg = LossConfig(aggregation=aggregation, max_completion_length=4)
    loss, stats = policy_loss(logprobs, old, adv, mask, cfg)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert stats["loss"] == pytest.approx(expected, abs=1e-12)
    assert stats["clip_frac"] == 0.0
    assert stats["kl"] == 0.0
    # Masked mean ratio: (1.0 + 1.1 + 1.0 + 1.1 + 0.9) / 5 = 1.02
    assert stats["ratio_mean"] == pytest.approx(1.02, abs=1e-12)


def test_dr_grpo_rejects_completions_longer_than_its_denominator() -> None:
    logprobs, old, adv, mask = _tiny_batch()
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(logprobs, old, adv, mask, LossConfig(aggregation="dr_grpo", max_completion_length=2))


def test_kl_k3_by_hand() -> None:
    # Ratio 1 and A = 0: the surrogate is 0, only the KL remains.
    # delta = ref - logprobs = [ln 2, 0] -> k3 = [2 - ln 2 - 1, 1 - 0 - 1] = [1 - ln 2, 0].
    logprobs = torch.tensor([[-1.0, -1.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.0 + math.log(2.0), -1.0]], dtype=F64)
    cfg = LossConfig(kl_coef=0.5)
    loss, stats = policy_loss(logprobs, logprobs.detach(), torch.zeros(1, dtype=F64), torch.ones(1, 2), cfg, ref)
    k = 1.0 - math.log(2.0)
    assert stats["kl"] == pytest.approx(k / 2, abs=1e-12)
    assert loss.item() == pytest.approx(0.5 * k / 2, abs=1e-12)  # token_mean of 0.5 * [k, 0]
    # d/dlp of k3 = 1 - exp(delta) = [1 - 2, 0]; times 0.5 / 2 tokens.
    loss.backward()
    _close(logprobs.grad, [[-0.25, 0.0]])


def test_kl_coef_without_ref_raises() -> None:
    logprobs, old, adv, mask = _tiny_batch()
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, old, adv, mask, LossConfig(kl_coef=0.1))


# --------------------------------------------------------------------------------------------
# policy_loss: clipping
# --------------------------------------------------------------------------------------------


def _single_tokens(ratios: list[float], advs: list[float], cfg: LossConfig):
    """B sequences of one token each; returns (per-sequence loss via seq_mean_token_sum * B, grad * B, stats)."""
    b = len(ratios)
    old = torch.full((b, 1), -1.0, dtype=F64)
    logprobs = (old + torch.tensor(ratios, dtype=F64).log().unsqueeze(1)).requires_grad_(True)
    loss, stats = policy_loss(logprobs, old, torch.tensor(advs, dtype=F64), torch.ones(b, 1), cfg)
    loss.backward()
    return loss.item() * b, (logprobs.grad.squeeze(1) * b).tolist(), stats


def test_symmetric_clip_kills_gradient_on_the_clipped_side() -> None:
    cfg = LossConfig(eps_low=0.2, eps_high=0.2, aggregation="seq_mean_token_sum")
    # token: (ratio, A) -> loss, d loss / d logprob
    #   (1.5, +1): -min(1.5, 1.2) = -1.2, clipped  -> grad 0
    #   (0.5, +1): -min(0.5, 0.8) = -0.5, unclipped -> grad -ratio*A = -0.5
    #   (0.5, -1): -min(-0.5, -0.8) = 0.8, clipped  -> grad 0
    #   (1.5, -1): -min(-1.5, -1.2) = 1.5, unclipped -> grad -ratio*A = 1.5
    total, grads, stats = _single_tokens([1.5, 0.5, 0.5, 1.5], [1.0, 1.0, -1.0, -1.0], cfg)
    assert total == pytest.approx(-1.2 - 0.5 + 0.8 + 1.5, abs=1e-12)
    assert grads == pytest.approx([0.0, -0.5, 0.0, 1.5], abs=1e-12)
    assert grads[0] == 0.0 and grads[2] == 0.0
    assert stats["clip_frac"] == pytest.approx(0.5)  # 2 of 4 tokens clipped


def test_asymmetric_clip_higher() -> None:
    # eps_low 0.2, eps_high 0.28 (DAPO clip-higher): range [0.8, 1.28].
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, aggregation="seq_mean_token_sum")
    #   (1.25, +1): inside the upper range now -> loss -1.25, grad -1.25 (would be clipped at 1.2)
    #   (1.30, +1): -min(1.30, 1.28) = -1.28, grad 0
    #   (0.75, -1): -min(-0.75, -0.8) = 0.8, grad 0 (lower side still at 0.8)
    #   (0.85, -1): -min(-0.85, -0.8) = 0.85, grad 0.85
    total, grads, stats = _single_tokens([1.25, 1.30, 0.75, 0.85], [1.0, 1.0, -1.0, -1.0], cfg)
    assert total == pytest.approx(-1.25 - 1.28 + 0.8 + 0.85, abs=1e-12)
    assert grads == pytest.approx([-1.25, 0.0, 0.0, 0.85], abs=1e-12)
    assert stats["clip_frac"] == pytest.approx(0.5)
    # Same first token with symmetric 0.2 is clipped: loss -1.2, gradient 0.
    total_sym, grads_sym, _ = _single_tokens([1.25], [1.0], LossConfig(aggregation="seq_mean_token_sum"))
    assert total_sym == pytest.approx(-1.2, abs=1e-12)
    assert grads_sym == [0.0]


def test_dual_clip_caps_negative_advantage_loss() -> None:
    cfg = LossConfig(dual_clip=3.0, aggregation="seq_mean_token_sum")
    #   (5.0, -1): standard -min(-5, -1.2) = 5, capped at -3 * -1 = 3, grad 0
    #   (2.0, -1): 2 < 3, unchanged, grad 2
    #   (5.0, +1): positive advantage untouched by the dual clip: -1.2, grad 0
    #   (5.0, -0.5): 2.5 capped at 1.5, grad 0
    total, grads, _ = _single_tokens([5.0, 2.0, 5.0, 5.0], [-1.0, -1.0, 1.0, -0.5], cfg)
    assert total == pytest.approx(3.0 + 2.0 - 1.2 + 1.5, abs=1e-12)
    assert grads == pytest.approx([0.0, 2.0, 0.0, 0.0], abs=1e-12)
    # Without the dual clip the first token costs 5 and has gradient 5.
    total_nc, grads_nc, _ = _single_tokens([5.0], [-1.0], LossConfig(aggregation="seq_mean_token_sum"))
    assert total_nc == pytest.approx(5.0, abs=1e-12)
    assert grads_nc == pytest.approx([5.0], abs=1e-12)


# --------------------------------------------------------------------------------------------
# policy_loss: masked positions carry no loss and no gradient
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("garbage", [-1e9, 1e9])
def test_masked_positions_have_no_loss_and_no_gradient(aggregation: str, garbage: float) -> None:
    g = torch.Generator().manual_seed(0)
    b, t = 3, 7
    # Row 0: 2 prompt positions, 3 completion tokens ending in EOS, 2 post-EOS; row 1: prompt 1,
    # completion 2, then padding; row 2: all completion. (logprobs layout over the full sequence.)
    mask = torch.tensor(
        [[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool
    )
    base = -torch.rand(b, t, generator=g) * 3
    old = base + 0.3 * torch.randn(b, t, generator=g)
    ref = base + 0.3 * torch.randn(b, t, generator=g)
    adv = torch.tensor([1.5, -0.7, 0.4])
    cfg = LossConfig(eps_high=0.28, dual_clip=3.0, kl_coef=0.1, aggregation=aggregation, max_completion_length=8)

    lp1 = base.clone().requires_grad_(True)
    loss1, stats1 = policy_loss(lp1, old, adv, mask, cfg, ref)
    loss1.backward()

    lp2 = base.clone()
    lp2[~mask] = garbage
    old2, ref2 = old.clone(), ref.clone()
    old2[~mask] = -garbage
    ref2[~mask] = -garbage
    lp2.requires_grad_(True)
    loss2, stats2 = policy_loss(lp2, old2, adv, mask, cfg, ref2)
    loss2.backward()

    assert torch.isfinite(loss1) and torch.isfinite(loss2)
    assert loss1.item() == loss2.item()
    assert stats1 == stats2
    for grad in (lp1.grad, lp2.grad):
        assert torch.isfinite(grad).all()
        assert torch.equal(grad[~mask], torch.zeros(int((~mask).sum())))
        assert (grad[mask] != 0).any()
    assert torch.equal(lp1.grad, lp2.grad)


def test_float_mask_is_accepted() -> None:
    logprobs, old, adv, mask = _tiny_batch()
    cfg = LossConfig()
    a, _ = policy_loss(logprobs, old, adv, mask, cfg)
    b, _ = policy_loss(logprobs, old, adv, mask.to(F64), cfg)
    assert a.item() == b.item() == pytest.approx(0.78, abs=1e-12)


def test_policy_loss_shape_errors() -> None:
    logprobs, old, adv, mask = _tiny_batch()
    with pytest.raises(ValueError, match=r"mask shape \(2, 2\)"):
        policy_loss(logprobs, old, adv, mask[:, :2], LossConfig())
    with pytest.raises(ValueError, match=r"advantages.*\(3,\)"):
        policy_loss(logprobs, old, torch.zeros(3, dtype=F64), mask, LossConfig())


# --------------------------------------------------------------------------------------------
# LossConfig validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"eps_low": -0.1}, "eps_low"),
        ({"eps_low": 1.5}, "eps_low"),
        ({"eps_high": -0.01}, "eps_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"dual_clip": 0.5}, "dual_clip"),
        ({"kl_coef": -0.04}, "kl_coef"),
        ({"kl_coef": float("nan")}, "kl_coef"),
        ({"aggregation": "sum"}, "aggregation"),
        ({"max_completion_length": 0}, "max_completion_length"),
    ],
)
def test_loss_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"LossConfig.{field}"):
        LossConfig(**kwargs)


def test_loss_config_aggregation_error_lists_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"\['token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum', 'dr_grpo'\]"):
        LossConfig(aggregation="mean")


def test_dr_grpo_without_its_denominator_is_refused_by_the_loss_naming_it() -> None:
    # a train.loss section is built before rollout.max_new_tokens is known: LossConfig.resolve sets it
    cfg = LossConfig(aggregation="dr_grpo")
    lp = torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="LossConfig.max_completion_length: required by aggregation 'dr_grpo'"):
        policy_loss(lp, lp, torch.ones(1, dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool), cfg)
    assert cfg.resolve(max_new_tokens=8).max_completion_length == 8


# --------------------------------------------------------------------------------------------
# TRL reference (independent plain implementation of GRPOTrainer's documented formulas)
# --------------------------------------------------------------------------------------------


def trl_grpo_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    ref_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    beta: float,
    epsilon_low: float,
    epsilon_high: float,
    loss_type: str,
    max_completion_length: int,
) -> torch.Tensor:
    """TRL GRPOTrainer._compute_loss (token-level importance sampling, one process)."""
    per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss1 = coef_1 * advantages.unsqueeze(1)
    per_token_loss2 = coef_2 * advantages.unsqueeze(1)
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    m = completion_mask.float()
    if loss_type == "grpo":
        return ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * m).sum() / (per_token_loss.size(0) * max_completion_length)
    raise ValueError(loss_type)


def trl_group_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """TRL: groups are consecutive blocks of num_generations; (r - mean) / (std + 1e-4)."""
    mean = rewards.view(-1, num_generations).mean(dim=1).repeat_interleave(num_generations, dim=0)
    std = rewards.view(-1, num_generations).std(dim=1).repeat_interleave(num_generations, dim=0)
    return (rewards - mean) / (std + 1e-4)


def _random_batch(b: int = 8, t: int = 12):
    g = torch.Generator().manual_seed(1234)
    logprobs = -torch.rand(b, t, generator=g) * 4
    old = logprobs + 0.25 * torch.randn(b, t, generator=g)  # ratios spread well past [0.8, 1.2]
    ref = logprobs + 0.25 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0], lengths[1] = t, 2  # make sure both a full and a short completion are present
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    return logprobs, old, ref, adv, mask


@pytest.mark.parametrize(
    ("loss_type", "aggregation"),
    [("grpo", "seq_mean_token_mean"), ("bnpo", "token_mean"), ("dr_grpo", "dr_grpo")],
)
def test_matches_trl_reference(loss_type: str, aggregation: str) -> None:
    logprobs, old, ref, adv, mask = _random_batch()
    assert len(set(mask.sum(1).tolist())) > 2  # varying lengths
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, kl_coef=0.04, aggregation=aggregation, max_completion_length=12)

    lp_ours = logprobs.clone().requires_grad_(True)
    ours, stats = policy_loss(lp_ours, old, adv, mask, cfg, ref)
    ours.backward()

    lp_ref = logprobs.clone().requires_grad_(True)
    expected = trl_grpo_loss(lp_ref, old, ref, adv, mask, 0.04, 0.2, 0.28, loss_type, 12)
    expected.backward()

    assert stats["clip_frac"] > 0  # the clipped branch is exercised
    assert abs(ours.item() - expected.item()) < 1e-6
    torch.testing.assert_close(lp_ours.grad, lp_ref.grad, rtol=1e-6, atol=1e-6)


def test_group_mode_matches_trl_advantages() -> None:
    g = torch.Generator().manual_seed(7)
    num_generations = 4
    rewards = torch.rand(6 * num_generations, generator=g)
    expected = trl_group_advantages(rewards, num_generations)
    groups = torch.arange(6).repeat_interleave(num_generations)
    torch.testing.assert_close(group_advantages(rewards, groups, "group"), expected, rtol=1e-6, atol=1e-6)
    # Order does not matter: shuffle samples together with their group ids.
    perm = torch.randperm(rewards.numel(), generator=g)
    torch.testing.assert_close(group_advantages(rewards[perm], groups[perm] * 10 - 7), expected[perm], rtol=1e-6, atol=1e-6)
