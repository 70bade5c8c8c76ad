"""Decode attention that reads each sampled prompt's keys/values once (teamrl/rollout/prefix_attention.py)."""

import types

import torch
import torch.nn.functional as F

from teamrl.policies.chat import encode_chat
from teamrl.policies.logprobs import build_token_batch, completion_logprobs
from teamrl.rollout import hf_engine
from teamrl.rollout.engine import GenerationRequest, SamplingParams
from teamrl.rollout.hf_engine import HFEngine
from teamrl.rollout.prefix_attention import SharedPrompts, shared_prompt_attention, supports_shared_prompts


def test_shared_prompt_attention_equals_sdpa_over_copied_prompt_keys():
    gen = torch.Generator().manual_seed(0)
    prompts, q_heads, kv_heads, dim, plen, gen_len = 3, 4, 2, 8, 7, 5
    row_prompt = [0, 1, 0, 2, 1, 1]  # unequal rows per prompt, not contiguous
    rows = len(row_prompt)
    pk, pv = torch.randn(prompts, kv_heads, plen, dim, generator=gen), torch.randn(prompts, kv_heads, plen, dim, generator=gen)
    valid = torch.ones(prompts, plen, dtype=torch.bool)
    valid[1, :3] = False  # left padding
    valid[2, :6] = False
    pk.masked_fill_(~valid[:, None, :, None], 1e4)  # garbage under the padding must not leak in
    q = torch.randn(rows, q_heads, 1, dim, generator=gen)
    gk, gv = torch.randn(rows, kv_heads, gen_len, dim, generator=gen), torch.randn(rows, kv_heads, gen_len, dim, generator=gen)
    slots, seen = [], [0] * prompts
    for u in row_prompt:
        slots.append(seen[u])
        seen[u] += 1
    state = SharedPrompts([pk], [pv], valid, torch.tensor([u * max(seen) + s for u, s in zip(row_prompt, slots)]), max(seen))
    got, _ = shared_prompt_attention(types.SimpleNamespace(layer_idx=0), q, gk, gv, None, scaling=0.3, shared_prompts=state)

    idx = torch.tensor(row_prompt)
    keys = torch.cat([pk[idx], gk], dim=2).repeat_interleave(q_heads // kv_heads, dim=1)
    values = torch.cat([pv[idx], gv], dim=2).repeat_interleave(q_heads // kv_heads, dim=1)
    mask = torch.cat([valid[idx], torch.ones(rows, gen_len, dtype=torch.bool)], dim=1)[:, None, None, :]
    want = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=0.3).transpose(1, 2)
    assert got.shape == want.shape == (rows, 1, q_heads, dim)
    assert torch.allclose(got, want, atol=1e-5)


def _requests(tok):
    # prompts of different lengths, each sampled 3 times, rows stopping at different lengths
    return [GenerationRequest(encode_chat(tok, "word " * k), SamplingParams(max_new_tokens=t, temperature=0.8), n=3)
            for k, t in ((1, 9), (6, 4), (13, 12))]


def test_engine_reads_shared_prompts_and_samples_as_with_copied_prompts(tiny, monkeypatch):
    model, tok = tiny
    engine = HFEngine(lambda policy: __import__("contextlib").nullcontext(model), tok)
    calls = []
    inner = HFEngine._shared_prompts
    monkeypatch.setattr(HFEngine, "_shared_prompts", staticmethod(lambda *a: calls.append(1) or inner(*a)))
    shared = engine.generate("p", _requests(tok), seed=5)
    assert calls == [1]  # the shared-prompt path ran
    assert model.config._attn_implementation == "sdpa"  # and gave the model its attention back
    monkeypatch.setattr(hf_engine, "supports_shared_prompts", lambda model: False)
    copied = engine.generate("p", _requests(tok), seed=5)
    assert calls == [1]
    for a_req, b_req in zip(shared, copied):
        for a, b in zip(a_req, b_req):
            assert a.token_ids == b.token_ids
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    assert len({len(c.token_ids) for r in shared for c in r}) > 1


def test_shared_prompt_sampling_logprobs_equal_the_trainers(tiny):
    model, tok = tiny
    engine = HFEngine(lambda policy: __import__("contextlib").nullcontext(model), tok)
    reqs = _requests(tok)
    out = engine.generate("p", reqs, seed=9)
    flat = [(q.prompt_ids, c) for q, r in zip(reqs, out) for c in r]
    batch = build_token_batch([p for p, _ in flat], [c.token_ids for _, c in flat], tok.pad_token_id)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, batch, 0.8)
    for i, (_, c) in enumerate(flat):
        assert torch.allclose(lp[i, :len(c.logprobs)], torch.tensor(c.logprobs), atol=1e-4)


def test_models_without_plain_causal_attention_keep_copied_prompts(tiny):
    model, _ = tiny
    assert supports_shared_prompts(model)
    windowed = types.SimpleNamespace(config=types.SimpleNamespace(model_type="mistral", _attn_implementation="sdpa",
                                                                  sliding_window=4096, use_sliding_window=True))
    assert not supports_shared_prompts(windowed)
    other = types.SimpleNamespace(config=types.SimpleNamespace(model_type="gemma2", _attn_implementation="sdpa"))
    assert not supports_shared_prompts(other)
