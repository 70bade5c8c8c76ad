import os

# Tests never reach a model hub, and one thread keeps them deterministic and polite on 2 cores.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import contextlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def tiny():
    """(model, tokenizer) of the tiny-random alias."""
    from teamrl.policies.models import load_model

    return load_model("tiny-random", seed=0)


@pytest.fixture
def tiny_engine(tiny):
    from teamrl.rollout.hf_engine import HFEngine

    model, tok = tiny
    return HFEngine(lambda policy: contextlib.nullcontext(model), tok)
