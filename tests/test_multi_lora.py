"""One base, many adapters, one batch: per-row LoRA adapters in the engine and the model."""

import pytest
import torch

from teamrl.core.config import LoraConfig
from teamrl.policies.chat import encode_chat
from teamrl.policies.logprobs import build_token_batch, completion_logprobs
from teamrl.policies.multi_lora import RowAdapterModel, SharedBaseAdapters
from teamrl.policies.router import PolicyRouter
from teamrl.rollout.engine import GenerationRequest, SamplingParams
from teamrl.rollout.hf_engine import HFEngine
from teamrl.rollout.scheduler import GenerationScheduler

LORA = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])


def _router(roles=("planner", "coder")):
    router = PolicyRouter("lora_per_role", list(roles), "tiny-random", LORA, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # PEFT starts lora_B at zero; give every adapter its own visible weights
        for pol in router.policies.values():
            for p in pol.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return router


def _requests(tok, words, tokens=(10, 7)):
    # prompts of very different lengths (grouped prefill) and different lengths to generate (rows leave the batch)
    return [GenerationRequest(encode_chat(tok, f"{w} " * k), SamplingParams(max_new_tokens=t), n=2)
            for (w, k), t in zip(words, tokens)]


def _separate_engine(router):
    # the reference: each policy alone, through PEFT's own forward with its adapter active
    return HFEngine(lambda name: router.policies[name].active(), router.tokenizer)


def _joint_engine(router):
    return HFEngine(lambda name: router.policies[name].generation_model(), router.tokenizer,
                    row_models=SharedBaseAdapters(router.policies))


def test_one_batch_equals_separate_decodes_with_the_same_seeds(monkeypatch):
    router = _router()
    tok = router.tokenizer
    reqs = {"planner": _requests(tok, [("plan", 1), ("plan", 30)]), "coder": _requests(tok, [("code", 2), ("code", 31)], (5, 12))}
    seeds = {"planner": 11, "coder": 12}
    separate = {name: _separate_engine(router).generate(name, r, seed=seeds[name]) for name, r in reqs.items()}
    engine = _joint_engine(router)
    decodes = []
    inner = engine._decode
    monkeypatch.setattr(engine, "_decode", lambda *a, **k: decodes.append(1) or inner(*a, **k))
    joint = engine.generate_many([(name, r, seeds[name]) for name, r in reqs.items()])
    assert len(decodes) == 1  # both policies in one decode batch
    for (name, _), got in zip(reqs.items(), joint):
        for want_req, got_req in zip(separate[name], got):
            for want, c in zip(want_req, got_req):
                assert c.token_ids == want.token_ids, name
                assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(want.logprobs), atol=1e-5)
    lengths = [len(c.token_ids) for r in joint for q in r for c in q]
    assert len(set(lengths)) > 1  # rows left the batch at different steps
    # no merged copy of the base was made for either policy
    assert all(pol._merged is None for pol in router.policies.values())


def test_joint_sampling_logprobs_equal_the_trainers_logprobs():
    router = _router()
    tok = router.tokenizer
    reqs = {"planner": _requests(tok, [("a", 3), ("b", 9)]), "coder": _requests(tok, [("c", 4), ("d", 20)])}
    for temperature in (1.0, 0.7):
        params = SamplingParams(max_new_tokens=8, temperature=temperature)
        calls = [(n, [GenerationRequest(q.prompt_ids, params, n=2) for q in r], 5) for n, r in reqs.items()]
        out = _joint_engine(router).generate_many(calls)
        for (name, rq, _), res in zip(calls, out):
            flat = [(q.prompt_ids, c) for q, cs in zip(rq, res) for c in cs]
            batch = build_token_batch([p for p, _ in flat], [c.token_ids for _, c in flat], tok.pad_token_id)
            with torch.no_grad(), router.policies[name].active() as model:
                lp, _ = completion_logprobs(model, batch, temperature)
            for i, (_, c) in enumerate(flat):
                assert torch.allclose(lp[i, :len(c.logprobs)], torch.tensor(c.logprobs), atol=1e-4)


