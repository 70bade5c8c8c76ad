"""The truncated importance weight of the loss (issue 32, item 2's loss part and item 4's statistics).

w = min(exp(old_logprob - sampling_logprob), cap) per token (``token``) or one per sample from the summed
log-ratio (``sequence``), a constant that multiplies each token's PPO-clipped term (not the KL term).
Expected numbers are worked out by hand in the comments.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from teamrl.core.config import ConfigError, load_config
from teamrl.core.sample import Sample
from teamrl.losses import LossConfig, policy_loss
from teamrl.losses.policy_loss import importance_weights
from teamrl.policies.policy import Policy
from teamrl.trainer.update import (SamplingLogprobsError, UpdateParams, make_update_params, policy_logprobs,
                                   update_policy)

F64 = torch.float64
E = math.e


# ---- the weight, by hand ----------------------------------------------------------------------------------------

def test_token_weight_is_the_capped_ratio_of_old_to_sampling_per_token() -> None:
    old = torch.tensor([[0.0, -1.0, -2.0, 5.0]], dtype=F64)
    sampling = torch.tensor([[0.0, -2.0, -0.5, float("nan")]], dtype=F64)  # the last token is masked: never read
    mask = torch.tensor([[True, True, True, False]])
    w = importance_weights(old, sampling, mask, "token", cap=2.0)
    # log-ratios 0, 1, -1.5: weights 1, min(e, 2) = 2 (the cap), exp(-1.5) = 0.2231; masked: 1 (carries no loss)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, math.exp(-1.5), 1.0]], dtype=F64))
    assert not w.requires_grad


def test_sequence_weight_is_one_capped_ratio_per_sample_from_the_summed_log_ratio() -> None:
    old = torch.tensor([[-1.0, -1.0, -1.0], [-0.5, -0.5, 0.0]], dtype=F64)
    sampling = torch.tensor([[-0.5, -1.5, -0.5], [-2.0, -2.0, -9.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    w = importance_weights(old, sampling, mask, "sequence", cap=3.0)
    # row 0: -0.5 + 0.5 - 0.5 = -0.5 -> exp(-0.5) = 0.6065 on every token; row 1: 1.5 + 1.5 (the masked 9 left out)
    # = 3 -> exp(3) = 20.1, capped at 3; its masked token: 1
    torch.testing.assert_close(w, torch.tensor([[math.exp(-0.5)] * 3, [3.0, 3.0, 1.0]], dtype=F64))


def test_a_huge_log_ratio_is_capped_not_inf_and_a_tiny_one_is_zero_not_nan() -> None:
    old = torch.tensor([[0.0, 0.0]], dtype=F64)
    sampling = torch.tensor([[-1e4, 1e4]], dtype=F64)
    for mode in ("token", "sequence"):
        w = importance_weights(old, sampling, torch.tensor([[True, False]]), mode, cap=2.0)
        assert torch.equal(w[:, 0], torch.tensor([2.0], dtype=F64)), (mode, w)
    w = importance_weights(old, sampling, torch.tensor([[False, True]]), "token", cap=2.0)
    assert torch.equal(w, torch.tensor([[1.0, 0.0]], dtype=F64))


# ---- the loss and its gradient ----------------------------------------------------------------------------------

def _leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=F64, requires_grad=True)


def test_gradient_is_the_hand_computed_weighted_gradient_and_the_kl_is_not_weighted() -> None:
    logp = _leaf([[-1.0, -2.0, -0.5], [-1.5, -1.0, -3.0]])
    old = torch.tensor([[-1.1, -2.0, -0.5], [-1.5, -0.9, -3.0]], dtype=F64)
    sampling = torch.tensor([[-1.6, -2.5, -0.5], [-0.5, -1.9, 0.0]], dtype=F64)
    ref = torch.tensor([[-1.2, -2.2, -0.4], [-1.3, -1.1, 0.0]], dtype=F64)
    adv = torch.tensor([1.0, -0.5], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    kl_coef = 0.1
    cfg = LossConfig(eps_low=0.5, eps_high=0.5, kl_coef=kl_coef, importance_correction="token", importance_cap=2.0)
    loss, stats = policy_loss(logp, old, adv, mask, cfg, ref_logprobs=ref, sampling_logprobs=sampling)
    loss.backward()

    # ratios exp(logp - old): 1.105, 1, 1 | 1, 0.905 -- all inside [0.5, 1.5], so no clip: d(-A r)/dlogp = -A r
    # weights exp(old - sampling): e^0.5 = 1.649, e^0.5, 1 | e^-1 = 0.368, e^1 = 2.718 -> capped at 2
    w = [[math.exp(0.5), math.exp(0.5), 1.0], [math.exp(-1.0), 2.0, 0.0]]
    expected = torch.zeros(2, 3, dtype=F64)
    for b in range(2):
        for t in range(3):
            if not mask[b, t]:
                continue
            r = math.exp(logp[b, t].item() - old[b, t].item())
            d = ref[b, t].item() - logp[b, t].item()
            # k3 = exp(d) - d - 1, d = ref - logp: dk3/dlogp = 1 - exp(d); the KL term is NOT multiplied by w
            expected[b, t] = (-adv[b].item() * w[b][t] * r + kl_coef * (1.0 - math.exp(d))) / 5  # token_mean, 5 tokens
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=1e-12)
    assert stats["is_weight_max"] == pytest.approx(2.0) and stats["is_weight_min"] == pytest.approx(math.exp(-1.0))
    assert stats["is_weight_mean"] == pytest.approx((2 * math.exp(0.5) + 1.0 + math.exp(-1.0) + 2.0) / 5)
    assert stats["is_truncated_frac"] == pytest.approx(1 / 5)


def test_the_weight_multiplies_the_clipped_term_so_a_clipped_token_stays_without_gradient() -> None:
    logp = _leaf([[0.0, 0.0]])
    old = torch.tensor([[-1.0, 0.0]], dtype=F64)  # ratio e = 2.72 > 1.2: clipped for A > 0
    sampling = torch.tensor([[-1.5, -0.3]], dtype=F64)
    cfg = LossConfig(importance_correction="token", importance_cap=5.0)
    loss, stats = policy_loss(logp, old, torch.tensor([1.0], dtype=F64), torch.ones(1, 2, dtype=torch.bool), cfg,
                              sampling_logprobs=sampling)
    loss.backward()
    # token 0: loss -1.2 * A * w, w = e^0.5, no gradient (clipped); token 1: ratio 1, w = e^0.3, gradient -w / 2
    assert loss.item() == pytest.approx(-(1.2 * math.exp(0.5) + math.exp(0.3)) / 2)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -math.exp(0.3) / 2]], dtype=F64))
    assert stats["clip_frac"] == pytest.approx(0.5)


def test_sequence_mode_weighs_every_token_of_a_sample_alike_and_counts_samples() -> None:
    logp = _leaf([[-1.0, -1.0], [-2.0, -2.0]])
    sampling = torch.tensor([[-1.5, -1.5], [-1.0, -2.5]], dtype=F64)  # summed old - sampling: 1.0 | -0.5
    cfg = LossConfig(importance_correction="sequence", importance_cap=2.0, aggregation="seq_mean_token_mean")
    loss, stats = policy_loss(logp, logp.detach(), torch.tensor([1.0, 1.0], dtype=F64), torch.ones(2, 2, dtype=torch.bool),
                              cfg, sampling_logprobs=sampling)
    loss.backward()
    w = [2.0, math.exp(-0.5)]  # e^1 = 2.72 capped at 2
    torch.testing.assert_close(logp.grad, torch.tensor([[-w[0] / 4] * 2, [-w[1] / 4] * 2], dtype=F64))
    assert stats["is_weight_count"] == 2.0  # samples, not tokens
    assert stats["is_truncated_frac"] == pytest.approx(0.5)
    assert stats["is_weight_mean"] == pytest.approx((2.0 + math.exp(-0.5)) / 2)


def test_none_is_the_loss_without_the_option_bit_for_bit_and_never_reads_sampling_logprobs() -> None:
    torch.manual_seed(0)
    base = torch.randn(3, 5, dtype=torch.float32)
    old = base + 0.1 * torch.randn(3, 5)
    ref = base + 0.1 * torch.randn(3, 5)
    adv = torch.tensor([1.0, -0.7, 0.3])
    mask = torch.rand(3, 5) > 0.2
    garbage = torch.full((3, 5), float("nan"))
    for extra in ({}, {"dual_clip": 3.0}, {"kl_coef": 0.05, "kl_bias_correction": True}):
        grads, results = [], []
        for cfg, sampling in ((LossConfig(**extra), None), (LossConfig(**extra, importance_correction="none"), garbage),
                              (LossConfig(**extra, importance_correction="none", importance_cap=0.5), old)):
            logp = base.clone().requires_grad_(True)
            loss, stats = policy_loss(logp, old, adv, mask, cfg, ref_logprobs=ref, sampling_logprobs=sampling)
            loss.backward()
            grads.append(logp.grad)
            results.append((loss.item(), stats))
        assert results[0] == results[1] == results[2], extra
        assert not any(k.startswith("is_") for k in results[0][1])
        assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2]), extra


def test_policy_loss_needs_sampling_logprobs_of_the_same_shape_when_the_correction_is_on() -> None:
    logp, mask, adv = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.zeros(2)
    cfg = LossConfig(importance_correction="token")
    with pytest.raises(ValueError, match="sampling_logprobs"):
        policy_loss(logp, logp, adv, mask, cfg)
    with pytest.raises(ValueError, match=r"sampling_logprobs shape \(2, 2\)"):
        policy_loss(logp, logp, adv, mask, cfg, sampling_logprobs=torch.zeros(2, 2))


@pytest.mark.parametrize("kwargs, words", [
    ({"importance_correction": "tokens"}, ["LossConfig.importance_correction", "'auto', 'token', 'sequence', 'none'"]),
    ({"importance_correction": "token_truncate"}, ["importance_correction", "token"]),
    ({"importance_cap": 0.0}, ["importance_cap", "> 0"]),
    ({"importance_cap": -1.0}, ["importance_cap", "> 0"]),
    ({"importance_cap": float("inf")}, ["importance_cap", "finite"]),
])
def test_loss_config_refuses_a_bad_mode_or_cap_in_one_line(kwargs, words) -> None:
    with pytest.raises(ValueError) as e:
        LossConfig(**kwargs)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


# ---- the config ---------------------------------------------------------------------------------------------------

def _cfg(*extra: str):
    return load_config(None, ["name=iw", "model=tiny-random", "task.name=word_count", *extra])


@pytest.mark.parametrize("override, words", [
    ("train.loss.importance_correction=tokens", ["train.loss.importance_correction", "auto", "token", "sequence", "none"]),
    ("train.loss.importance_correction=token_truncate", ["train.loss.importance_correction", "'token' here"]),
    ("train.loss.importance_correction=sequence_mask", ["train.loss.importance_correction", "not offered"]),
    ("train.loss.importance_cap=0", ["train.loss.importance_cap", "> 0"]),
    ("train.loss.importance_cap=-2", ["train.loss.importance_cap", "> 0"]),
    ("train.loss.importance_cap=.inf", ["train.loss.importance_cap", "finite"]),
])
def test_config_refuses_a_bad_mode_or_cap_in_one_line(override, words) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(override)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_auto_is_token_when_rollouts_may_be_stale_else_none() -> None:
    cfg = _cfg()
    assert cfg.train.loss.importance_correction == "auto" and cfg.train.loss.importance_cap == 2.0
    assert make_update_params(cfg).loss.importance_correction == "none"  # max_staleness 0 (or not yet a key)
    cfg.rollout.max_staleness = 1  # a plain attribute until rollout.max_staleness lands in the schema
    assert make_update_params(cfg).loss.importance_correction == "token"
    explicit = _cfg("train.loss.importance_correction=sequence", "train.loss.importance_cap=3.5")
    assert (explicit_loss := make_update_params(explicit).loss).importance_correction == "sequence"
    assert explicit_loss.importance_cap == 3.5
    assert make_update_params(_cfg("train.loss.importance_correction=none")).loss.importance_correction == "none"


# ---- update_policy on the tiny model -------------------------------------------------------------------------------

def _sgd_policy(model) -> Policy:
    pol = Policy("p", copy.deepcopy(model), None, lr=1.0, weight_decay=0.0)
    pol.optimizer = torch.optim.SGD(pol.parameters(), lr=1.0)  # the step equals the gradient
    return pol


def _samples(tok, logprobs=None) -> list[Sample]:
    eos = tok.eos_token_id
    rows = [([256, 30], [40, 41, eos], 1.0), ([256, 30], [42, eos], -1.0), ([256, 31], [43, 44, 45], 0.5)]
    return [Sample(role="a", policy="p", problem_id=f"q{i}", prompt_ids=p, completion_ids=c,
                   sampling_logprobs=[] if logprobs is None else list(logprobs[i]), advantage=a, episode=i)
            for i, (p, c, a) in enumerate(rows)]


def _update(model, tok, samples, loss: LossConfig, micro_batch_size: int = 16) -> tuple[torch.Tensor, dict[str, float]]:
    pol = _sgd_policy(model)
    before = [p.detach().clone() for p in pol.parameters()]
    stats = update_policy(pol, samples, UpdateParams(loss=loss, max_grad_norm=1e9, micro_batch_size=micro_batch_size),
                          tok.pad_token_id, [tok.eos_token_id])
    return torch.cat([(b - p.detach()).flatten() for b, p in zip(before, pol.parameters())]), stats


def _exact_logprobs(model, tok) -> list[list[float]]:
    """The sampling log-probs a synchronous rollout of these weights gives: the trainer's own."""
    pol = Policy("p", copy.deepcopy(model), None, lr=1.0, weight_decay=0.0)
    return [row.tolist() for row in policy_logprobs(pol, _samples(tok), UpdateParams(loss=LossConfig()), tok.pad_token_id)]


