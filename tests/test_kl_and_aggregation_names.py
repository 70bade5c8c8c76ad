"""The KL estimators (k3, and k3 times the importance ratio as TRL 1.16's default) and what
``token_mean`` computes under micro-batching (TRL's ``dapo``, not ``bnpo``)."""

import copy

import pytest
import torch

from teamrl.core.config import ConfigError, load_config
from teamrl.core.sample import Sample
from teamrl.losses import LossConfig, policy_loss
from teamrl.policies.policy import Policy
from teamrl.trainer.update import UpdateParams, make_update_params, update_policy


def _batch():
    g = torch.Generator().manual_seed(3)
    logprobs = -torch.rand(3, 5, generator=g) * 3
    old = logprobs + 0.3 * torch.randn(3, 5, generator=g)
    ref = logprobs + 0.3 * torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    return logprobs, old, ref, mask


@pytest.mark.parametrize("bias_correction", [False, True])
def test_kl_estimator_matches_its_formula(bias_correction: bool) -> None:
    logprobs, old, ref, mask = _batch()
    beta = 0.3
    # advantages 0: the loss is the KL term alone
    cfg = LossConfig(kl_coef=beta, kl_bias_correction=bias_correction)
    lp = logprobs.clone().requires_grad_(True)
    loss, stats = policy_loss(lp, old, torch.zeros(3), mask, cfg, ref)
    loss.backward()

    lp2 = logprobs.clone().requires_grad_(True)
    delta = ref - lp2
    k3 = torch.exp(delta) - delta - 1
    per_token = k3 * torch.exp(lp2 - old) if bias_correction else k3
    m = mask.float()
    expected = beta * (per_token * m).sum() / m.sum()
    expected.backward()

    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert stats["kl"] == pytest.approx(expected.item() / beta, abs=1e-6)
    torch.testing.assert_close(lp.grad, lp2.grad, rtol=1e-6, atol=1e-7)


def test_bias_correction_changes_the_gradient_even_on_policy() -> None:
    logprobs, _, ref, mask = _batch()
    grads = []
    for corrected in (False, True):
        lp = logprobs.clone().requires_grad_(True)
        loss, _ = policy_loss(lp, lp.detach(), torch.zeros(3), mask, LossConfig(kl_coef=0.1, kl_bias_correction=corrected), ref)
        loss.backward()
        grads.append(lp.grad)
    assert not torch.allclose(grads[0], grads[1])


def test_kl_estimator_config_default_is_plain_k3_and_reaches_the_loss(tmp_path) -> None:
    assert make_update_params(load_config(None, [])).loss.kl_bias_correction is False
    cfg = load_config(None, ["train.loss.kl_coef=0.1", "train.loss.kl_bias_correction=true"])
    assert make_update_params(cfg).loss.kl_bias_correction is True


@pytest.mark.parametrize(("trl_name", "ours"), [("dapo", "token_mean"), ("grpo", "seq_mean_token_mean"), ("bnpo", "")])
def test_trl_loss_type_names_get_a_one_line_error_naming_ours(trl_name: str, ours: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"train.loss.aggregation={trl_name}"])
    msg = str(err.value)
    assert "\n" not in msg and "train.loss.aggregation" in msg and "TRL" in msg
    if ours:
        assert f"'{ours}'" in msg
    with pytest.raises(ValueError, match="TRL"):
        LossConfig(aggregation=trl_name)


def test_token_mean_is_trl_dapo_over_micro_batches_not_bnpo(tiny) -> None:
    """Micro-batches of 2 and 5 tokens: the update follows the full-batch token mean (TRL dapo),
    not the mean of each micro-batch's token mean (TRL bnpo)."""
    model, tok = tiny
    eos = tok.eos_token_id
    samples = [Sample(role="a", policy="p", problem_id=0, prompt_ids=[256, 40 + i], completion_ids=c, sampling_logprobs=[],
                      advantage=a) for i, (c, a) in enumerate([([50, eos], 1.0), ([51, 52, 53, 54, eos], -1.0)])]

    def step(mb: int) -> torch.Tensor:
        pol = Policy("p", copy.deepcopy(model), None, lr=1.0, weight_decay=0.0)
        pol.optimizer = torch.optim.SGD(pol.parameters(), lr=1.0)
        before = [p.detach().clone() for p in pol.parameters()]
        update_policy(pol, samples, UpdateParams(loss=LossConfig(), micro_batch_size=mb, max_grad_norm=1e9), tok.pad_token_id, [eos])
        return torch.cat([(b - p.detach()).flatten() for b, p in zip(before, pol.parameters())])

    full, split = step(2), step(1)
    torch.testing.assert_close(split, full, rtol=1e-4, atol=1e-6)  # dapo: the split does not matter
    # bnpo would weight each micro-batch equally: (g1/2 + g2/5) / 2 instead of (g1 + g2) / 7
    m = copy.deepcopy(model)
    from teamrl.policies.logprobs import build_token_batch, completion_logprobs
    from teamrl.losses import completion_mask
    grads = []
    for s in samples:
        m.zero_grad()
        b = build_token_batch([s.prompt_ids], [s.completion_ids], tok.pad_token_id)
        lp, _ = completion_logprobs(m, b)
        loss, _ = policy_loss(lp, lp.detach(), torch.tensor([s.advantage]), completion_mask(b.completion_ids, eos, b.completion_pad_mask), LossConfig())
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.requires_grad]))
    bnpo = (grads[0] + grads[1]) / 2
    dapo = (2 * grads[0] + 5 * grads[1]) / 7
    assert torch.allclose(full, dapo, rtol=1e-3, atol=1e-6)
    assert not torch.allclose(full, bnpo, rtol=1e-3, atol=1e-6)
