"""Old log-probs are the sampling policy's: several optimizer steps on one policy in one iteration
(policy.equalize_steps false) clip against the weights that sampled; post-EOS tokens carry no loss
through update_policy itself."""

from __future__ import annotations

import copy
import itertools

import torch

from teamrl.core.sample import Sample
from teamrl.losses import LossConfig
from teamrl.policies.policy import Policy
from teamrl.trainer.update import UpdateParams, update_policy


def _sgd_policy(model) -> Policy:
    pol = Policy("p", copy.deepcopy(model), None, lr=1.0, weight_decay=0.0)
    pol.optimizer = torch.optim.SGD(pol.parameters(), lr=1.0)  # the step equals the gradient
    return pol


def _delta(pol: Policy, before: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(b - p.detach()).flatten() for b, p in zip(before, pol.parameters())])


def test_post_eos_tokens_carry_no_loss_through_update_policy(tiny) -> None:
    """Fails if update_policy masks with the padding mask instead of the post-EOS completion mask."""
    model, tok = tiny
    eos = tok.eos_token_id

    def run(completions: list[list[int]]) -> tuple[torch.Tensor, dict[str, float]]:
        samples = [Sample(role="a", policy="p", problem_id=0, prompt_ids=[256, 30 + i], completion_ids=c,
                          sampling_logprobs=[], advantage=a) for i, (c, a) in enumerate(zip(completions, [1.0, -0.5]))]
        pol = _sgd_policy(model)
        before = [p.detach().clone() for p in pol.parameters()]
        stats = update_policy(pol, samples, UpdateParams(loss=LossConfig(), max_grad_norm=1e9), tok.pad_token_id, [eos])
        return _delta(pol, before), stats

    clean, clean_stats = run([[40, 41, eos], [42, eos]])
    # ignore_eos-style completions: tokens generated after the first EOS (and a second EOS)
    tail, tail_stats = run([[40, 41, eos, 43, 44, eos, 45], [42, eos, 46, 47]])
    assert clean.abs().sum() > 0
    assert tail_stats["tokens"] == clean_stats["tokens"] == 5.0
    torch.testing.assert_close(tail, clean, rtol=1e-4, atol=1e-6)


def _cfg(tmp_path, *extra):
    from teamrl.core.config import load_config

    return load_config(None, ["name=ip", f"run.dir={tmp_path}", "model=tiny-random", "task.name=math.solve",
                              "task.num_problems=12", "task.test_size=3", "workflow.name=voting", "rollout.group_size=2",
                              "rollout.batch_size=1", "rollout.max_new_tokens=4", "run.progress=false",
                              "run.tensorboard=false", "run.log_episodes=false", *extra])


def test_steps_after_the_first_clip_against_the_sampling_policy(tmp_path, monkeypatch) -> None:
    """Three generator instances step one shared generator adapter three times: the second and third
    steps' ratios are measured against the weights that sampled, so the clip engages."""
    from teamrl.trainer.trainer import Trainer

    assign = Trainer._assign_advantages

    def opposite_advantages(self, samples):  # a random model is never right: give each role's pair +1 / -1
        train = assign(self, samples)
        for s, a in zip(train, itertools.cycle([1.0, -1.0])):
            s.advantage = a
        return train

    monkeypatch.setattr(Trainer, "_assign_advantages", opposite_advantages)
    tr = Trainer(_cfg(tmp_path, "policy.mode=lora_per_role", "policy.equalize_steps=false", "train.lr=0.5",
                      "train.loss.eps_low=0.01", "train.loss.eps_high=0.01", "train.max_grad_norm=100"))
    rec = tr.train_step()
    assert rec["optimizer_steps/generator"] == 3
    # the record holds the last (third) step's statistics: against the sampling weights, after two big
    # steps, many ratios are outside [0.99, 1.01]; against the current weights every ratio would be 1
    assert rec["clip_frac/generator"] > 0.05, rec["clip_frac/generator"]


def test_update_policy_uses_given_old_logprobs(tiny) -> None:
    """Given the sampling policy's log-probs, the first step's ratio is measured against them."""
    from teamrl.trainer.update import policy_logprobs

    model, tok = tiny
    eos = tok.eos_token_id
    samples = [Sample(role="a", policy="p", problem_id=0, prompt_ids=[256, 30 + i], completion_ids=[40 + i, 41, eos],
                      sampling_logprobs=[], advantage=a) for i, a in enumerate([1.0, -1.0, 1.0, -1.0])]
    pol = _sgd_policy(model)
    settings = UpdateParams(loss=LossConfig(eps_low=0.01, eps_high=0.01), max_grad_norm=1e9)
    old = policy_logprobs(pol, samples, settings, tok.pad_token_id)
    assert [len(o) for o in old] == [3, 3, 3, 3]
    same = update_policy(_sgd_policy(model), samples, settings, tok.pad_token_id, [eos], old_logprobs=old)
    assert same["clip_frac"] == 0.0  # the weights that sampled: ratio 1
    shifted = [o - 0.5 * torch.tensor([1.0 if s.advantage > 0 else -1.0]) for o, s in zip(old, samples)]
    moved = update_policy(_sgd_policy(model), samples, settings, tok.pad_token_id, [eos], old_logprobs=shifted)
    assert moved["clip_frac"] == 1.0  # every ratio is e^{+-0.5} on the side the clip cuts
