"""Role -> policy routing: a declared role keeps its own policy; only numbered instances of a
declared role (``generator0`` of ``generator``) share it; an explicit ``policy.roles`` map wins."""

from __future__ import annotations

import copy

import pytest

from teamrl.core.config import LoraConfig
from teamrl.core.sample import Sample
from teamrl.losses import LossConfig
from teamrl.policies.policy import Policy
from teamrl.policies.router import PolicyRouter, declared_role
from teamrl.trainer.update import UpdateParams, update_policy

LORA = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])


def test_a_declared_role_ending_in_a_number_keeps_its_own_policy():
    router = PolicyRouter("lora_per_role", ["critic", "critic2", "gpt4"], "tiny-random", LORA, lr=1e-2)
    assert sorted(router.policies) == ["critic", "critic2", "gpt4"]
    assert [router.policy_name(r) for r in ("critic", "critic2", "gpt4")] == ["critic", "critic2", "gpt4"]


def test_numbered_instances_of_a_declared_role_share_its_policy_and_others_are_refused():
    router = PolicyRouter("lora_per_role", ["generator", "aggregator"], "tiny-random", LORA, lr=1e-2)
    assert sorted(router.policies) == ["aggregator", "generator"]
    assert [router.policy_name(r) for r in ("generator0", "generator_12", "generator-1")] == ["generator"] * 3
    with pytest.raises(KeyError, match=r"role 'judge' is not declared.*\['aggregator', 'generator'\]"):
        router.policy_name("judge")
    with pytest.raises(KeyError, match="role 'aggregatorX1'"):
        router.policy_name("aggregatorX1")


def test_declared_role_is_the_name_itself_before_any_instance_rule():
    assert declared_role("gpt4", ("gpt", "gpt4")) == "gpt4"
    assert declared_role("gpt4", ("gpt",)) == "gpt"  # gpt4 is a numbered instance of the declared gpt
    assert declared_role("worker_3", ("worker",)) == "worker"
    with pytest.raises(KeyError, match=r"declared roles are \['gpt'\]"):
        declared_role("critic2", ("gpt",))


def test_an_explicit_map_may_join_declared_roles_and_instances_follow_their_type():
    router = PolicyRouter("lora_per_role", ["critic", "critic2", "judge"], "tiny-random", LORA, lr=1e-2,
                          role_map={"critic": "critic", "critic2": "critic", "judge": "judge"})
    assert sorted(router.policies) == ["critic", "judge"]
    assert [router.policy_name(r) for r in ("critic2", "judge0", "critic2_1")] == ["critic", "judge", "critic"]


def _stat_samples(tok, role: str, advs: list[float], offset: int) -> list[Sample]:
    return [Sample(role=role, policy="p", problem_id=0, prompt_ids=[256, 40 + offset, 41 + i], sampling_logprobs=[],
                   completion_ids=[60 + offset + i] * 2 + [tok.eos_token_id], advantage=a) for i, a in enumerate(advs)]


def test_role_statistics_keep_a_declared_critic2_apart_and_fold_instances(tiny):
    model, tok = tiny
    samples = (_stat_samples(tok, "critic", [1.0, -1.0], 0) + _stat_samples(tok, "critic2", [0.5, -0.5], 3)
               + _stat_samples(tok, "judge0", [0.2, -0.2], 6))
    pol = Policy("p", copy.deepcopy(model), None, lr=1e-3, weight_decay=0.0)
    stats = update_policy(pol, samples, UpdateParams(loss=LossConfig(), role_grad_norms=True, roles=("critic", "critic2", "judge")),
                          tok.pad_token_id, [tok.eos_token_id])
    assert sorted(k for k in stats if k.startswith("tokens@")) == ["tokens@critic", "tokens@critic2", "tokens@judge"]


def test_trainer_role_metrics_are_per_declared_role():
    samples = [Sample(role=r, policy=r.rstrip("0"), problem_id=0, prompt_ids=[1], completion_ids=[2] * n, sampling_logprobs=[],
                      reward=rw) for r, n, rw in (("critic", 1, 1.0), ("critic2", 3, 0.0), ("judge0", 2, 0.5))]
    from teamrl.trainer.step_metrics import role_metrics

    out = role_metrics(samples, ["critic", "critic2", "judge"], {}, {}, route=lambda r: "shared", shared=True)
    assert out == {"reward/critic": 1.0, "completion_len/critic": 1.0, "reward/critic2": 0.0, "completion_len/critic2": 3.0,
                   "reward/judge": 0.5, "completion_len/judge": 2.0}