def test_update_with_none_and_auto_at_staleness_0_is_todays_update_bit_for_bit(tiny) -> None:
    model, tok = tiny
    today, today_stats = _update(model, tok, _samples(tok), LossConfig())  # the option absent (LossConfig's defaults)
    for cfg in (_cfg(), _cfg("train.loss.importance_correction=none")):
        loss = make_update_params(cfg).loss
        # sampling log-probs are never read: garbage there changes nothing
        delta, stats = _update(model, tok, _samples(tok, [[float("nan")] * 3] * 3), loss)
        assert torch.equal(delta, today) and stats == today_stats
        assert not any(k.startswith("is_") for k in stats)
    assert today.abs().sum() > 0


def test_update_logs_the_weight_statistics_and_a_constant_weight_scales_the_step(tiny) -> None:
    model, tok = tiny
    exact = _exact_logprobs(model, tok)
    none_delta, _ = _update(model, tok, _samples(tok, exact), LossConfig())
    on = LossConfig(importance_correction="token", importance_cap=2.0)
    # on-policy (sampling = the trainer's log-probs): every weight is 1, the step is today's
    delta, stats = _update(model, tok, _samples(tok, exact), on)
    torch.testing.assert_close(delta, none_delta, rtol=1e-5, atol=1e-7)
    assert stats["is_weight_mean"] == pytest.approx(1.0, abs=1e-5) and stats["is_truncated_frac"] == 0.0
    # every sampling log-prob log 2 higher than the trainer's: every weight 1/2, so the (SGD) step is half today's
    half, stats = _update(model, tok, _samples(tok, [[x + math.log(2) for x in row] for row in exact]), on)
    torch.testing.assert_close(half, none_delta / 2, rtol=1e-4, atol=1e-7)
    assert stats["is_weight_max"] == pytest.approx(0.5, rel=1e-5) and stats["is_weight_min"] == pytest.approx(0.5, rel=1e-5)
    # sample 2 (3 of the 8 loss tokens) sampled 1 nat less likely than now: its weights e > 2 are truncated
    mixed = [exact[0], exact[1], [x - 1.0 for x in exact[2]]]
    _, stats = _update(model, tok, _samples(tok, mixed), on)
    assert stats["is_weight_max"] == 2.0 and stats["is_truncated_frac"] == pytest.approx(3 / 8)
    assert stats["is_weight_min"] == pytest.approx(1.0, abs=1e-5)
    assert stats["is_weight_mean"] == pytest.approx((5 * 1.0 + 3 * 2.0) / 8, abs=1e-5)
    # sequence mode: one weight per sample
    _, stats = _update(model, tok, _samples(tok, mixed), LossConfig(importance_correction="sequence"))
    assert stats["is_weight_count"] == 3.0 and stats["is_truncated_frac"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_micro_batches_and_passes_give_the_full_batchs_weights_and_step(tiny, mode) -> None:
    """micro_batch_size 1: every prompt its own micro-batch, and the two completions of prompt [256, 30] one pass each
    (shared_prefix_backward): the weights follow their rows."""
    model, tok = tiny
    exact = _exact_logprobs(model, tok)
    mixed = [[x + 0.3 for x in exact[0]], [x - 0.2 for x in exact[1]], [x - 1.0 for x in exact[2]]]
    loss = LossConfig(importance_correction=mode)
    whole, whole_stats = _update(model, tok, _samples(tok, mixed), loss)
    split, split_stats = _update(model, tok, _samples(tok, mixed), loss, micro_batch_size=1)
    torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-6)
    for k in ("is_weight_mean", "is_weight_max", "is_weight_min", "is_truncated_frac", "is_weight_count"):
        assert split_stats[k] == pytest.approx(whole_stats[k], rel=1e-5), k
    assert whole_stats["is_weight_min"] == pytest.approx(math.exp(-0.3 * (1 if mode == "token" else 3)), rel=1e-4)


