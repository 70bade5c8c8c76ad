"""``teamrl serve``: the in-process engine behind an OpenAI-compatible completions endpoint.

The wire format follows vLLM's OpenAI-compatible server (which SGLang's mirrors), so one client,
:class:`teamrl.rollout.http_engine.HTTPEngine`, talks to all three. Endpoints:

- ``POST /v1/completions``: token ids (or text) in; token ids and per-token log-probs out.
- ``GET /v1/models``: the base model and every loaded LoRA adapter.
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"?}``: load a PEFT
  adapter folder under a name; ``load_inplace: true`` replaces an adapter of that name (a new
  version after an update). ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``. SGLang's
  spellings ``/load_lora_adapter`` and ``/unload_lora_adapter`` are accepted too.
- ``POST /collective_rpc`` ``{"method": "reload_weights", "kwargs": {"weights_path"}}``: the base model's weights
  replaced by those of a model folder (vLLM's full-weight reload, as vLLM serves it in dev mode); ``POST
  /reset_prefix_cache`` answers as vLLM's (teamrl serve caches no keys/values between requests).
- ``GET /health``: 200 once the model is loaded.

With ``strict`` (``teamrl serve --strict vllm|sglang``) it imitates the real server instead, where
that differs from teamrl's behaviour (per-prompt seeding, ``generation_config`` defaults, raw
log-probs, unknown fields ignored, the real LoRA paths and answers): see
:mod:`teamrl.rollout.strict_server`.

The request's ``model`` picks the weights: the served base-model name, or a loaded adapter's
name (in teamrl: a policy, i.e. a role's adapter). Log-probs are teamrl's definition: the
log-prob of each sampled token under ``softmax(logits / temperature)`` before top-k/top-p (under
temperature 1 for greedy requests), the distribution the trainer recomputes. (vLLM and SGLang
return their own definitions; see the README.)

The app is FastAPI on uvicorn (:mod:`teamrl.rollout.asgi`, shared with the training gateway); the
validation of each field stays here, with vLLM's names and teamrl's messages.
Requests are served one at a time by one :class:`HFEngine` (a lock): a request's prompts, each
with ``n`` samples, form one batch. The HTTP engine sends all pending requests of one policy in
one call, so rollouts batch as they do in process.
"""


import contextlib
import copy
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from teamrl.policies.models import load_model, quiet_peft_wrapping, resolve_device
from teamrl.rollout.asgi import (AsgiServer, ConnectionLimits, Guard, RequestError, json_errors, request_number,
                                 require_asgi, short_repr)
from teamrl.rollout.engine import GenerationRequest, SamplingParams
from teamrl.rollout.hf_engine import HFEngine
from teamrl.rollout.strict_server import (
    GENERATION_DEFAULT_FIELDS,
    RowSamplingParams,
    StrictBehaviour,
    decode_row,
    generation_defaults,
)

# Fields of POST /v1/completions that teamrl serve understands (vLLM's names); anything else is a 400.
COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed",
                     "logprobs", "return_tokens_as_token_ids", "return_token_ids", "ignore_eos", "min_tokens",
                     "include_stop_str_in_output", "skip_special_tokens", "stream", "echo", "user")
MAX_BODY_BYTES = 64 * 2**20
MAX_N = 1024             # completions per prompt (teamrl serve --max-n)
MAX_SEQUENCES = 8192     # prompts x n of one request (teamrl serve --max-sequences): one request runs as one batch
MAX_CONNECTIONS = 1024   # open connections (teamrl serve --max-connections; at most half the open-file limit)
# a request's header must arrive within this long (408 after): slow clients hold no socket for good
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 120.0   # its body (up to MAX_BODY_BYTES) within this long of the header
MIN_BODY_RATE = 1024.0   # bytes/s a body must come at when the server is at its cap (teamrl serve --min-body-rate)
SEED_RANGE = (-2**63, 2**63 - 1)  # vLLM's (int64); torch seeds a generator from any of them
# SamplingParams settings whose request field has another name (errors name the field the client sent)
REQUEST_FIELD_OF_SETTING = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


@dataclass
class _Adapter:
    path: str
    version: int
    model: torch.nn.Module


