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
started with ``--logprobs-mode processed_logprobs``, and then those of the distribution it sampled
from: temperature-scaled and renormalised over the top-k/top-p set. :meth:`HTTPEngine.startup_check`
compares them with the trainer's log-probs of that same distribution on a probe and refuses to
train when they disagree. ``finish_reason`` is mapped back to teamrl's three: a stop string is
``stop``; EOS or another stop token id is ``eos``.

A server may hold adapters of other runs (or of an earlier process of this one): with an
``adapter_tag`` each policy is served under ``<policy>@<tag>`` (the trainer's tag is
``<run name>-<6 hex>``, new for every process), :meth:`HTTPEngine.release_stale` unloads what an
earlier process of the same run left behind, and :meth:`HTTPEngine.close` unloads this engine's
adapters. With ``verify_logprobs`` every adapter load is followed by :meth:`HTTPEngine.verify_sync`:
a short greedy completion of fixed probe prompts whose served log-probs must equal the trainer's
for that version, or the sync fails in one line naming the policy and version.

The dialects, the errors a server gives and the reading of its answers are in
:mod:`teamrl.rollout.completions_api`; the whole-request deadline is :mod:`teamrl.rollout.http_deadline`.
"""

from __future__ import annotations

import http.client
import json
import math
import shutil
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from teamrl.core.seeding import derive_seed
from teamrl.rollout.completions_api import (DIALECT_SPECS, DIALECTS, NEUTRAL_FIELDS, Dialect, MalformedAnswer,
                                            ServerError, ServerUnreachable, post_completions, short_text)
from teamrl.rollout.engine import Completion, Engine, GenerationRequest, SamplingParams
from teamrl.rollout.http_deadline import REQUEST_DEADLINE_S, Deadline, DeadlineHTTPHandler, DeadlineHTTPSHandler

# The sync check's probe: greedy tokens per probe prompt (few: it runs after every adapter load).
SYNC_PROBE_TOKENS = 8


class HTTPEngine(Engine):
    """The :class:`Engine` interface against a completions server at ``base_url``.

    ``dialect`` is one of :data:`DIALECTS`; ``auto`` asks the server (``owned_by`` in ``/v1/models``).
    ``generate`` groups requests as the dialect needs (module docstring); ``generate_many`` sends the
    calls of different policies together (each on its own thread), as the in-process engine
    batches them. ``sync_weights(policy)`` calls ``save_adapter(policy, folder)`` to write the
    policy's current LoRA adapter to ``adapter_dir/<served name>/v<N>`` (a folder the server must
    be able to read: same machine or a shared file system), then unloads the previous version on
    the server and loads the new one under the policy's served name: ``<policy>@<adapter_tag>``, or
    the policy's own name without a tag. Older version folders are deleted. With
    ``verify_logprobs`` (the trainer's ``logprobs_of(policy, prompts, completions, temperature)``,
    ``prompts`` one per completion) each load is checked by :meth:`verify_sync` against
    ``verify_tolerance`` on ``probe_prompts``; ``log`` gets one line per check.
    """

    def __init__(self, base_url: str, tokenizer: Any = None, adapter_dir: str | Path | None = None,
                 save_adapter: Callable[[str, Path], Any] | None = None,
                 save_weights: Callable[[str, Path], Any] | None = None, full_weights: Sequence[str] = (),
                 timeout: float = 600.0,
                 request_deadline_s: float = REQUEST_DEADLINE_S, vocab_size: int | None = None,
                 api_key: str | None = None, dialect: str = "auto", max_concurrent: int = 64,
                 adapter_tag: str | None = None,
                 verify_logprobs: Callable[..., list[list[float]]] | None = None, verify_tolerance: float = 1e-3,
                 probe_prompts: Sequence[Sequence[int]] = (), log: Callable[[str], Any] | None = None) -> None:
        if dialect not in DIALECTS:
            raise ValueError(f"dialect {dialect!r}: choose one of {list(DIALECTS)}")
        if verify_logprobs is not None and not probe_prompts:
            raise ValueError("HTTPEngine: verify_logprobs needs probe_prompts (token ids of the sync check's prompts)")
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.adapter_dir = Path(adapter_dir) if adapter_dir is not None else None
        self.save_adapter = save_adapter
        self.save_weights = save_weights
        self.full_weights = set(full_weights)  # policies trained as whole models: served as the base model, reloaded
        self.timeout = timeout  # per read (and connect)
        self.request_deadline_s = request_deadline_s  # the whole request
        # token ids an answer may hold: [0, vocab_size) (the trainer indexes its embedding with them)
        self.vocab_size = vocab_size if vocab_size is not None else (len(tokenizer) if tokenizer is not None else None)
        self.api_key = api_key
        self.versions: dict[str, int] = {}
        self.max_concurrent = max_concurrent
        self.merge_groups = True  # False: send a group's copies as separate prompts (the old shape; tests only)
        self.adapter_tag = adapter_tag
        self.served: dict[str, str] = {}  # policy -> the adapter name it is loaded under on the server now
        self.verify_logprobs = verify_logprobs
        self.verify_tolerance = verify_tolerance
        self.probe_prompts = [list(p) for p in probe_prompts]
        self.log = log
        self.sync_figures: dict[str, dict[str, float]] = {}  # policy -> figures of its last sync check
        self._probes: dict[str, list[Completion]] = {}  # policy -> what the server answered the last sync check
        self._dialect = None if dialect == "auto" else dialect
        self._base_model: str | None = None
        self._max_model_len: int | None = None

    # ---- HTTP -------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        """Send one request; return the decoded JSON answer (or text), raise :class:`ServerError` on an error status.

        ``timeout`` (default: the engine's) bounds each read; the whole request, headers to last byte, is bounded
        by ``request_deadline_s`` (and by ``timeout`` when one is given): past it the server counts as unreachable."""
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        deadline = Deadline(self.request_deadline_s if timeout is None else min(timeout, self.request_deadline_s))
        opener = urllib.request.build_opener(DeadlineHTTPHandler(deadline), DeadlineHTTPSHandler(deadline))
        try:
            with opener.open(req, timeout=self.timeout if timeout is None else timeout) as resp:
                raw = resp.read()
            if deadline.expired:  # an answer without a length ends at the cut: what came is not all of it
                raise TimeoutError("cut at the deadline")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                err = json.loads(raw)
                msg = (
                    (err.get("error") or {}).get("message")
                    if isinstance(err.get("error"), dict)
                    else err.get("message")
                )
                msg = msg or json.dumps(err)
            except (json.JSONDecodeError, AttributeError):
                msg = raw.decode(errors="replace")
            raise ServerError(f"{method} {url}: HTTP {e.code}: {msg}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            # HTTPException: a server killed while answering (IncompleteRead, a bad status line);
            # OSError: reset, timed out
            if deadline.expired:
                reason = (
                    f"no complete answer within {deadline.seconds:g} s (rollout.request_deadline_s; each read came "
                    f"within the {self.timeout if timeout is None else timeout:g} s read timeout)"
                )
                raise ServerUnreachable(f"{method} {url}: {reason}", reason=f"{method} {path}: {reason}") from None
            reason = str(getattr(e, "reason", e)) or type(e).__name__
            raise ServerUnreachable(
                f"{method} {url}: could not reach the server ({reason}); is `teamrl serve` (or vLLM/SGLang) "
                f"running at {self.base_url}?",
                reason=f"{method} {path}: {reason}",
            ) from None
        finally:
            deadline.cancel()
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw.decode(errors="replace")  # vLLM answers the LoRA endpoints in plain text

    def health(self, timeout: float = 3.0) -> None:
        """``GET /health`` within ``timeout`` seconds (vLLM, SGLang and teamrl serve answer it at once, even while
        generating); raises :class:`ServerUnreachable` when the server does not answer, :class:`ServerError` on an
        error."""
        self.request("GET", "/health", timeout=timeout)

    def model_cards(self) -> list[dict[str, Any]]:
        """The entries of ``GET /v1/models``."""
        resp = self.request("GET", "/v1/models")
        data = resp.get("data") if isinstance(resp, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
            reason = (f"GET /v1/models: malformed answer: expected {{'data': [{{'id': ...}}, ...]}}, "
                      f"got {short_text(resp)}")
            raise MalformedAnswer(f"{self.base_url}: {reason}", reason=reason)
        return list(data)

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
                raise ServerError(
                    f"server {self.base_url} says its models are owned_by {owner!r}; cannot tell vllm, sglang or "
                    "teamrl apart: set rollout.server_dialect"
                )
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

    def adapter_name(self, policy: str) -> str:
        """The name ``policy``'s adapter is loaded under: ``<policy>@<adapter_tag>`` (one run's own), or ``policy``."""
        return f"{policy}@{self.adapter_tag}" if self.adapter_tag else policy

    def served_name(self, policy: str) -> str:
        """The server's model for ``policy``: its loaded adapter's name, the base model for a full-weight policy (the
        server's weights are that policy's), or ``policy`` itself (the base model)."""
        if policy in self.full_weights:
            return self._base_model or policy
        return self.served.get(policy, policy)

    def _model_field(self, policy: str) -> str:
        """The request's ``model`` for ``policy``: its served name, or SGLang's ``base:adapter``."""
        name = self.served_name(policy)
        if self.dialect == "sglang" and self._base_model is not None and name != self._base_model:
            return f"{self._base_model}:{name}"
        return name

    # ---- Engine -----------------------------------------------------------------------
    def generate_many(
        self, calls: Sequence[tuple[str, Sequence[GenerationRequest], int | None]]
    ) -> list[list[list[Completion]]]:
        """Each policy's ``generate`` at once, on its own thread: the server decodes the policies' requests
        together (vLLM batches adapters), as the in-process engine decodes them in one batch. Each
        call carries its own seeds, so the answers are those of one call after another."""
        if len(calls) < 2:
            return [self.generate(policy, requests, seed) for policy, requests, seed in calls]
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            return list(pool.map(lambda c: self.generate(*c), calls))

    def generate(
        self, policy: str, requests: Sequence[GenerationRequest], seed: int | None = None
    ) -> list[list[Completion]]:
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
        # A group: the requests that one server request serves (same settings, and for per-request seeding the same
        # prompt).
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
                # vLLM seeds sample j with seed + j: seeds of different groups must not meet, so derive each group's
                # far apart.
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
            raise ValueError(
                f"rollout.stop: {len(r.params.stop)} stop strings, but a {self.dialect} server takes at most {cap} "
                "per request"
            )
        if self._max_model_len is None and self._base_model is None:
            cards = self.model_cards()
            self._max_model_len = next((m.get("max_model_len") for m in cards if m.get("parent") is None), None)
            self._base_model = next((m["id"] for m in cards if m.get("parent") is None), None)
        limit = self._max_model_len
        if limit is not None and len(r.prompt_ids) + r.params.max_new_tokens > limit:
            raise ValueError(
                f"a prompt of {len(r.prompt_ids)} tokens plus max_new_tokens {r.params.max_new_tokens} exceeds the "
                f"server's max_model_len {limit} (it would cut the completion short); shorten the prompt or "
                "rollout.max_new_tokens"
            )

    def _complete(self, policy: str, prompts: list[list[int]], n: int, params: SamplingParams,
                  seed: int | None) -> list[Completion]:
        """One ``POST /v1/completions``: ``n`` completions of each prompt, in prompt order."""
        spec = self.spec
        greedy_copies = 1
        if spec.one_group_per_request and params.temperature == 0 and n > 1:
            greedy_copies, n = n, 1  # vLLM refuses greedy n > 1; greedy samples are all the same
        body: dict[str, Any] = {
            "model": self._model_field(policy),
            "prompt": [list(p) for p in prompts] if len(prompts) > 1 else list(prompts[0]),
            "n": n,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "stop": list(params.stop),
            "ignore_eos": params.ignore_eos,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "include_stop_str_in_output": True,
        }
        if spec.explicit_fields:
            body.update(NEUTRAL_FIELDS)
        if params.min_new_tokens:  # after the neutral fields, whose min_tokens 0 would overwrite it
            body["min_tokens"] = params.min_new_tokens  # vLLM's and SGLang's name
        if seed is not None:
            body["seed"] = seed
        resp = self.request("POST", "/v1/completions", body)
        try:
            completions = post_completions(resp, len(prompts) * n, self.vocab_size)
        except ValueError as e:  # the server is broken: a failed endpoint, one line naming it
            reason = f"POST /v1/completions: malformed answer: {e}"
            raise MalformedAnswer(f"{self.base_url}: {reason}", reason=reason) from None
        if greedy_copies > 1:
            completions = [Completion(list(c.token_ids), list(c.logprobs), c.text, c.finish_reason)
                           for c in completions for _ in range(greedy_copies)]
        return completions

    def sync_weights(self, policy: str) -> None:
        """Save ``policy``'s weights to a new version folder ``adapter_dir/<adapter name>/v<N>`` and have the server
        take them: its adapter (``save_adapter``) loaded under the policy's served name (:meth:`adapter_name`), or for
        a full-weight policy (``full_weights``) the whole model (``save_weights``) reloaded in place
        (:meth:`_reload_weights`). Older version folders are deleted; then, with ``verify_logprobs``, the new version
        is checked (:meth:`verify_sync`)."""
        full = policy in self.full_weights
        save = self.save_weights if full else self.save_adapter
        if save is None or self.adapter_dir is None:
            raise ValueError(f"HTTPEngine.sync_weights needs {'save_weights' if full else 'save_adapter'} and "
                             "adapter_dir (a folder the server can read)")
        if full and not self.spec.reloads_weights:
            raise ServerError(f"server {self.base_url} ({self.dialect} dialect) cannot reload full weights; train "
                              "LoRA adapters (policy.lora), or serve with vLLM or teamrl serve")
        name = self.adapter_name(policy)
        version = self.versions.get(policy, 0) + 1
        folder = self.adapter_dir / name / f"v{version:06d}"
        save(policy, folder)
        if full:
            self._reload_weights(folder)
        else:
            prefix = self.spec.lora_prefix
            if policy in self.served:
                # vLLM refuses to load a name twice (and older versions have no load_inplace): unload, then load.
                self.request("POST", f"{prefix}/unload_lora_adapter", {"lora_name": self.served.pop(policy)})
            self.request("POST", f"{prefix}/load_lora_adapter",
                         {"lora_name": name, "lora_path": str(folder.resolve())})
            self.served[policy] = name
        self.versions[policy] = version
        for old in (self.adapter_dir / name).glob("v*"):
            if old != folder:  # the server may reload from disk (vLLM's LRU cache), so keep the current one
                shutil.rmtree(old, ignore_errors=True)
        if self.verify_logprobs is not None:
            self.verify_sync(policy)

    def _reload_weights(self, folder: Path) -> None:
        """The server reloads its weights in place from the model ``folder`` (vLLM's ``reload_weights``, through
        ``POST /collective_rpc``: vLLM needs ``VLLM_SERVER_DEV_MODE=1``), then drops the keys/values its prefix cache
        computed with the old weights."""
        try:
            self.request("POST", "/collective_rpc",
                         {"method": "reload_weights", "kwargs": {"weights_path": str(folder.resolve())}})
        except ServerError as e:
            if "HTTP 404" not in str(e):
                raise
            raise ServerError(f"{e}; the server has no weight reloading endpoint: start vLLM with the environment "
                              "variable VLLM_SERVER_DEV_MODE=1 (its POST /collective_rpc reloads full weights)"
                              ) from None
        self.request("POST", "/reset_prefix_cache")

    def verify_sync(self, policy: str) -> dict[str, float]:
        """Check that the server samples from ``policy``'s version just loaded; raise :class:`ServerError` (one
        line naming the policy and version) when it does not.

        Each probe prompt gets a greedy completion of :data:`SYNC_PROBE_TOKENS` tokens from the server;
        its log-probs (temperature 1, no top-k/top-p: those of the weights alone) must equal
        ``verify_logprobs``' (the trainer's, for the current weights) to ``verify_tolerance`` per token.
        The last check's probe, scored under the new weights, says how far the update moved the
        probe (``moved``): a stale adapter can only be told apart when that exceeds the tolerance.
        Returns (and keeps in ``sync_figures[policy]``) ``max_logprob_gap``, ``mean_logprob_gap``,
        ``moved`` (NaN at the first load), ``tokens``, ``version``, ``check_s`` (seconds in all) and
        ``server_s`` (of them, waiting for the server's probe completions).
        """
        assert self.verify_logprobs is not None
        t0 = time.perf_counter()
        version = self.versions.get(policy, 0)
        greedy = SamplingParams(max_new_tokens=SYNC_PROBE_TOKENS, temperature=0.0, ignore_eos=True)
        answers = [
            c
            for (c,) in self.generate(policy, [GenerationRequest(list(p), greedy) for p in self.probe_prompts], seed=0)
        ]
        served_s = time.perf_counter() - t0
        before = self._probes.get(policy)
        # one call (one forward: reading the weights is most of its cost on a CPU) for every probe row, this check's
        # and the last one's
        rows = answers + (before or [])
        reference = self.verify_logprobs(
            policy, [list(p) for p in self.probe_prompts] * (2 if before else 1), rows, 0.0
        )
        gaps = [abs(a - b) for c, r in zip(answers, reference) for a, b in zip(c.logprobs, r)]
        moved = [abs(a - b) for c, r in zip(before or [], reference[len(answers):]) for a, b in zip(c.logprobs, r)]
        gap = _worst(gaps)
        name = self.served_name(policy)
        if not gap <= self.verify_tolerance:  # NaN fails too
            stale = ""
            if before is not None and all(a.token_ids == b.token_ids for a, b in zip(answers, before)):
                same = max(
                    (abs(a - b) for x, y in zip(answers, before) for a, b in zip(x.logprobs, y.logprobs)), default=0.0
                )
                if same <= self.verify_tolerance:
                    stale = f"; it still answers as version {version - 1} did (to {same:.1e})"
            what = "full weights" if policy in self.full_weights else "adapter"
            raise ServerError(
                f"sync check: policy {policy!r} version {version} ({what} {name!r} at {self.base_url}): the "
                f"server's log-probs differ from the trainer's by up to {gap:.3g} on {len(gaps)} probe tokens "
                f"(tolerance {self.verify_tolerance:g}){stale}; the server is not sampling from the {what} "
                "just loaded"
            )
        self._probes[policy] = answers
        figures = {"max_logprob_gap": gap, "mean_logprob_gap": sum(gaps) / max(len(gaps), 1),
                   "moved": max(moved) if moved else math.nan, "tokens": float(len(gaps)), "version": float(version),
                   "check_s": time.perf_counter() - t0, "server_s": served_s}
        self.sync_figures[policy] = figures
        if self.log is not None:
            shift = "first load" if not moved else f"the update moved them by up to {figures['moved']:.1e}"
            if moved and figures["moved"] <= self.verify_tolerance:
                shift += " (under the tolerance: a stale adapter could not be told apart)"
            self.log(
                f"sync check: {policy} v{version} ({name}): served log-probs = trainer's to {gap:.1e} (max over "
                f"{len(gaps)} probe tokens, tolerance {self.verify_tolerance:g}); {shift}; {figures['check_s']:.2f} s "
                f"({served_s:.2f} s of it on the server)"
            )
        return figures

    def release_stale(self) -> list[str]:
        """Unload the adapters an earlier process of this run left on the server (it crashed or was killed):
        those named ``<policy>@<run>-<id>`` with this engine's ``<run>`` but another id, loaded from a
        folder under ``adapter_dir`` (so another run's adapters are never touched). Returns their names."""
        if not self.adapter_tag or self.adapter_dir is None or "-" not in self.adapter_tag:
            return []
        run = self.adapter_tag.rsplit("-", 1)[0]
        mine = str(self.adapter_dir.resolve()) + "/"
        stale = []
        for card in self.model_cards():
            name, root = str(card.get("id", "")), card.get("root")
            policy, _, tag = name.partition("@")
            if (policy and tag.startswith(f"{run}-") and tag != self.adapter_tag and isinstance(root, str)
                    and root.startswith(mine)):
                self.request("POST", f"{self.spec.lora_prefix}/unload_lora_adapter", {"lora_name": name})
                shutil.rmtree(self.adapter_dir / name, ignore_errors=True)
                stale.append(name)
        return stale

    def close(self, timeout: float = 30.0) -> None:
        """Unload this engine's adapters from the server (the end of a run, a failed check). A server that is
        gone or answers with an error is left as it is: there is nothing more to release."""
        for policy, name in list(self.served.items()):
            try:
                self.request(
                    "POST", f"{self.spec.lora_prefix}/unload_lora_adapter", {"lora_name": name}, timeout=timeout
                )
            except (ServerError, OSError):
                pass
            self.served.pop(policy, None)

    # ---- start-up check ---------------------------------------------------------------
    @property
    def processed_logprobs(self) -> bool:
        """Whether the server's log-probs are those of the distribution it sampled from after top-k/top-p (vLLM with
        ``--logprobs-mode processed_logprobs``, and SGLang as teamrl's imitation of it assumes), not before (teamrl
        serve)."""
        return self.dialect != "teamrl"

    def startup_check(self, base_model: str, policies: Sequence[str], params: SamplingParams, group_size: int,
                      prompt_ids: list[int], logprobs_of: Callable[..., list[list[float]]],
                      tolerance: float = 1e-3, seed: int = 1234) -> dict[str, float]:
        """Probe the server before training; raise :class:`ServerError` (one line) when it would train off-policy.

        Checks that the server serves ``base_model`` and every policy (load them first with
        :meth:`sync_weights`), then for each policy (the base when ``policies`` is empty) samples
        one group of ``max(group_size, 2)`` copies of ``prompt_ids`` with ``params`` (EOS ignored,
        so samples are long) and a fixed seed, the way a rollout sends it. Refuses when a sampled
        group's completions are all identical, or when any token's log-prob from the server differs
        from the trainer's by more than ``tolerance``. The trainer's are
        ``logprobs_of(policy, prompt_ids, completions, temperature)``, and for a server that reports
        log-probs after top-k/top-p (:attr:`processed_logprobs`) with ``top_k``/``top_p`` on,
        ``logprobs_of(..., temperature, top_k=K, top_p=P)``: the distribution truncated and
        renormalised the way the server sampled, so a truncation cannot hide in the tolerance.
        Returns ``distinct`` (fewest distinct samples of a group), ``group``, ``tokens`` compared,
        ``logprob_gap`` (largest per-token difference), ``logprob_mean_gap`` and ``tolerance``.
        """
        self.check_base_model(base_model)
        try:  # the run's own settings within the server's limits (stop strings, context length)
            self._check_limits(GenerationRequest(list(prompt_ids), params))
        except ValueError as e:
            raise ServerError(f"start-up check: {e}") from None
        served = self.models()
        missing = [p for p in policies if self.served_name(p) not in served and self._model_field(p) not in served
                   and self.dialect != "sglang"]
        if missing:
            raise ServerError(f"server {self.base_url} does not serve policies {missing}; it serves {served}")
        G = max(group_size, 2)
        probe = SamplingParams(max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                               top_k=params.top_k, ignore_eos=True)
        truncated = self.processed_logprobs and params.temperature > 0 and (params.top_k > 0 or params.top_p < 1)
        filters = {"top_k": params.top_k, "top_p": params.top_p} if truncated else {}
        settings = f"temperature {params.temperature}" + "".join(f", {k} {v}" for k, v in filters.items())
        all_gaps: list[float] = []
        fewest = G
        for policy in list(policies) or [base_model]:
            group = [
                c
                for (c,) in self.generate(
                    policy, [GenerationRequest(list(prompt_ids), probe, n=1) for _ in range(G)], seed=seed
                )
            ]
            distinct = len({tuple(c.token_ids) for c in group})
            if params.temperature > 0 and distinct == 1:
                raise ServerError(
                    f"start-up check: the {G} samples of one group from {self.base_url} ({self.dialect} dialect, "
                    f"policy {policy!r}) are identical; the server's seeding would make every advantage 0"
                )
            reference = logprobs_of(policy, list(prompt_ids), group, params.temperature, **filters)
            gaps = [abs(a - b) for c, r in zip(group, reference) for a, b in zip(c.logprobs, r)]
            worst = _worst(gaps)
            if not worst <= tolerance:  # NaN fails too
                hint = ("start vLLM with --logprobs-mode processed_logprobs" if self.processed_logprobs else
                        "the server must report log-probs before top-k/top-p, as teamrl serve does")
                raise ServerError(
                    f"start-up check: the server's log-probs ({self.dialect} dialect, policy {policy!r}, {settings}) "
                    f"differ from the trainer's by up to {worst:.3g} per token (mean {sum(gaps) / len(gaps):.3g} over "
                    f"{len(gaps)} tokens; tolerance {tolerance:g}, rollout.server_check_tolerance); {hint}, "
                    "and use the same model and dtype"
                )
            all_gaps += gaps
            fewest = min(fewest, distinct)
        return {"distinct": float(fewest), "group": float(G), "tokens": float(len(all_gaps)),
                "logprob_gap": max(all_gaps, default=0.0), "logprob_mean_gap": sum(all_gaps) / max(len(all_gaps), 1),
                "tolerance": tolerance}


def _worst(gaps: Sequence[float]) -> float:
    """The largest gap; NaN when any is NaN (``max`` would skip it depending on where it stands)."""
    return math.nan if any(math.isnan(g) for g in gaps) else max(gaps, default=0.0)
