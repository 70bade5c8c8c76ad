"""Device and dtype placement: auto is CPU/fp32 without a GPU, CUDA asked for without one fails clearly."""

import pytest
import torch

from teamrl.core.config import ConfigError, load_config
from teamrl.policies.models import load_model, resolve_device

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without a GPU")


@no_gpu
def test_auto_is_cpu_fp32_without_a_gpu():
    assert resolve_device("auto", "auto") == (torch.device("cpu"), torch.float32)
    assert resolve_device("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)


@no_gpu
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="'cuda' was asked for, but torch sees no CUDA GPU"):
        resolve_device("cuda", "auto")
    with pytest.raises(ConfigError, match="policy.device: 'cuda', but torch sees no CUDA GPU"):
        load_config(None, ["policy.device=cuda"])


def test_bad_device_and_dtype_are_named():
    with pytest.raises(ValueError, match="device 'tpu'"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="dtype 'int8'"):
        resolve_device("cpu", "int8")
    with pytest.raises(ConfigError, match="policy.device: 'tpu'"):
        load_config(None, ["policy.device=tpu"])
    with pytest.raises(ConfigError, match="policy.dtype"):
        load_config(None, ["policy.dtype=int8"])


def test_bf16_policy_trains_and_samples_on_cpu(tmp_path):
    # The dtype plumbing of the GPU path (bf16 base, LoRA, engine, update), exercised on the CPU.
    from teamrl.trainer.trainer import Trainer

    t = Trainer(load_config(None, ["model=tiny-random", "threads=1", "rollout.max_new_tokens=12", "rollout.batch_size=2",
                                   "rollout.group_size=4", "run.progress=false", "run.tensorboard=false", "train.lr=1e-2",
                                   "policy.lora.r=4", "policy.dtype=bfloat16", "train.steps=1", f"run.dir={tmp_path}"]))
    pol = t.router.policies["shared"]
    assert pol.model.get_input_embeddings().weight.dtype == torch.bfloat16
    before = [p.detach().clone() for p in pol.parameters()]
    rec = t.train_step()
    assert rec["rollout_tokens_per_s"] > 0 and rec["grad_norm/shared"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, pol.parameters()))


def test_random_shapes_match_the_real_models():
    # Built on the meta device: the shapes without the memory.
    m, tok = load_model("random:smollm2-135m", device="meta")
    assert sum(p.numel() for p in m.parameters()) == 134_515_008  # SmolLM2-135M's parameter count
    assert m.config.vocab_size == 49152 and len(tok) < m.config.vocab_size
    q, _ = load_model("random:qwen3-1.7b", dtype=torch.bfloat16, device="meta")
    assert type(q).__name__ == "Qwen3ForCausalLM" and q.config.head_dim == 128 and q.config.tie_word_embeddings
    assert 1.6e9 < sum(p.numel() for p in q.parameters()) < 1.8e9 and q.dtype == torch.bfloat16


def test_qwen3_architecture_samples_and_scores_like_the_trainer():
    # gpu_check's second shape is a Qwen3 model: a tiny one runs the same engine and log-prob code here.
    import contextlib

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from teamrl.policies.chat import encode_chat
    from teamrl.policies.logprobs import build_token_batch, completion_logprobs
    from teamrl.policies.models import byte_tokenizer
    from teamrl.rollout.engine import GenerationRequest, SamplingParams
    from teamrl.rollout.hf_engine import HFEngine

    tok = byte_tokenizer()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=32, intermediate_size=128, tie_word_embeddings=True,
                                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).eval()
    engine = HFEngine(lambda _: contextlib.nullcontext(model), tok)
    prompts = [encode_chat(tok, "word " * (i + 1)) for i in range(3)]  # different lengths: left padding
    greedy = engine.generate("q", [GenerationRequest(p, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)) for p in prompts])
    for p, (c,) in zip(prompts, greedy):
        ref = model.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        assert c.token_ids == ref[0, len(p):].tolist()
    out = engine.generate("q", [GenerationRequest(p, SamplingParams(max_new_tokens=8, temperature=0.7), n=2) for p in prompts], seed=1)
    flat = [(p, c) for p, r in zip(prompts, out) for c in r]
    batch = build_token_batch([p for p, _ in flat], [c.token_ids for _, c in flat], tok.pad_token_id)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, batch, 0.7)
    for i, (_, c) in enumerate(flat):
        assert torch.allclose(lp[i, :len(c.logprobs)], torch.tensor(c.logprobs), atol=1e-4)
