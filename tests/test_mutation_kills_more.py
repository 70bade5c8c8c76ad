"""Tests written to kill the mutants of tools/mutants.py aimed at issue 13's code (trajectory groups,
non-finite handling, ...) that the rest of the suite let through: each pins a number or decision a
training step depends on."""

import copy

import pytest
import torch

import teamrl.trainer.update as update_module
from teamrl.core.sample import Sample
from teamrl.losses import LossConfig, trajectory_advantages, trajectory_ids
from teamrl.policies.policy import Policy
from teamrl.trainer.update import UpdateParams, nonfinite_reward_groups, update_policy


def test_an_untagged_sample_is_never_part_of_a_tagged_trajectory():
    # sample 1 has no tag: its own trajectory, even though another sample is tagged with trajectory 1
    assert trajectory_ids([1, None, 1]).tolist() == [0, 1, 0]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])  # trajectories {0, 2} (reward 1), {1} and {3} (reward 0)
    adv = trajectory_advantages(rewards, torch.zeros(4, dtype=torch.long),
                                trajectory_ids([1, None, 1, None]))
    # units [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3)
    expected = [(2 / 3) / (1 / 3) ** 0.5, -(1 / 3) / (1 / 3) ** 0.5]
    assert adv.tolist() == pytest.approx([expected[0], expected[1], expected[0], expected[1]], abs=1e-3)


def _sample(group: str, reward: float) -> Sample:
    return Sample(role="agent", policy="p", problem_id=group, prompt_ids=[1], completion_ids=[2], sampling_logprobs=[],
                  reward=reward, group=(group,))


def test_drop_group_returns_every_group_holding_a_non_finite_reward():
    samples = [_sample("a", 1.0), _sample("b", float("nan")), _sample("b", 0.0), _sample("c", float("-inf")),
               _sample("d", float("inf"))]
    assert nonfinite_reward_groups(samples, "t", "drop_group") == {("b",), ("c",), ("d",)}
    assert nonfinite_reward_groups(samples[:1], "t", "error") == set()


def _update_sample(i: int, tok, adv: float) -> Sample:
    return Sample(role="a", policy="p", problem_id=0, prompt_ids=[256, 30 + i], completion_ids=[40 + i, 41, tok.eos_token_id],
                  sampling_logprobs=[], advantage=adv)


def _run_update(tiny):
    model, tok = tiny
    pol = Policy("p", copy.deepcopy(model), None, lr=1e-2, weight_decay=0.0)
    before = [p.detach().clone() for p in pol.parameters()]
    stats = update_policy(pol, [_update_sample(0, tok, 1.0), _update_sample(1, tok, -1.0)], UpdateParams(loss=LossConfig()),
                          tok.pad_token_id, [tok.eos_token_id])
    unchanged = all(torch.equal(a, b) for a, b in zip(before, pol.parameters()))
    return stats, unchanged, pol


def test_a_non_finite_loss_skips_the_step_even_when_its_gradient_is_finite(tiny, monkeypatch):
    real = update_module.policy_loss

    def loss_with_an_infinite_constant(*args, **kwargs):  # + inf: the value is inf, the gradient unchanged (finite)
        loss, st = real(*args, **kwargs)
        return loss + float("inf"), {**st, "loss": float("inf")}

    monkeypatch.setattr(update_module, "policy_loss", loss_with_an_infinite_constant)
    stats, unchanged, _ = _run_update(tiny)
    assert stats["skipped_steps"] == 1.0
    assert unchanged


def test_a_non_finite_gradient_skips_the_step_even_when_the_loss_is_finite(tiny, monkeypatch):
    real_init = Policy.__init__

    def init_with_an_infinite_gradient(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        next(iter(self.parameters())).register_hook(lambda g: torch.full_like(g, float("inf")))

    monkeypatch.setattr(Policy, "__init__", init_with_an_infinite_gradient)
    stats, unchanged, _ = _run_update(tiny)
    assert stats["skipped_steps"] == 1.0
    assert unchanged


def test_old_logprobs_across_steps_are_taken_at_the_sampling_temperature(tiny):
    model, tok = tiny
    pol = Policy("p", copy.deepcopy(model), None, lr=1e-2, weight_decay=0.0)
    temperature = 0.5
    samples = [Sample(role="a", policy="p", problem_id=0, prompt_ids=[256, 30 + i], completion_ids=[40 + i, 41, 42],
                      sampling_logprobs=[], temperature=temperature) for i in range(2)]
    got = update_module.policy_logprobs(pol, samples, UpdateParams(loss=LossConfig()), tok.pad_token_id)
    with torch.no_grad(), pol.active() as m:
        for s, lp in zip(samples, got):
            p, c = s.prompt_ids, s.completion_ids
            logits = m(torch.tensor([p + c])).logits[0, len(p) - 1:-1].float() / temperature
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c).unsqueeze(1)).squeeze(1)
            assert torch.allclose(lp, expected, atol=1e-4), (lp, expected)


def test_the_second_of_two_steps_clips_against_the_sampling_policy(tiny):
    model, tok = tiny
    eos = tok.eos_token_id
    pol = Policy("p", copy.deepcopy(model), None, lr=1.0, weight_decay=0.0)
    pol.optimizer = torch.optim.SGD(pol.parameters(), lr=1.0)  # a big first step
    samples = [Sample(role="a", policy="p", problem_id=0, prompt_ids=[256, 30 + i], completion_ids=[40 + i, 41, eos],
                      sampling_logprobs=[], advantage=a) for i, a in enumerate([1.0, -1.0, 1.0, -1.0])]
    settings = UpdateParams(loss=LossConfig(eps_low=0.01, eps_high=0.01), max_grad_norm=1e9)
    first, second = update_module.update_policy_steps(pol, [samples, samples], settings, tok.pad_token_id, [eos])
    assert first["clip_frac"] == 0.0  # the weights that sampled: ratio 1
    # against the sampling weights, after one big step, ratios leave [0.99, 1.01]; against the current ones they are 1
    assert second["clip_frac"] > 0.05, second["clip_frac"]
