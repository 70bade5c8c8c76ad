"""An engine that generates on an OpenAI-compatible server: ``teamrl serve``, vLLM or SGLang.

The servers differ where RL training is sensitive, so the engine speaks one **dialect** per
backend (``rollout.server_dialect``; ``auto`` reads ``owned_by`` of ``GET /v1/models``):

- ``vllm`` (read in vLLM 0.33.0's source) and ``sglang`` (SGLang 0.5.23): every prompt of a
  request gets the request's seed and vLLM gives sample ``j`` of ``n`` the seed ``seed + j``, so
  G copies of one prompt in one request would be G copies of one completion. The engine sends
  each group (the requests of one policy with the same prompt and settings) as **one prompt with
  n = group size**, one HTTP request per group, concurrently, each with its own seed derived
  from the call's seed (vLLM) or no seed (SGLang, whose copies of an ``n > 1`` request may share
  one). Every sampling field the trainer's log-probs assume is sent explicitly, so the server's
  ``generation_config`` defaults never apply: penalties off, ``min_p`` 0, ``top_k``/``top_p``,
  ``skip_special_tokens``, ``return_token_ids``. Greedy groups are sampled once and repeated
  (vLLM refuses ``n > 1`` at temperature 0); more stop strings than the server takes, or a
  prompt plus ``max_new_tokens`` over its ``max_model_len`` (vLLM would silently shorten the
  completion), are refused naming the limit. SGLang's LoRA endpoints have no ``/v1``, its adapter
  is picked by ``model: "base:adapter"``, and its stop is read from ``matched_stop``.
- ``teamrl``: plain ``teamrl serve``, which draws one random stream per call like the in-process
  engine: all requests with the same settings go in one request, so the server reproduces the
  in-process engine's samples exactly.

Log-probs are whatever the server returns. vLLM returns the raw model's (temperature 1) unless
started with ``--logprobs-mode processed_logprobs``; :meth:`HTTPEngine.startup_check` compares
them with the trainer's on a probe and refuses to train when they disagree. ``finish_reason`` is
mapped back to teamrl's three: a stop string is ``stop``; EOS or another stop token id is ``eos``.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from teamrl.core.seeding import derive_seed
from teamrl.rollout.engine import Completion, Engine, GenerationRequest, SamplingParams

DIALECTS = ("auto", "vllm", "sglang", "teamrl")


@dataclass(frozen=True)
class Dialect:
    """What differs between the servers' APIs, as read in their source (versions in the module docstring)."""

    name: str
    lora_prefix: str           # where load_lora_adapter / unload_lora_adapter live
    one_group_per_request: bool  # True: seeds are per request (vLLM, SGLang); False: one stream per call (teamrl serve)
    send_seed: bool
    max_stop_strings: int | None
    max_prompts: int           # prompts per request
    explicit_fields: bool      # send penalties, min_p, return_token_ids ... (teamrl serve 400s on fields it lacks)


DIALECT_SPECS = {
    "vllm": Dialect("vllm", "/v1", True, True, 4, 1024, True),
    "sglang": Dialect("sglang", "", True, False, None, 1024, True),
    "teamrl": Dialect("teamrl", "/v1", False, True, None, 2**31, False),
}
# Sampling fields that must not be left to the server's generation_config defaults.
NEUTRAL_FIELDS = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0,
                  "min_tokens": 0, "skip_special_tokens": True, "return_token_ids": True}


class ServerError(RuntimeError):
    """The server answered with an error, or could not be reached; the message says which and why."""