@pytest.mark.parametrize("bad, words", [
    (lambda lp: lp[:-1], ["2 sampling log-probs", "3 completion tokens"]),
    (lambda lp: lp[:1] + [float("nan")] + lp[2:], ["nan", "token 1"]),
    (lambda lp: lp[:2] + [float("-inf")], ["-inf", "token 2"]),
])
def test_a_mismatched_or_nonfinite_sampling_logprob_is_one_line_naming_the_sample_and_nothing_moves(tiny, bad, words) -> None:
    model, tok = tiny
    exact = _exact_logprobs(model, tok)
    samples = _samples(tok, exact)
    samples[2].sampling_logprobs = bad(list(samples[2].sampling_logprobs))
    pol = _sgd_policy(model)
    before = [p.detach().clone() for p in pol.parameters()]
    with pytest.raises(SamplingLogprobsError) as e:
        update_policy(pol, samples, UpdateParams(loss=LossConfig(importance_correction="token")), tok.pad_token_id,
                      [tok.eos_token_id])
    message = str(e.value)
    assert "\n" not in message and "'q2'" in message and "role 'a'" in message and "episode 2" in message, message
    assert all(w in message for w in words), message
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, pol.parameters()))


# ---- the trainer logs them per policy ------------------------------------------------------------------------------