class ModelServer:
    """The state behind the endpoints: one base model, named LoRA adapters, one engine.

    Each adapter is held as a copy of the base with the adapter merged in, the same form the
    in-process engine samples from (:meth:`teamrl.policies.policy.Policy.generation_model`), so a
    served adapter gives the in-process engine's tokens and log-probs for the same weights and seed.
    """

    def __init__(self, model: str, served_name: str | None = None, device: str = "auto", dtype: str = "auto",
                 seed: int = 0, strict: StrictBehaviour | None = None, max_n: int = MAX_N,
                 max_sequences: int = MAX_SEQUENCES) -> None:
        if max_n < 1 or max_sequences < 1:
            raise ValueError(f"max_n={max_n}, max_sequences={max_sequences}: each must be >= 1")
        self.max_n, self.max_sequences = max_n, max_sequences
        self.device, self.dtype = resolve_device(device, dtype)
        self.strict = strict
        self.row_seeds: list[int | None] = []  # strict mode: the seed of every sequence served (for tests)
        self.base, self.tokenizer = load_model(model, dtype=self.dtype, device=self.device, seed=seed)
        self.base.eval().requires_grad_(False)
        self.base_name = served_name or model
        if strict is not None:  # like vLLM's --generation-config auto: the model's own defaults, then the overrides
            defaults, eos_ids = generation_defaults(self.base)
            strict.generation_defaults = {**defaults, **strict.generation_defaults}
            strict.extra_eos_ids = tuple(dict.fromkeys((*eos_ids, *strict.extra_eos_ids)))
        self.adapters: dict[str, _Adapter] = {}
        self.engine = HFEngine(self._model_for, self.tokenizer, device=self.device)
        self.created = int(time.time())
        self._lock = threading.Lock()  # one model: requests run one after another
        self._loads = 0

    # ---- adapters ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _model_for(self, name: str) -> Iterator[torch.nn.Module]:
        yield self.base if name == self.base_name else self.adapters[name].model

    def load_adapter(self, name: str, path: str, load_inplace: bool = False) -> int:
        """Load the PEFT adapter folder ``path`` as ``name``; return its version (1, 2, ... per name)."""
        if not isinstance(name, str) or not name:
            raise RequestError(400, "lora_name: expected a non-empty string", "lora_name")
        if not isinstance(path, str) or not path:
            raise RequestError(400, "lora_path: expected a non-empty string (a PEFT adapter folder)", "lora_path")
        if name == self.base_name:
            raise RequestError(400, f"lora_name: {name!r} is the base model's name; choose another name", "lora_name")
        if name in self.adapters and not load_inplace:
            # vLLM's words (0.32.0, a real server): unload it first, or load_inplace
            raise RequestError(
                400,
                f"The lora adapter {name!r} has already been loaded. If you want to load the adapter in "
                "place, set 'load_inplace' to True.",
                "lora_name",
            )
        folder = Path(path)
        if not (folder / "adapter_config.json").is_file():
            raise RequestError(
                400, f"lora_path: {path!r} is not a PEFT adapter folder (no adapter_config.json in it)", "lora_path"
            )
        from peft import PeftModel

        try:
            with quiet_peft_wrapping():
                peft_model = PeftModel.from_pretrained(copy.deepcopy(self.base), str(folder), adapter_name=name)
            merged = peft_model.merge_and_unload().eval().requires_grad_(False)
        except Exception as e:  # a folder for another base model, a corrupt file, ...
            raise RequestError(
                400,
                f"lora_path: {path!r} did not load onto base model {self.base_name!r}: {type(e).__name__}: {e}",
                "lora_path",
            ) from e
        version = self.adapters[name].version + 1 if name in self.adapters else 1
        self.adapters[name] = _Adapter(str(folder), version, merged)
        return version

    def unload_adapter(self, name: str) -> None:
        """Forget the adapter ``name``."""
        if name not in self.adapters:
            raise RequestError(
                404, f"The lora adapter {name!r} is not loaded; loaded adapters: {sorted(self.adapters)}", "lora_name"
            )
        del self.adapters[name]

    def reload_weights(self, path: Any) -> None:
        """Replace the base model's weights in place with those of the model folder ``path`` (safetensors, the
        names the model has; a tied output embedding may be left out): vLLM's ``reload_weights``."""
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors")) if isinstance(path, str) and path else []
        if not files:
            raise RequestError(400, f"weights_path: {path!r} is not a folder holding *.safetensors", "weights_path")
        if self.adapters:  # they are merged into copies of the old weights
            raise RequestError(400, f"reload_weights: unload the adapters first ({sorted(self.adapters)})")
        try:
            state = {k: v for f in files for k, v in load_file(str(f)).items()}
        except Exception as e:  # a corrupt or truncated file: the same 400 as /v1/load_lora_adapter's
            raise RequestError(400, f"weights_path: {path!r} did not load: {type(e).__name__}: "
                               f"{' '.join(str(e).split())[:200]}", "weights_path") from e
        own = dict(self.base.named_parameters(remove_duplicate=False))
        unknown, missing = sorted(set(state) - set(own)), sorted(set(own) - set(state))
        tied = {n for n in missing if own[n] is self.base.get_input_embeddings().weight}
        if unknown or set(missing) - tied:
            raise RequestError(400, f"weights_path: {path!r} does not fit base model {self.base_name!r} (unknown "
                               f"{unknown[:3]}, missing {sorted(set(missing) - tied)[:3]})", "weights_path")
        misshapen = next((n for n, v in state.items() if v.shape != own[n].shape), None)
        if misshapen is not None:  # checked before any weight is copied: the base model stays whole
            raise RequestError(400, f"weights_path: {path!r}: {misshapen} has shape {list(state[misshapen].shape)}, "
                               f"the base model's is {list(own[misshapen].shape)}", "weights_path")
        with torch.no_grad():
            for name, value in state.items():
                own[name].copy_(value)

    def list_models(self) -> dict[str, Any]:
        """The ``GET /v1/models`` body: the base model, then each adapter (``parent`` = the base)."""
        owner = self.strict.flavor if self.strict else "teamrl"
        data = [{"id": self.base_name, "object": "model", "created": self.created, "owned_by": owner,
                 "root": self.base_name, "parent": None, "max_model_len": self.max_model_len}]
        for name, a in self.adapters.items():
            entry = {"id": name, "object": "model", "created": self.created, "owned_by": owner,
                     "root": a.path, "parent": self.base_name, "max_model_len": self.max_model_len}
            if not self.strict:  # neither vLLM nor SGLang sends a version
                entry["version"] = a.version
            data.append(entry)
        return {"object": "list", "data": data}

    @property
    def vocab_size(self) -> int:
        """Rows of the model's token embedding: the token ids it accepts."""
        return int(self.base.get_input_embeddings().num_embeddings)

    def _n(self, body: dict[str, Any], prompts: int) -> int:
        """``n`` within ``max_n`` and, times the prompts, within ``max_sequences`` (one request is one batch)."""
        n = _int(body, "n", 1, lo=1, hi=self.max_n, limit="teamrl serve --max-n")
        if prompts * n > self.max_sequences:
            raise RequestError(
                400,
                f"n: {prompts} prompts x n={n} = {prompts * n} sequences; one request takes at most "
                f"{self.max_sequences} sequences (teamrl serve --max-sequences)",
                "n",
            )
        return n

    def _fits_context(self, prompts: list[list[int]], max_tokens: int) -> None:
        """vLLM's rule: every prompt plus ``max_tokens`` within the model's context, or a 400 naming the field at
        fault."""
        longest = max(len(p) for p in prompts)
        if longest + max_tokens > self.max_model_len:
            field = "prompt" if longest >= self.max_model_len else "max_tokens"
            raise RequestError(
                400,
                f"{field}: the prompt ({longest} tokens) plus max_tokens ({max_tokens}) is "
                f"{longest + max_tokens} tokens; this model's context of {self.max_model_len} tokens "
                "(max_model_len) must hold both",
                field,
            )

    @property
    def max_model_len(self) -> int:
        """The longest prompt + completion the model takes (its position limit)."""
        return int(getattr(self.base.config, "max_position_embeddings", 0) or 2**31 - 1)

    # ---- completions ------------------------------------------------------------------
    def complete(self, body: Any) -> dict[str, Any]:
        """Serve one ``POST /v1/completions`` body; raise :class:`RequestError` for a bad one."""
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        if self.strict:
            return self._complete_strict(body)
        unknown = [k for k in body if k not in COMPLETION_FIELDS]
        if unknown:
            raise RequestError(
                400, f"{unknown[0]}: unsupported field; teamrl serve accepts {list(COMPLETION_FIELDS)}", unknown[0]
            )
        model = body.get("model")
        if not isinstance(model, str):
            raise RequestError(400, "model: required, a string (the base model's name or a loaded adapter's)", "model")
        if model != self.base_name and model not in self.adapters:
            raise RequestError(
                404, f"The model {model!r} does not exist; served: {[self.base_name, *self.adapters]}", "model"
            )
        prompts = self._prompts(body.get("prompt"))
        for flag, allowed in (("stream", False), ("echo", False), ("skip_special_tokens", True)):
            if flag in body and body[flag] is not None and body[flag] != allowed:
                raise RequestError(400, f"{flag}: only {json.dumps(allowed)} is supported", flag)
        logprobs = body.get("logprobs")
        if logprobs not in (None, 0, 1) or isinstance(logprobs, bool):
            raise RequestError(
                400,
                f"logprobs: {logprobs!r} is not supported; use 0 or 1 (the sampled token's log-prob) or null "
                "(top alternatives are not returned)",
                "logprobs",
            )
        n = self._n(body, len(prompts))
        seed = _seed(body)
        stop = body.get("stop")
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
            stop = tuple(stop)
        else:
            raise RequestError(
                400, f"stop: expected a string, a list of non-empty strings or null, got {stop!r}", "stop"
            )
        vocab = self.vocab_size
        top_k = _int(body, "top_k", 0, lo=-1, hi=vocab)  # more than the vocabulary is no bound at all
        max_tokens = _int(body, "max_tokens", 16, lo=1, hi=2**63 - 1)  # the context bounds it, below
        self._fits_context(prompts, max_tokens)
        try:
            params = SamplingParams(
                max_new_tokens=max_tokens,
                temperature=_num(body, "temperature", 1.0, "a finite number >= 0"),
                top_p=_num(body, "top_p", 1.0, "a finite number in (0, 1]"),
                top_k=max(top_k, 0),  # vLLM's -1 = disabled = teamrl's 0
                stop=stop,
                ignore_eos=_bool(body, "ignore_eos", False),
                min_new_tokens=_int(body, "min_tokens", 0, lo=0, hi=2**63 - 1),
            )
        except ValueError as e:  # SamplingParams names the setting; map it back to the request field
            message, setting = str(e), str(e).split("=")[0]
            for ours, field in REQUEST_FIELD_OF_SETTING.items():
                message = message.replace(ours, field)
            raise RequestError(400, message, REQUEST_FIELD_OF_SETTING.get(setting, setting)) from e
        as_ids = _bool(body, "return_tokens_as_token_ids", False)
        keep_stop = _bool(body, "include_stop_str_in_output", False)
        with self._lock:
            # The adapter may have been unloaded between the check and here: check again under the lock.
            if model != self.base_name and model not in self.adapters:
                raise RequestError(404, f"The model {model!r} does not exist (unloaded)", "model")
            outs = self.engine.generate(model, [GenerationRequest(p, params, n) for p in prompts], seed)
        choices = []
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            for j, c in enumerate(out):
                text = c.text
                stop_reason = None
                if c.finish_reason == "stop":
                    stop_reason = next((s for s in stop if text.endswith(s)), None) or next(
                        (s for s in stop if s in text), None
                    )
                    if not keep_stop and stop_reason is not None and text.endswith(stop_reason):
                        text = text[:-len(stop_reason)]
                choice: dict[str, Any] = {
                    "index": i * n + j, "text": text,
                    "finish_reason": "length" if c.finish_reason == "length" else "stop",
                    # vLLM: None when the model emitted EOS, else the stop string that matched
                    "stop_reason": stop_reason,
                }
                if logprobs is not None:
                    pieces = [self.tokenizer.decode([t]) for t in c.token_ids]
                    offsets, pos = [], 0
                    for piece in pieces:
                        offsets.append(pos)
                        pos += len(piece)
                    choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in c.token_ids] if as_ids else pieces,
                                          "token_logprobs": c.logprobs, "top_logprobs": None, "text_offset": offsets}
                else:
                    choice["logprobs"] = None
                if _bool(body, "return_token_ids", False):
                    choice["token_ids"] = c.token_ids
                    choice["prompt_token_ids"] = prompt if j == 0 else None
                choices.append(choice)
        completion_tokens = sum(len(c.token_ids) for out in outs for c in out)
        prompt_tokens = sum(len(p) for p in prompts)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _complete_strict(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/completions`` as vLLM 0.33.0 or SGLang 0.5.23 serve it (unknown fields ignored)."""
        st = self.strict
        assert st is not None
        model = body.get("model")
        if not isinstance(model, str):
            raise RequestError(400, "model: required, a string", "model")
        weights = self._strict_weights(model, body.get("lora_path"))
        prompts = self._prompts(body.get("prompt"))
        if len(prompts) > st.max_prompts:
            raise RequestError(
                400, f"prompt: at most {st.max_prompts} prompts per request, got {len(prompts)}", "prompt"
            )
        n = self._n(body, len(prompts))
        seed = _seed(body)
        for key in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            _num(body, key, 0.0, "a finite number")  # NaN and inf would reach the sampler
        _int(body, "top_k", -1, lo=-1, hi=self.vocab_size)
        _int(body, "max_tokens", 16, lo=1, hi=2**63 - 1)
        stop = body.get("stop") or []
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if st.max_stop_strings is not None and len(stop) > st.max_stop_strings:
            raise RequestError(400, f"stop: at most {st.max_stop_strings} stop strings, got {len(stop)}", "stop")
        value = {req: body.get(req) if body.get(req) is not None else st.generation_defaults.get(key)
                 for key, req in GENERATION_DEFAULT_FIELDS.items()}
        temperature = float(value["temperature"] if value["temperature"] is not None else 1.0)
        if st.flavor == "vllm" and temperature < 1e-5 and n > 1:
            raise RequestError(400, f"n must be 1 when using greedy sampling, got {n}.", "n")
        requested = int(value["max_tokens"] if value["max_tokens"] is not None else 16)
        settings = []
        for p in prompts:
            room = self.max_model_len - len(p)
            if room < 1:
                raise RequestError(
                    400, f"prompt: {len(p)} tokens leave no room under max_model_len {self.max_model_len}", "prompt"
                )
            settings.append(
                RowSamplingParams(
                    max_tokens=min(requested, room),  # vLLM shortens max_tokens silently at the context limit
                    temperature=temperature,
                    top_p=float(value["top_p"] if value["top_p"] is not None else 1.0),
                    top_k=int(value["top_k"] if value["top_k"] is not None else -1),
                    min_p=float(value["min_p"] or 0.0),
                    repetition_penalty=float(
                        value["repetition_penalty"] if value["repetition_penalty"] is not None else 1.0
                    ),
                    presence_penalty=float(value["presence_penalty"] or 0.0),
                    frequency_penalty=float(value["frequency_penalty"] or 0.0),
                    stop=stop,
                    ignore_eos=_bool(body, "ignore_eos", False),
                )
            )
        eos_ids = sorted({self.tokenizer.eos_token_id, *st.extra_eos_ids} - {None})
        want_logprobs = body.get("logprobs") is not None
        as_ids = st.flavor == "vllm" and _bool(body, "return_tokens_as_token_ids", False)
        keep_stop = st.flavor == "vllm" and _bool(body, "include_stop_str_in_output", False)
        choices = []
        with self._lock:
            if weights is not None and weights not in self.adapters:
                raise RequestError(404, f"The model {model!r} does not exist (unloaded)", "model")
            net = self.base if weights is None else self.adapters[weights].model
            for i, (prompt, s) in enumerate(zip(prompts, settings)):
                for j in range(n):
                    # vLLM: every prompt gets the request's seed, sample j of n gets seed + j; SGLang: the seed as is.
                    row_seed = None if seed is None else seed + (j if st.flavor == "vllm" else 0)
                    self.row_seeds.append(row_seed)
                    row = decode_row(net, self.tokenizer, prompt, s, row_seed, eos_ids, st.logprobs_mode)
                    choices.append(self._strict_choice(i * n + j, prompt, row, body, want_logprobs, as_ids, keep_stop))
        completion_tokens = sum(len(c["_ids"]) for c in choices)
        for c in choices:
            del c["_ids"]
        prompt_tokens = sum(len(p) for p in prompts)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _strict_weights(self, model: str, lora_path: Any) -> str | None:
        """The adapter a strict request samples from (None: the base), by the imitated server's rule."""
        assert self.strict is not None
        if self.strict.flavor == "vllm":
            if model != self.base_name and model not in self.adapters:
                raise RequestError(404, f"The model `{model}` does not exist.", "model")
            return None if model == self.base_name else model
        # SGLang: "base:adapter" or lora_path picks an adapter; any other name silently means the base.
        if ":" in model:
            adapter = model.split(":", 1)[1]
            if adapter not in self.adapters:
                raise RequestError(400, f"LoRA adapter {adapter!r} is not loaded", "model")
            return adapter
        if isinstance(lora_path, str) and lora_path in self.adapters:
            return lora_path
        return None

    def _strict_choice(self, index: int, prompt: list[int], row: Any, body: dict[str, Any], want_logprobs: bool,
                       as_ids: bool, keep_stop: bool) -> dict[str, Any]:
        """One choice of a strict answer, in the imitated server's fields."""
        assert self.strict is not None
        text = self.tokenizer.decode(
            row.token_ids, skip_special_tokens=body.get("skip_special_tokens", True) is not False
        )
        if isinstance(row.stop_reason, str) and row.stop_reason in text:
            at = text.index(row.stop_reason)
            text = text[:at + len(row.stop_reason)] if keep_stop else text[:at]
        choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": row.finish, "_ids": row.token_ids}
        if self.strict.flavor == "vllm":
            choice["stop_reason"] = row.stop_reason
        else:
            eos_hit = row.finish == "stop" and not isinstance(row.stop_reason, str)
            choice["matched_stop"] = (
                (row.token_ids[-1] if eos_hit else row.stop_reason) if row.finish == "stop" else None
            )
        if want_logprobs:
            pieces = [self.tokenizer.decode([t]) for t in row.token_ids]
            choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in row.token_ids] if as_ids else pieces,
                                  "token_logprobs": row.logprobs, "top_logprobs": None}
        else:
            choice["logprobs"] = None
        if _bool(body, "return_token_ids", False):
            choice["token_ids"] = list(row.token_ids)
            choice["prompt_token_ids"] = prompt
        return choice

    def _prompts(self, prompt: Any) -> list[list[int]]:
        """``prompt`` as a list of token-id lists: token ids, a list of them, a string, or a list of strings."""
        vocab = self.base.get_input_embeddings().num_embeddings
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt = [prompt]
        ok = isinstance(prompt, list) and len(prompt) > 0
        out: list[list[int]] = []
        for p in prompt if ok else []:
            if isinstance(p, str) and p:
                out.append(self.tokenizer.encode(p, add_special_tokens=False))
            elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                bad = [t for t in p if not 0 <= t < vocab]
                if bad:
                    raise RequestError(
                        400, f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt"
                    )
                out.append(list(p))
            else:
                ok = False
                break
        if not ok:
            raise RequestError(400, "prompt: expected token ids (a non-empty list of ints), a list of such lists, "
                               f"a non-empty string or a list of strings; got {json.dumps(prompt)[:80]}", "prompt")
        return out