class HTTPEngine(Engine):
    """The :class:`Engine` interface against a completions server at ``base_url``.

    ``dialect`` is one of :data:`DIALECTS`; ``auto`` asks the server (``owned_by`` in ``/v1/models``).
    ``generate`` groups requests as the dialect needs (module docstring). ``sync_weights(policy)``
    calls ``save_adapter(policy, folder)`` to write the policy's current LoRA adapter to
    ``adapter_dir/<policy>/v<N>`` (a folder the server must be able to read: same machine or a
    shared file system), then unloads the previous version on the server and loads the new one
    under the policy's name. Older version folders are deleted.
    """

    def __init__(self, base_url: str, tokenizer: Any = None, adapter_dir: str | Path | None = None,
                 save_adapter: Callable[[str, Path], Any] | None = None, timeout: float = 600.0,
                 api_key: str | None = None, dialect: str = "auto", max_concurrent: int = 64) -> None:
        if dialect not in DIALECTS:
            raise ValueError(f"dialect {dialect!r}: choose one of {list(DIALECTS)}")
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.adapter_dir = Path(adapter_dir) if adapter_dir is not None else None
        self.save_adapter = save_adapter
        self.timeout = timeout
        self.api_key = api_key
        self.versions: dict[str, int] = {}
        self.max_concurrent = max_concurrent
        self.merge_groups = True  # False: send a group's copies as separate prompts (the old shape; tests only)
        self._dialect = None if dialect == "auto" else dialect
        self._base_model: str | None = None
        self._max_model_len: int | None = None

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

    def model_cards(self) -> list[dict[str, Any]]:
        """The entries of ``GET /v1/models``."""
        return list(self.request("GET", "/v1/models")["data"])

    def models(self) -> list[str]:
        """Ids of the models the server serves (base model and adapters)."""
        return [m["id"] for m in self.model_cards()]

    @property
    def dialect(self) -> str:
        """``vllm``, ``sglang`` or ``teamrl``: as configured, or read from ``owned_by`` of the first served model."""
        if self._dialect is None:
            cards = self.model_cards()
            owner = str(cards[0].get("owned_by", "")).lower() if cards else ""
            if owner not in DIALECT_SPECS:
                raise ServerError(f"server {self.base_url} says its models are owned_by {owner!r}; cannot tell vllm, sglang or "
                                  "teamrl apart: set rollout.server_dialect")
            self._dialect = owner
        return self._dialect

    @property
    def spec(self) -> Dialect:
        return DIALECT_SPECS[self.dialect]

    def check_base_model(self, name: str) -> None:
        """Fail unless the server serves a model called ``name`` (the trainer's base model); remember its limits."""
        cards = self.model_cards()
        served = [m["id"] for m in cards]
        if name not in served:
            raise ServerError(f"server {self.base_url} does not serve base model {name!r}; it serves {served}. "
                              f"Start it with `teamrl serve --model {name}` (same model and seed as training)")
        self._base_model = name
        self._max_model_len = next((m.get("max_model_len") for m in cards if m["id"] == name), None)

    def _model_field(self, policy: str) -> str:
        """The request's ``model`` for ``policy``: its name, or SGLang's ``base:adapter``."""
        if self.dialect == "sglang" and self._base_model is not None and policy != self._base_model:
            return f"{self._base_model}:{policy}"
        return policy

    # ---- Engine -----------------------------------------------------------------------
    def generate(self, policy: str, requests: Sequence[GenerationRequest], seed: int | None = None) -> list[list[Completion]]:
        """Completions for ``requests`` from the server's model ``policy``."""
        if not requests:
            return []
        for r in requests:
            if r.n < 1:
                raise ValueError(f"GenerationRequest.n={r.n}: must be >= 1")
            if not r.prompt_ids:
                raise ValueError("GenerationRequest.prompt_ids is empty")
            self._check_limits(r)
        spec = self.spec
        # A group: the requests that one server request serves (same settings, and for per-request seeding the same prompt).
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            if not spec.one_group_per_request:
                key: tuple = (r.params, r.n)
            elif self.merge_groups:
                key = (r.params, tuple(r.prompt_ids))
            else:
                key = (r.params, r.n, i // spec.max_prompts)
            groups.setdefault(key, []).append(i)
        calls = []
        for g, idx in enumerate(groups.values()):
            params = requests[idx[0]].params
            if spec.one_group_per_request and self.merge_groups:
                prompts, n = [requests[idx[0]].prompt_ids], sum(requests[i].n for i in idx)
            else:
                prompts, n = [requests[i].prompt_ids for i in idx], requests[idx[0]].n
            call_seed = None
            if seed is not None and spec.send_seed:
                # vLLM seeds sample j with seed + j: seeds of different groups must not meet, so derive each group's far apart.
                call_seed = seed + g if not spec.one_group_per_request else derive_seed(seed, g) % 2**53
            calls.append((idx, prompts, n, params, call_seed))
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrent, len(calls)))) as pool:
            answers = list(pool.map(lambda c: self._complete(policy, *c[1:]), calls))
        out: list[list[Completion] | None] = [None] * len(requests)
        for (idx, prompts, n, _, _), completions in zip(calls, answers):
            if spec.one_group_per_request and self.merge_groups:
                k = 0
                for i in idx:
                    out[i] = completions[k:k + requests[i].n]
                    k += requests[i].n
            else:
                for k, i in enumerate(idx):
                    out[i] = completions[k * n:(k + 1) * n]
        return out  # type: ignore[return-value]

    def _check_limits(self, r: GenerationRequest) -> None:
        """Refuse what the server would reject or silently change, naming its limit."""
        cap = self.spec.max_stop_strings
        if cap is not None and len(r.params.stop) > cap:
            raise ValueError(f"rollout.stop: {len(r.params.stop)} stop strings, but a {self.dialect} server takes at most {cap} "
                             "per request")
        if self._max_model_len is None and self._base_model is None:
            cards = self.model_cards()
            self._max_model_len = next((m.get("max_model_len") for m in cards if m.get("parent") is None), None)
            self._base_model = next((m["id"] for m in cards if m.get("parent") is None), None)
        limit = self._max_model_len
        if limit is not None and len(r.prompt_ids) + r.params.max_new_tokens > limit:
            raise ValueError(f"a prompt of {len(r.prompt_ids)} tokens plus max_new_tokens {r.params.max_new_tokens} exceeds the "
                             f"server's max_model_len {limit} (it would cut the completion short); shorten the prompt or "
                             "rollout.max_new_tokens")

    def _complete(self, policy: str, prompts: list[list[int]], n: int, params: SamplingParams,
                  seed: int | None) -> list[Completion]:
        """One ``POST /v1/completions``: ``n`` completions of each prompt, in prompt order."""
        spec = self.spec
        greedy_copies = 1
        if spec.one_group_per_request and params.temperature == 0 and n > 1:
            greedy_copies, n = n, 1  # vLLM refuses greedy n > 1; greedy samples are all the same
        body: dict[str, Any] = {
            "model": self._model_field(policy), "prompt": [list(p) for p in prompts] if len(prompts) > 1 else list(prompts[0]),
            "n": n, "max_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1, "stop": list(params.stop), "ignore_eos": params.ignore_eos,
            "logprobs": 0, "return_tokens_as_token_ids": True, "include_stop_str_in_output": True}
        if params.min_new_tokens:
            body["min_tokens"] = params.min_new_tokens  # vLLM's and SGLang's name
        if spec.explicit_fields:
            body.update(NEUTRAL_FIELDS)
        if seed is not None:
            body["seed"] = seed
        resp = self.request("POST", "/v1/completions", body)
        choices = sorted(resp.get("choices", []), key=lambda c: c["index"])
        if len(choices) != len(prompts) * n:
            raise ServerError(f"POST {self.base_url}/v1/completions: expected {len(prompts) * n} choices "
                              f"({len(prompts)} prompts x n={n}), got {len(choices)}")
        completions = [_completion(c) for c in choices]
        if greedy_copies > 1:
            completions = [Completion(list(c.token_ids), list(c.logprobs), c.text, c.finish_reason)
                           for c in completions for _ in range(greedy_copies)]
        return completions

    def sync_weights(self, policy: str) -> None:
        """Save ``policy``'s adapter to a new version folder and have the server load it under the policy's name."""
        if self.save_adapter is None or self.adapter_dir is None:
            raise ValueError("HTTPEngine.sync_weights needs save_adapter and adapter_dir (a folder the server can read)")
        version = self.versions.get(policy, 0) + 1
        folder = self.adapter_dir / policy / f"v{version:06d}"
        self.save_adapter(policy, folder)
        prefix = self.spec.lora_prefix
        if policy in self.versions:
            # vLLM refuses to load a name twice (and older versions have no load_inplace): unload, then load.
            self.request("POST", f"{prefix}/unload_lora_adapter", {"lora_name": policy})
        self.request("POST", f"{prefix}/load_lora_adapter", {"lora_name": policy, "lora_path": str(folder.resolve())})
        self.versions[policy] = version
        for old in (self.adapter_dir / policy).glob("v*"):
            if old != folder:  # the server may reload from disk (vLLM's LRU cache), so keep the current one
                shutil.rmtree(old, ignore_errors=True)

    # ---- start-up check ---------------------------------------------------------------
    def startup_check(self, base_model: str, policies: Sequence[str], params: SamplingParams, group_size: int,
                      prompt_ids: list[int], logprobs_of: Callable[[str, list[int], list[Completion], float], list[list[float]]],
                      tolerance: float = 0.02, seed: int = 1234) -> dict[str, float]:
        """Probe the server before training; raise :class:`ServerError` (one line) when it would train off-policy.

        Checks that the server serves ``base_model`` and every policy (load them first with
        :meth:`sync_weights`), then for each policy (the base when ``policies`` is empty) samples
        one group of ``max(group_size, 2)`` copies of ``prompt_ids`` with ``params`` (EOS ignored,
        so samples are long) and a fixed seed, the way a rollout sends it. Refuses when a sampled
        group's completions are all identical, or when the server's log-probs differ from
        ``logprobs_of(policy, prompt_ids, completions, temperature)`` (the trainer's) by more than
        ``tolerance`` (mean absolute difference per token). Returns the figures of the last probe:
        ``distinct`` completions and ``logprob_gap`` (largest per-token difference).
        """
        self.check_base_model(base_model)
        try:  # the run's own settings within the server's limits (stop strings, context length)
            self._check_limits(GenerationRequest(list(prompt_ids), params))
        except ValueError as e:
            raise ServerError(f"start-up check: {e}") from None
        served = self.models()
        missing = [p for p in policies if p not in served and self._model_field(p) not in served and self.dialect != "sglang"]
        if missing:
            raise ServerError(f"server {self.base_url} does not serve policies {missing}; it serves {served}")
        G = max(group_size, 2)
        probe = SamplingParams(max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                               top_k=params.top_k, ignore_eos=True)
        figures: dict[str, float] = {}
        for policy in list(policies) or [base_model]:
            group = [c for (c,) in self.generate(policy, [GenerationRequest(list(prompt_ids), probe, n=1) for _ in range(G)], seed=seed)]
            distinct = len({tuple(c.token_ids) for c in group})
            if params.temperature > 0 and distinct == 1:
                raise ServerError(f"start-up check: the {G} samples of one group from {self.base_url} ({self.dialect} dialect, "
                                  f"policy {policy!r}) are identical; the server's seeding would make every advantage 0")
            reference = logprobs_of(policy, list(prompt_ids), group, params.temperature)
            gaps = [abs(a - b) for c, r in zip(group, reference) for a, b in zip(c.logprobs, r)]
            mean_gap = sum(gaps) / max(len(gaps), 1)
            if not mean_gap <= tolerance:
                raise ServerError(f"start-up check: the server's log-probs ({self.dialect} dialect, policy {policy!r}, temperature "
                                  f"{params.temperature}) differ from the trainer's by {mean_gap:.4f} per token on average (max "
                                  f"{max(gaps):.4f}, tolerance {tolerance}); start vLLM with --logprobs-mode processed_logprobs "
                                  "and no top-k/top-p, or use the same model and dtype")
            figures = {"distinct": float(distinct), "logprob_gap": max(gaps, default=0.0), "logprob_mean_gap": mean_gap}
        return figures