def test_gradients_of_one_adapters_rows_reach_only_that_adapter():
    router = _router()
    planner, coder = router.policies["planner"], router.policies["coder"]
    ids = torch.tensor([[256, 70, 71, 72], [256, 80, 81, 82], [256, 90, 91, 92]])
    rows = torch.tensor([0, 0, 1])  # rows 0-1: planner, row 2: coder
    with RowAdapterModel(planner.model, ["planner", "coder"]) as rm:
        rm.select(rows)
        logits = rm.model(input_ids=ids).logits
    logits[:2].square().mean().backward()  # a loss on the planner's rows only
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in planner.parameters())
    assert all(p.grad is None or not p.grad.any() for p in coder.parameters())
    got = [p.grad.clone() for p in planner.parameters()]
    planner.optimizer.zero_grad(set_to_none=True)
    coder.optimizer.zero_grad(set_to_none=True)
    with planner.active() as model:  # the same rows through PEFT with the planner active
        ref = model(input_ids=ids[:2]).logits
    assert torch.allclose(logits[:2], ref, atol=1e-5)
    ref.square().mean().backward()
    for g, p in zip(got, planner.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-6)
    # outside the context the model is the ordinary PEFT model again
    with coder.active() as model:
        assert torch.allclose(model(input_ids=ids[2:]).logits, logits[2:], atol=1e-5)


def test_rows_in_any_order():
    router = _router()
    ids = torch.tensor([[256, 70, 71], [256, 80, 81], [256, 90, 91]])
    with RowAdapterModel(router.policies["planner"].model, ["planner", "coder"]) as rm, torch.no_grad():
        rm.select(torch.tensor([1, 0, 1]))
        mixed = rm.model(input_ids=ids).logits
        rm.select(torch.tensor([0, 1, 1]))
        sorted_rows = rm.model(input_ids=ids[[1, 0, 2]]).logits
    assert torch.allclose(mixed[[1, 0, 2]], sorted_rows, atol=1e-5)


def test_scheduler_flush_decodes_every_policy_on_a_shared_base_in_one_batch(monkeypatch):
    router = _router(("planner", "coder", "reviewer"))
    tok = router.tokenizer
    engine = _joint_engine(router)
    decodes = []
    inner = engine._decode
    monkeypatch.setattr(engine, "_decode", lambda model, reqs, *a: decodes.append(len(reqs)) or inner(model, reqs, *a))
    sched = GenerationScheduler(engine, seed=0)
    params = SamplingParams(max_new_tokens=3)

    async def episode(i):
        import asyncio

        return await asyncio.gather(*[sched.generate(r, GenerationRequest(encode_chat(tok, f"{r} {i}"), params))
                                      for r in ("planner", "coder", "reviewer")])

    sched.run([episode(i) for i in range(2)])
    assert decodes == [6]
    assert sched.calls == [("planner", 2), ("coder", 2), ("reviewer", 2)]


def test_a_lone_lora_policy_keeps_its_merged_copy():
    router = PolicyRouter("shared", ["planner", "coder"], "tiny-random", LORA, lr=1e-2)
    assert SharedBaseAdapters(router.policies).base_of("shared") is None


def test_bad_row_selection_is_named():
    router = _router()
    rm = RowAdapterModel(router.policies["planner"].model, ["planner", "coder"])
    with pytest.raises(IndexError, match="2 adapters"):
        rm.select(torch.tensor([0, 2]))
    with pytest.raises(KeyError, match="nope"):
        RowAdapterModel(router.policies["planner"].model, ["nope"])


def test_adapters_of_different_ranks_and_targets_in_one_batch_equal_peft():
    # the fused per-row forward puts the adapters' ranks side by side: ranks that differ, and an
    # adapter that leaves a layer out, must still give each row exactly its own adapter's output
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from teamrl.policies.models import load_model

    base, _ = load_model("tiny-random", seed=0)
    model = get_peft_model(base, PeftLoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "up_proj"]), adapter_name="first")
    model.add_adapter("second", PeftLoraConfig(r=5, lora_alpha=3, target_modules=["q_proj", "down_proj"]))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.eval()
    ids = torch.tensor([[256, 70, 71, 72], [256, 80, 81, 82], [256, 90, 91, 92]])
    want = []
    with torch.no_grad():
        for row, adapter in zip(ids, ["second", "first", "second"]):
            model.set_adapter(adapter)
            want.append(model(input_ids=row[None]).logits[0])
        model.set_adapter("first")
        row0_with_a = model(input_ids=ids[:1]).logits[0]
        with RowAdapterModel(model, ["first", "second"]) as rm:
            rm.select(torch.tensor([1, 0, 1]))
            got = rm.model(input_ids=ids).logits
    assert torch.allclose(got, torch.stack(want), atol=1e-5)
    assert not torch.allclose(want[0], row0_with_a, atol=1e-3)  # the adapters do differ