def _int(body: dict, key: str, default: int, lo: int, hi: int, limit: str = "") -> int:
    """``body[key]``, an integer from ``lo`` to ``hi``, or a 400 naming the field and the range (and ``limit``: its
    setting)."""
    v = body.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RequestError(400, f"{key}: expected an integer from {lo} to {hi}" + (f" ({limit})" if limit else "") +
                           f", got {short_repr(v)}", key)
    return v


def _num(body: dict, key: str, default: float, accepted: str) -> float:
    """``body[key]`` as a finite float (NaN and inf never reach the sampler), or a 400 naming the field."""
    v = body.get(key, default)
    return request_number(default if v is None else v, key, accepted)


def _seed(body: dict) -> int | None:
    """``body["seed"]``: null or an integer in vLLM's range (int64), or a 400."""
    seed = body.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]
    ):
        raise RequestError(
            400,
            f"seed: expected null or an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]}, got {short_repr(seed)}",
            "seed",
        )
    return seed


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(400, f"{key}: expected true or false, got {v!r}", key)
    return v


def _json_body(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"null")
    except json.JSONDecodeError as e:
        raise RequestError(400, f"the request body is not valid JSON: {e}") from None


def allowed_folder(path: str, field: str, allowed: Sequence[str] | None) -> None:
    """A :class:`RequestError` 403 naming ``field`` when ``path`` (its real path: symlinks and ``..`` resolved) is
    not inside one of the folders ``allowed`` (``None``: any path)."""
    if allowed is None:
        return
    real = os.path.realpath(path)
    roots = [os.path.realpath(a) for a in allowed]
    if not any(os.path.commonpath([real, root]) == root for root in roots):
        raise RequestError(403, f"{field}: {short_repr(path, 300)} is outside the folders this server loads from "
                           f"(teamrl serve --allowed-path DIR, repeatable; allowed: {roots or 'none'})", field)


