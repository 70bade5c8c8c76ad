import pytest
import torch

from teamrl.core.config import LoraConfig
from teamrl.core.sample import Sample
from teamrl.losses import LossConfig
from teamrl.policies.chat import encode_chat
from teamrl.policies.logprobs import build_token_batch, completion_logprobs
from teamrl.policies.router import PolicyRouter, role_type
from teamrl.trainer.update import UpdateParams, update_policy

LORA = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])


def _snapshot(router):
    seen, out = set(), {}
    for pol in router.policies.values():
        for n, p in pol.model.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out[f"{pol.name}:{n}"] = p.detach().clone()
    return out


def _samples(router, role, n=4):
    tok = router.tokenizer
    policy = router.policy_name(role)
    out = []
    for i in range(n):
        out.append(Sample(role=role, policy=policy, problem_id=i // 2, prompt_ids=encode_chat(tok, f"task {i}"),
                          completion_ids=[70 + i, 71, 72, tok.eos_token_id], sampling_logprobs=[0.0] * 4,
                          advantage=1.0 if i % 2 else -1.0))
    return out


def _update(router, role):
    settings = UpdateParams(loss=LossConfig(), micro_batch_size=2)
    pol = router.policy_for(role)
    return update_policy(pol, _samples(router, role), settings, router.tokenizer.pad_token_id, [router.tokenizer.eos_token_id])


def test_role_types_strip_instance_numbers():
    assert [role_type(r) for r in ("generator0", "generator12", "worker_2", "coder", "agent-1")] == ["generator", "generator", "worker", "coder", "agent"]


def test_lora_per_role_update_changes_only_its_own_adapter():
    router = PolicyRouter("lora_per_role", ["planner", "coder", "generator"], "tiny-random", LORA, lr=1e-2)
    assert sorted(router.policies) == ["coder", "generator", "planner"]
    assert router.policy_name("generator1") == router.policy_name("generator0") == "generator"
    before = _snapshot(router)
    stats = _update(router, "coder")
    assert stats["grad_norm"] > 0
    after = _snapshot(router)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "the coder adapter did not move"
    assert all(".coder." in k and "lora_" in k for k in changed), sorted(changed)[:5]
    # and every planner / generator / base weight is bit-identical
    assert all(torch.equal(before[k], after[k]) for k in before if ".coder." not in k)


def test_separate_models_update_in_isolation():
    router = PolicyRouter("separate", ["planner", "coder"], "tiny-random", None, lr=1e-2)
    assert router.policies["planner"].model is not router.policies["coder"].model
    before = _snapshot(router)
    _update(router, "planner")
    after = _snapshot(router)
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("planner:"))
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("coder:"))


def test_shared_policy_moves_one_set_for_every_role():
    router = PolicyRouter("shared", ["planner", "coder"], "tiny-random", LORA, lr=1e-2)
    assert router.policy_for("planner") is router.policy_for("coder")
    before = _snapshot(router)
    _update(router, "coder")
    after = _snapshot(router)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)


def test_update_refuses_another_policys_samples():
    router = PolicyRouter("lora_per_role", ["planner", "coder"], "tiny-random", LORA, lr=1e-2)
    with pytest.raises(ValueError, match="given samples of"):
        update_policy(router.policies["planner"], _samples(router, "coder"), UpdateParams(loss=LossConfig()), 0, [0])


def test_lora_reference_is_the_base_with_adapters_disabled():
    router = PolicyRouter("lora_per_role", ["planner", "coder"], "tiny-random", LORA, lr=5e-2, need_reference=True)
    pol = router.policies["planner"]
    assert pol.reference_model is None  # no second copy of the model
    for _ in range(3):
        _update(router, "planner")
    from teamrl.policies.models import load_model

    base, tok = load_model("tiny-random", seed=0)
    samples = _samples(router, "planner")
    batch = build_token_batch([s.prompt_ids for s in samples], [s.completion_ids for s in samples], tok.pad_token_id)
    with torch.no_grad():
        expected, _ = completion_logprobs(base, batch)
        with pol.reference() as ref:
            got, _ = completion_logprobs(ref, batch)
        with pol.active() as m:
            trained, _ = completion_logprobs(m, batch)
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(trained, expected, atol=1e-3)  # the adapter did learn something


def test_full_weight_reference_is_a_frozen_copy_only_when_asked():
    r1 = PolicyRouter("shared", ["a"], "tiny-random", None, lr=1e-2)
    assert r1.policies["shared"].reference_model is None
    with pytest.raises(RuntimeError, match="kl_coef"):
        with r1.policies["shared"].reference():
            pass
    r2 = PolicyRouter("shared", ["a"], "tiny-random", None, lr=1e-2, need_reference=True)
    before = next(r2.policies["shared"].reference_model.parameters()).clone()
    _update(r2, "a")
    assert torch.equal(before, next(r2.policies["shared"].reference_model.parameters()))


def test_unknown_role_is_named():
    router = PolicyRouter("lora_per_role", ["planner"], "tiny-random", LORA, lr=1e-2)
    with pytest.raises(KeyError, match="coder"):
        router.policy_for("coder")


def test_generation_model_is_the_merged_adapter_and_follows_updates():
    router = PolicyRouter("lora_per_role", ["planner", "coder"], "tiny-random", LORA, lr=5e-2)
    ids = torch.tensor([[256, 70, 71, 72, 73]])
    for _ in range(2):  # the copy is refreshed after each update
        _update(router, "planner")
        for name in ("planner", "coder"):
            pol = router.policies[name]
            with torch.no_grad(), pol.active() as m:
                expected = m(ids).logits
            with torch.no_grad(), pol.generation_model() as g:
                got = g(ids).logits
                assert not hasattr(g, "peft_config")  # a plain model: no adapter overhead when sampling
            assert torch.allclose(expected, got, atol=1e-5)
    with torch.no_grad(), router.policies["planner"].generation_model() as g1, router.policies["coder"].generation_model() as g2:
        assert not torch.allclose(g1(ids).logits, g2(ids).logits, atol=1e-4)  # each policy samples with its own weights
