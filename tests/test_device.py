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