def build_app(ms: "ModelServer", api_key: str = "", allowed_paths: Sequence[str] | None = None) -> Any:
    """The FastAPI app of ``teamrl serve``: completions, models, health and LoRA load/unload at the
    paths of the imitated server (vLLM under ``/v1``, SGLang at the root; plain teamrl serve both).
    ``api_key``: every request needs ``Authorization: Bearer <api_key>`` (401 otherwise); ``allowed_paths``: the
    folders an adapter or full weights may be loaded from over HTTP (403 outside them; ``None``: any)."""
    require_asgi()
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse
    from starlette.concurrency import run_in_threadpool

    app = FastAPI(title="teamrl serve", docs_url=None, redoc_url=None, openapi_url=None)
    flavor = ms.strict.flavor if ms.strict else None
    prefixes = {"vllm": ("/v1",), "sglang": ("",), None: ("/v1", "")}[flavor]
    endpoints = sorted({"GET /health", "GET /v1/models", "POST /v1/completions",
                        *(f"POST {p}/{verb}_lora_adapter" for p in prefixes for verb in ("load", "unload")),
                        *(("POST /collective_rpc", "POST /reset_prefix_cache") if flavor != "sglang" else ())})
    json_errors(app, lambda: endpoints)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ms.list_models()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = _json_body(await request.body())
        return await run_in_threadpool(ms.complete, body)  # one engine: ModelServer serves one request at a time

    def loaded() -> dict[str, str]:
        return {n: a.path for n, a in ms.adapters.items()}

    def load(body: Any) -> Any:
        if not isinstance(body, dict):
            raise RequestError(400, "expected a JSON object {\"lora_name\": ..., \"lora_path\": ...}")
        unknown = [k for k in body if k not in ("lora_name", "lora_path", "load_inplace")]
        if unknown and not flavor:
            raise RequestError(
                400, f"{unknown[0]}: unsupported field; accepted: lora_name, lora_path, load_inplace", unknown[0]
            )
        if isinstance(body.get("lora_path"), str) and body["lora_path"]:
            allowed_folder(body["lora_path"], "lora_path", allowed_paths)
        with ms._lock:
            version = ms.load_adapter(body.get("lora_name"), body.get("lora_path"), _bool(body, "load_inplace", False))
        message = f"Success: LoRA adapter '{body['lora_name']}' added successfully."
        if flavor == "vllm":
            return PlainTextResponse(message)
        if flavor == "sglang":
            return {"success": True, "error_message": "", "loaded_adapters": loaded()}
        return {"status": "ok", "message": message, "lora_name": body["lora_name"], "version": version}

    def unload(body: Any) -> Any:
        if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str):
            raise RequestError(400, "lora_name: required, a string", "lora_name")
        with ms._lock:
            ms.unload_adapter(body["lora_name"])
        message = f"Success: LoRA adapter '{body['lora_name']}' removed successfully."
        if flavor == "vllm":
            return PlainTextResponse(message)
        if flavor == "sglang":
            return {"success": True, "error_message": "", "loaded_adapters": loaded()}
        return {"status": "ok", "message": message}

    if flavor != "sglang":  # vLLM's own (VLLM_SERVER_DEV_MODE=1) full-weight reload; teamrl serve keeps no KV cache
        @app.post("/collective_rpc")
        async def collective_rpc(request: Request) -> Any:
            body = _json_body(await request.body())
            if not isinstance(body, dict) or body.get("method") != "reload_weights":
                raise RequestError(400, "method: only reload_weights is served, with kwargs {\"weights_path\": ...}",
                                   "method")
            kwargs = body.get("kwargs") or {}
            path = kwargs.get("weights_path") if isinstance(kwargs, dict) else None
            if isinstance(path, str) and path:
                allowed_folder(path, "weights_path", allowed_paths)

            def reload() -> None:
                with ms._lock:
                    ms.reload_weights(path)
            await run_in_threadpool(reload)
            return {"results": [None]}

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> dict[str, bool]:
            return {"success": True}

    for prefix in prefixes:
        for verb, handle in (("load", load), ("unload", unload)):
            async def route(request: Request, handle: Any = handle) -> Any:
                answer = await run_in_threadpool(handle, _json_body(await request.body()))
                return answer if not isinstance(answer, dict) else JSONResponse(answer)

            app.add_api_route(f"{prefix}/{verb}_lora_adapter", route, methods=["POST"])
    return Guard(app, MAX_BODY_BYTES, token=api_key, what="teamrl serve's limit")