def _opposite_advantages(monkeypatch) -> None:
    """A random model is never right: the trainer gives its trained samples advantages +1 / -1 in turn."""
    import itertools

    from teamrl.trainer.trainer import Trainer

    assign = Trainer._assign_advantages

    def opposite_advantages(self, samples):
        train = assign(self, samples)
        for s, a in zip(train, itertools.cycle([1.0, -1.0])):
            s.advantage = a
        return train

    monkeypatch.setattr(Trainer, "_assign_advantages", opposite_advantages)


def test_the_trainer_logs_each_policys_weights_and_none_by_default(tmp_path, monkeypatch) -> None:
    """MAGRPO, one adapter per role: ``is_weight_*/<policy>`` for every policy; synchronous in-process sampling
    draws from the weights the update starts from, so every weight is 1 (to float rounding)."""
    from teamrl.trainer.trainer import Trainer

    _opposite_advantages(monkeypatch)

    def step(name: str, *extra: str) -> tuple[Trainer, dict]:
        tr = Trainer(load_config(None, [f"name={name}", f"run.dir={tmp_path}", "model=tiny-random", "algorithm=magrpo",
                                        "task.name=math.solve", "task.num_problems=12", "task.test_size=3",
                                        "workflow.name=voting", "policy.mode=lora_per_role", "rollout.group_size=2",
                                        "rollout.batch_size=1", "rollout.max_new_tokens=4", "run.progress=false",
                                        "run.tensorboard=false", "run.log_episodes=false", *extra]))
        return tr, tr.train_step()

    tr, rec = step("iw_token", "train.loss.importance_correction=token")
    assert len(tr.router.policies) == 2
    for name in tr.router.policies:
        assert rec[f"is_weight_mean/{name}"] == pytest.approx(1.0, abs=1e-4), rec
        assert rec[f"is_weight_min/{name}"] <= rec[f"is_weight_mean/{name}"] <= rec[f"is_weight_max/{name}"]
        assert rec[f"is_truncated_frac/{name}"] == 0.0
    _, rec = step("iw_auto")
    assert not [k for k in rec if k.startswith("is_")] and any(k.startswith("loss/") for k in rec)
    # EOS blocked for the first 4 tokens: the engine records the unblocked distribution's log-probs, the trainer's
    # (issue 43.6: weights mean 0.99799, min 0.99463 with min_new_tokens=6)
    tr, rec = step("iw_min_tokens", "train.loss.importance_correction=token", "rollout.min_new_tokens=4")
    for name in tr.router.policies:
        for k in ("is_weight_mean", "is_weight_min", "is_weight_max"):
            assert rec[f"{k}/{name}"] == pytest.approx(1.0, abs=1e-4), (k, rec)


