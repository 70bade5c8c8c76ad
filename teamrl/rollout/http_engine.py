"""An engine that generates on an OpenAI-compatible server: ``teamrl serve``, vLLM or SGLang.

It speaks vLLM's protocol, which SGLang's OpenAI server mirrors:

- ``POST /v1/completions`` with ``prompt`` as a list of token-id lists, ``n``, ``max_tokens``,
  ``temperature``, ``top_p``, ``top_k`` (-1 = off), ``stop``, ``seed``, ``ignore_eos``,
  ``logprobs: 0``, ``return_tokens_as_token_ids: true`` and ``include_stop_str_in_output: true``;
  token ids are read from ``choices[i].token_ids`` when the server sends them, else from the
  ``"token_id:123"`` strings of ``choices[i].logprobs.tokens``.
- ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` to publish a policy's new adapter
  after an update (:meth:`HTTPEngine.sync_weights`).

A request's ``model`` is the policy's name, so each policy (one LoRA adapter per role type) is
its own served model. Log-probs are whatever the server returns: ``teamrl serve`` returns
teamrl's definition (under ``softmax(logits / temperature)``); vLLM returns the raw model's
log-probs by default (temperature 1), so with temperature != 1 and a vLLM server the trainer's
old log-probs differ from the sampling ones. ``finish_reason`` is mapped back to teamrl's three:
vLLM's ``"stop"`` with ``stop_reason`` None (or a token id) is ``eos``, with a string it is ``stop``.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Sequence

from teamrl.rollout.engine import Completion, Engine, GenerationRequest, SamplingParams


class ServerError(RuntimeError):
    """The server answered with an error, or could not be reached; the message says which and why."""


class HTTPEngine(Engine):
    """The :class:`Engine` interface against a completions server at ``base_url``.

    ``generate`` sends all requests of one policy that share sampling settings in one HTTP call
    (a list of prompts), so the server batches them together; requests with different settings
    go in one call per setting, in order, with seeds ``seed, seed + 1, ...``.

    ``sync_weights(policy)`` calls ``save_adapter(policy, folder)`` to write the policy's current
    LoRA adapter to ``adapter_dir/<policy>/v<N>`` (a folder the server must be able to read: same
    machine or a shared file system), then unloads the previous version on the server and loads
    the new one under the policy's name. Older version folders are deleted.
    """

    def __init__(self, base_url: str, tokenizer: Any = None, adapter_dir: str | Path | None = None,
                 save_adapter: Callable[[str, Path], Any] | None = None, timeout: float = 600.0,
                 api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.adapter_dir = Path(adapter_dir) if adapter_dir is not None else None
        self.save_adapter = save_adapter
        self.timeout = timeout
        self.api_key = api_key
        self.versions: dict[str, int] = {}

    # ---- HTTP -------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None) -> Any:
        """Send one request; return the decoded JSON answer (or text), raise :class:`ServerError` on an error status."""
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                err = json.loads(raw)
                msg = (err.get("error") or {}).get("message") if isinstance(err.get("error"), dict) else err.get("message")
                msg = msg or json.dumps(err)
            except (json.JSONDecodeError, AttributeError):
                msg = raw.decode(errors="replace")
            raise ServerError(f"{method} {url}: HTTP {e.code}: {msg}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            raise ServerError(f"{method} {url}: could not reach the server ({reason}); is `teamrl serve` (or vLLM/SGLang) "
                              f"running at {self.base_url}?") from None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw.decode(errors="replace")  # vLLM answers the LoRA endpoints in plain text

    def models(self) -> list[str]:
        """Ids of the models the server serves (base model and adapters)."""
        return [m["id"] for m in self.request("GET", "/v1/models")["data"]]

    def check_base_model(self, name: str) -> None:
        """Fail unless the server serves a model called ``name`` (the trainer's base model)."""
        served = self.models()
        if name not in served:
            raise ServerError(f"server {self.base_url} does not serve base model {name!r}; it serves {served}. "
                              f"Start it with `teamrl serve --model {name}` (same model and seed as training)")

    # ---- Engine -----------------------------------------------------------------------
    def generate(self, policy: str, requests: Sequence[GenerationRequest], seed: int | None = None) -> list[list[Completion]]:
        """Completions for ``requests`` from the server's model ``policy``; one HTTP call per distinct (settings, n)."""
        if not requests:
            return []
        groups: dict[tuple[SamplingParams, int], list[int]] = {}
        for i, r in enumerate(requests):
            if r.n < 1:
                raise ValueError(f"GenerationRequest.n={r.n}: must be >= 1")
            if not r.prompt_ids:
                raise ValueError("GenerationRequest.prompt_ids is empty")
            groups.setdefault((r.params, r.n), []).append(i)
        out: list[list[Completion] | None] = [None] * len(requests)
        for g, ((params, n), idx) in enumerate(groups.items()):
            body = {"model": policy, "prompt": [list(requests[i].prompt_ids) for i in idx], "n": n,
                    "max_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
                    "top_k": params.top_k if params.top_k > 0 else -1, "stop": list(params.stop),
                    "ignore_eos": params.ignore_eos, "logprobs": 0, "return_tokens_as_token_ids": True,
                    "include_stop_str_in_output": True}
            if seed is not None:
                body["seed"] = seed + g
            resp = self.request("POST", "/v1/completions", body)
            choices = sorted(resp.get("choices", []), key=lambda c: c["index"])
            if len(choices) != len(idx) * n:
                raise ServerError(f"POST {self.base_url}/v1/completions: expected {len(idx) * n} choices "
                                  f"({len(idx)} prompts x n={n}), got {len(choices)}")
            for k, i in enumerate(idx):
                out[i] = [_completion(c) for c in choices[k * n:(k + 1) * n]]
        return out  # type: ignore[return-value]

    def sync_weights(self, policy: str) -> None:
        """Save ``policy``'s adapter to a new version folder and have the server load it under the policy's name."""
        if self.save_adapter is None or self.adapter_dir is None:
            raise ValueError("HTTPEngine.sync_weights needs save_adapter and adapter_dir (a folder the server can read)")
        version = self.versions.get(policy, 0) + 1
        folder = self.adapter_dir / policy / f"v{version:06d}"
        self.save_adapter(policy, folder)
        if policy in self.versions:
            # vLLM refuses to load a name twice (and older versions have no load_inplace): unload, then load.
            self.request("POST", "/v1/unload_lora_adapter", {"lora_name": policy})
        self.request("POST", "/v1/load_lora_adapter", {"lora_name": policy, "lora_path": str(folder.resolve())})
        self.versions[policy] = version
        for old in (self.adapter_dir / policy).glob("v*"):
            if old != folder:  # the server may reload from disk (vLLM's LRU cache), so keep the current one
                shutil.rmtree(old, ignore_errors=True)


def _completion(choice: dict[str, Any]) -> Completion:
    """One OpenAI/vLLM completion choice -> a :class:`Completion`."""
    lp = choice.get("logprobs") or {}
    logprobs = [float(x) if x is not None else float("nan") for x in (lp.get("token_logprobs") or [])]
    ids = choice.get("token_ids")
    if ids is None:
        tokens = lp.get("tokens")
        if tokens is None:
            raise ServerError("a completion choice has neither token_ids nor logprobs.tokens; the server must support "
                              "logprobs and return_tokens_as_token_ids (vLLM does)")
        try:
            ids = [int(t.split("token_id:", 1)[1]) for t in tokens]
        except (IndexError, ValueError):
            raise ServerError(f"logprobs.tokens are not 'token_id:N' strings (got {tokens[:3]}); the server ignored "
                              "return_tokens_as_token_ids") from None
    if len(logprobs) != len(ids):
        raise ServerError(f"a completion has {len(ids)} tokens but {len(logprobs)} log-probs")
    reason, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
    if reason == "length":
        finish = "length"
    elif reason in ("stop", "eos") and isinstance(stop_reason, str):
        finish = "stop"
    elif reason in ("stop", "eos"):
        finish = "eos"  # stop_reason None (EOS) or a stop token id
    else:
        raise ServerError(f"unknown finish_reason {reason!r}; expected 'stop' or 'length'")
    return Completion(list(ids), logprobs, choice.get("text", ""), finish)