def _completion(choice: dict[str, Any]) -> Completion:
    """One OpenAI/vLLM/SGLang completion choice -> a :class:`Completion`."""
    lp = choice.get("logprobs") or {}
    logprobs = [float(x) if x is not None else float("nan") for x in (lp.get("token_logprobs") or [])]
    ids = choice.get("token_ids")
    if ids is None:
        tokens = lp.get("tokens")
        if tokens is None:
            raise ServerError("a completion choice has neither token_ids nor logprobs.tokens; the server must support "
                              "logprobs and return_token_ids (vLLM and SGLang do)")
        try:
            ids = [int(t.split("token_id:", 1)[1]) for t in tokens]
        except (IndexError, ValueError):
            raise ServerError(f"logprobs.tokens are not 'token_id:N' strings (got {tokens[:3]}) and there are no token_ids; the "
                              "server ignored return_tokens_as_token_ids and return_token_ids") from None
    if len(logprobs) != len(ids):
        raise ServerError(f"a completion has {len(ids)} tokens but {len(logprobs)} log-probs")
    reason = choice.get("finish_reason")
    # vLLM: stop_reason (None: EOS; int: a stop token id; str: a stop string); SGLang: matched_stop (the EOS id or the string).
    stop_reason = choice["stop_reason"] if "stop_reason" in choice else choice.get("matched_stop")
    text = choice.get("text", "")
    if reason == "length":
        finish = "length"
    elif reason in ("stop", "eos") and isinstance(stop_reason, str):
        finish = "stop"
        if not text.endswith(stop_reason):  # SGLang drops the stop string whatever include_stop_str_in_output says
            text += stop_reason
    elif reason in ("stop", "eos"):
        finish = "eos"  # stop_reason None (EOS) or a stop token id
    else:
        raise ServerError(f"unknown finish_reason {reason!r}; expected 'stop' or 'length'")
    return Completion(list(ids), logprobs, text, finish)