def test_on_policy_weights_are_1_when_roles_of_one_shared_policy_sample_at_different_temperatures(tmp_path,
                                                                                                  monkeypatch) -> None:
    """Each sample's old log-probs are of its own temperature (issue 43.2: every sample's were taken at the first
    sample's, so a role sampled at T=0.5 beside one at 1.0 on one shared policy trained under the wrong
    distribution: synchronous weights 0.648..1.407 where they must be 1)."""
    import dataclasses

    from teamrl.api import EpisodeOutcome, register_workflow
    from teamrl.trainer.trainer import Trainer
    from teamrl.workflows import WORKFLOWS

    _opposite_advantages(monkeypatch)
    temperatures = []

    @register_workflow("two_temperatures", roles=("cool", "warm"))
    async def two_temperatures(ctx, task, problem, settings):
        question = task.question(problem)
        a = await ctx.generate("cool", question, params=dataclasses.replace(ctx.params, temperature=0.5))
        b = await ctx.generate("warm", question + a)
        temperatures.extend(s.temperature for c in ctx.calls for s in c.samples)
        return EpisodeOutcome(b, None, False)

    try:
        tr = Trainer(load_config(None, [f"run.dir={tmp_path}", "name=two_t", "model=tiny-random", "algorithm=grpo",
                                        "workflow.name=two_temperatures", "task.name=math.solve", "task.num_problems=12",
                                        "task.test_size=3", "policy.mode=shared", "rollout.group_size=2",
                                        "rollout.batch_size=2", "rollout.max_new_tokens=6", "run.progress=false",
                                        "run.tensorboard=false", "run.log_episodes=false",
                                        "train.loss.importance_correction=token"]))
        rec = tr.train_step()
    finally:
        del WORKFLOWS["two_temperatures"]
    assert {0.5, 1.0} <= set(temperatures)
    assert rec["is_weight_count/shared"] > 0
    for k in ("is_weight_mean", "is_weight_min", "is_weight_max"):
        assert rec[f"{k}/shared"] == pytest.approx(1.0, abs=1e-4), rec


