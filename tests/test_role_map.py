"""Role -> policy routing: a declared role keeps its own policy; only numbered instances of a
declared role (``generator0`` of ``generator``) share it; an explicit ``policy.roles`` map wins."""

from __future__ import annotations

import pytest

from teamrl.core.config import LoraConfig
from teamrl.policies.router import PolicyRouter, declared_role

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