class TeamrlHTTPServer(AsgiServer):
    """``teamrl serve``'s app (:func:`build_app`) on uvicorn, bound to ``host:port`` at construction."""

    def __init__(self, model_server: ModelServer, host: str = "127.0.0.1", port: int = 8000, verbose: bool = False,
                 max_connections: int = MAX_CONNECTIONS, min_body_rate: float = MIN_BODY_RATE, api_key: str = "",
                 allowed_paths: Sequence[str] | None = None) -> None:
        self.model_server = model_server
        self.verbose = verbose
        super().__init__(build_app(model_server, api_key, allowed_paths), host, port, verbose,
                         ConnectionLimits(HEADER_TIMEOUT_S, BODY_TIMEOUT_S, max_connections, min_body_rate,
                                          names=("teamrl serve's header timeout", "teamrl serve's body timeout",
                                                 "teamrl serve --max-connections", "teamrl serve --min-body-rate")))


def serve(model_server: ModelServer, host: str = "127.0.0.1", port: int = 8000, ready_file: str | None = None,
          verbose: bool = False, max_connections: int = MAX_CONNECTIONS, min_body_rate: float = MIN_BODY_RATE,
          api_key: str = "", allowed_paths: Sequence[str] | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then close the socket and return (``api_key``, ``allowed_paths``: see
    :func:`build_app`)."""
    import signal
    import sys

    httpd = TeamrlHTTPServer(model_server, host, port, verbose, max_connections, min_body_rate, api_key, allowed_paths)
    # uvicorn runs on a thread: this (main) thread keeps the signals, so a SIGTERM stops the server and
    # returns here (uvicorn's own handlers would re-raise it and end the process with -15)
    serving = threading.Thread(target=httpd.serve_forever, name="teamrl-serve", daemon=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: httpd.stop())
    signal.signal(signal.SIGINT, lambda signum, frame: httpd.stop())
    print(
        f"teamrl serve: {model_server.base_name} on {model_server.device} "
        f"({str(model_server.dtype).removeprefix('torch.')}), "
        f"listening on {httpd.url}",
        flush=True,
    )
    if ready_file:
        tmp = Path(ready_file).with_suffix(".tmp")
        tmp.write_text(httpd.url)
        tmp.replace(ready_file)  # atomic: a reader never sees a half-written URL
    try:
        serving.start()
        while serving.is_alive():
            serving.join(timeout=0.2)
    finally:
        httpd.server_close()
        print("teamrl serve: stopped", file=sys.stderr, flush=True)