def test_teamrl_train_stops_in_one_line_with_exit_2_on_a_nan_sampling_logprob(tmp_path, monkeypatch, capsys) -> None:
    """What the engine returned is the run's input: a NaN sampling log-prob (an HTTP server's missing value) is the
    usual one-line error, no traceback, and no checkpoint is written."""
    from teamrl.cli import main
    from teamrl.trainer.trainer import Trainer

    assign = Trainer._assign_advantages

    def corrupt(self, samples):
        train = assign(self, samples)
        train[0].advantage = 1.0  # a random model is never right: make sure the sample is trained
        train[0].sampling_logprobs = [float("nan")] + list(train[0].sampling_logprobs[1:])
        return train

    monkeypatch.setattr(Trainer, "_assign_advantages", corrupt)
    rc = main(["train", "name=iw_nan", f"run.dir={tmp_path}", "model=tiny-random", "task.name=word_count",
               "rollout.group_size=2", "rollout.batch_size=1", "rollout.max_new_tokens=4", "run.progress=false",
               "run.tensorboard=false", "train.steps=1", "train.loss.importance_correction=token"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "sampling log-prob nan at token 0" in err[0], err
    assert not list(tmp_path.glob("iw_nan/checkpoints/*"))


def test_the_trainer_combines_the_weights_of_every_optimizer_step_of_a_policy(tmp_path, monkeypatch) -> None:
    """policy.equalize_steps false: one optimizer step per role instance of the shared policy. ``is_weight_*/shared`` are
    of all of them (counts add, the max of the maxima, ...), not of the last step alone. The aggregator's tokens are
    sampled log 2 more likely than the trainer says: weight 1/2; the generators' on-policy: weight 1."""
    import itertools

    import teamrl.trainer.learner as workers
    from teamrl.trainer.trainer import Trainer

    assign = Trainer._assign_advantages

    def opposite_advantages(self, samples):  # a random model is never right: give the samples +1 / -1 in turn
        train = assign(self, samples)
        for s, a in zip(train, itertools.cycle([1.0, -1.0])):
            s.advantage = a
            if s.role.startswith("aggregator"):
                s.sampling_logprobs = [x + math.log(2) for x in s.sampling_logprobs]
        return train

    monkeypatch.setattr(Trainer, "_assign_advantages", opposite_advantages)
    steps: list[dict] = []
    update_steps = workers.update_policy_steps

    def spy(*args, **kwargs):
        out = update_steps(*args, **kwargs)
        steps.extend(out)
        return out

    monkeypatch.setattr(workers, "update_policy_steps", spy)
    tr = Trainer(load_config(None, ["name=iw_parts", f"run.dir={tmp_path}", "model=tiny-random", "algorithm=magrpo",
                                    "task.name=math.solve", "task.num_problems=12", "task.test_size=3",
                                    "workflow.name=voting", "policy.equalize_steps=false", "rollout.group_size=2",
                                    "rollout.batch_size=1", "rollout.max_new_tokens=4", "run.progress=false",
                                    "run.tensorboard=false", "run.log_episodes=false",
                                    "train.loss.importance_correction=token"]))
    rec = tr.train_step()
    assert list(tr.router.policies) == ["shared"] and rec["optimizer_steps/shared"] == len(steps) >= 2
    counts = [s["is_weight_count"] for s in steps]
    assert rec["is_weight_count/shared"] == sum(counts) > max(counts)
    assert rec["is_weight_min/shared"] == pytest.approx(0.5, rel=1e-4)  # the aggregator's
    assert rec["is_weight_max/shared"] == pytest.approx(1.0, abs=1e-4)  # the generators'
    mean = sum(s["is_weight_mean"] * s["is_weight_count"] for s in steps) / sum(counts)
    assert rec["is_weight_mean/shared"] == pytest.approx(mean, rel=1e-6)
    assert 0.5 < rec["is_weight_mean/shared"] < 1.0
