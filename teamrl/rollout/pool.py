"""A pool of rollout endpoints: several engines (in practice :class:`~teamrl.rollout.http_engine.HTTPEngine`
clients of vLLM, SGLang or ``teamrl serve`` servers) behind the one :class:`~teamrl.rollout.engine.Engine` interface.

**Spreading.** One ``generate(policy, requests, seed)`` call is cut into chunks, one per live endpoint:
the requests are grouped by prompt and sampling settings (a group of identical prompts stays on one
endpoint, so a vLLM server still samples it as one prompt with ``n = group size``), and group ``g`` goes
to live endpoint ``(g + seed) mod L`` (``L`` live endpoints; the seed's offset spreads calls of few
groups over the pool). Chunk ``j`` (the ``j``-th live endpoint) is generated with the seed
``derive_seed(seed, j)``. So for a fixed seed and number of endpoints the assignment and the seeds are
fixed, and the samples are those of the servers for those seeds; they **depend on the number of
live endpoints** (a run on 2 endpoints does not sample what a run on 1 does, and a run that lost an
endpoint samples from then on what a smaller pool would). ``generate_many`` sends every chunk of every
policy at once, each on its own thread.

**Weights.** ``sync_weights(policy)`` syncs every live endpoint at once (each saves the adapter to its
own folder, loads it on its server and, with the sync check on, verifies it); the trainer's
reference log-probs of one check are computed once and shared by the endpoints (one forward, under a
lock). ``sync_figures[policy]`` holds the worst figures over the endpoints (largest gaps, smallest
``moved``, summed ``tokens``) and each endpoint's ``endpoint<i>/max_logprob_gap`` and ``endpoint<i>/check_s``,
so the trainer's ``sync/<policy>/*`` metrics cover every endpoint.

**A failed endpoint.** A connection refused or reset, no answer within the read timeout or no complete one within
``rollout.request_deadline_s`` (:class:`~teamrl.rollout.completions_api.ServerUnreachable`, ``ConnectionError``,
``TimeoutError``), or a 200 answer that is no completions answer
(:class:`~teamrl.rollout.completions_api.MalformedAnswer`) marks the endpoint dead; so does its process exiting
(``exited``: a managed server) or its ``/health`` not answering :data:`PROBE_FAILURES` times in a row within
:data:`HEALTH_TIMEOUT_S` while a call waits on it (a host that is gone: nothing refuses, the request would wait
for its whole timeout). One line names it
(``rollout endpoint 2 of 2 (URL) failed: <reason>; continuing on 1 endpoint``) and its share of the
call is re-sent to the live ones, spread the same way (seeds derived from the chunk's seed and the
round). With ``on_failure="stop"``, or when no endpoint is left, :class:`EndpointFailed` is raised
instead, one line naming the endpoint(s). A dead endpoint gets no more requests and no more weights.
An endpoint that answers with an error (HTTP 4xx/5xx, a failed sync check) is not a dead endpoint: the
error is raised as it is.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

from teamrl.core.seeding import derive_seed
from teamrl.rollout.completions_api import MalformedAnswer, ServerError, ServerUnreachable
from teamrl.rollout.engine import Completion, Engine, GenerationRequest

ON_FAILURE = ("continue", "stop")
# What marks an endpoint dead: it cannot be reached, or gave no complete answer within rollout.request_deadline_s
# (any Engine may raise the two builtins for the same), or its 200 answer was no completions answer (a proxy's
# HTML page, missing fields, token ids outside the vocabulary).
ENDPOINT_FAILURES = (ServerUnreachable, MalformedAnswer, ConnectionError, TimeoutError)
HEALTH_TIMEOUT_S = 3.0  # one /health probe's limit
PROBE_AFTER_S = 2.0     # a call that waits longer than this on an endpoint has the endpoint's /health probed ...
PROBE_EVERY_S = 2.0     # ... this often ...
PROBE_FAILURES = 2      # ... and this many probes failing in a row mark it dead
WAIT_SLICE_S = 0.25     # how often a waiting call looks at its endpoints' processes and probes
CLOSE_WAIT_S = 30.0     # how long close() waits for calls still in flight (a stopped pool's other endpoints)


class EndpointFailed(ServerError):
    """An endpoint failed and the run cannot go on (``rollout.on_endpoint_failure=stop``, or none is left)."""


@dataclass
class Endpoint:
    """One engine of the pool and what the pool knows of it."""

    engine: Engine
    name: str                                     # its URL, or a description
    index: int                                    # 1-based, as the log lines count
    exited: Callable[[], str | None] | None = None  # why its server process is gone (None: running, or unknown)
    live: bool = True
    reason: str = ""                              # why it was marked dead
    probe_failures: int = 0
    last_probe: float = -math.inf


@dataclass
class _Chunk:
    """The part of one call (``call``: its position in ``generate_many``) sent to one endpoint."""

    call: int
    endpoint: Endpoint
    indices: list[int]
    seed: int | None


def request_groups(requests: Sequence[GenerationRequest]) -> list[list[int]]:
    """Indices of ``requests`` grouped by (sampling settings, prompt), groups in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault((r.params, tuple(r.prompt_ids)), []).append(i)
    return list(groups.values())


def spread(
    requests: Sequence[GenerationRequest], seed: int | None, endpoints: Sequence[Any]
) -> list[tuple[Any, list[int], int | None]]:
    """The deterministic assignment of one call to ``endpoints`` (see the module docstring): for each endpoint that
    gets any, ``(endpoint, request indices in call order, its chunk's seed)``."""
    if not endpoints:
        raise ValueError("spread: no endpoint to send the requests to")
    L = len(endpoints)
    offset = seed % L if seed is not None else 0
    chunks: list[list[int]] = [[] for _ in endpoints]
    for g, idx in enumerate(request_groups(requests)):
        chunks[(g + offset) % L].extend(idx)
    return [(ep, sorted(idx), None if seed is None else derive_seed(seed, j))
            for j, (ep, idx) in enumerate(zip(endpoints, chunks)) if idx]


def _reason(e: BaseException) -> str:
    """A failure in a few words: an unreachable server's own reason
    (``POST /v1/completions: [Errno 111] Connection refused``)."""
    return getattr(e, "reason", "") or f"{type(e).__name__}: {e}"


class EnginePool(Engine):
    """Several engines as one (module docstring). ``names``: each engine's URL for the log lines (default: its
    ``base_url``); ``on_failure``: ``continue`` (go on with the live endpoints) or ``stop``; ``log`` gets the
    one line per failed endpoint; ``exited[i]`` (optional) says why engine ``i``'s server process is gone,
    or None while it runs."""

    def __init__(self, engines: Sequence[Engine], names: Sequence[str] | None = None, on_failure: str = "continue",
                 log: Callable[[str], Any] | None = None,
                 exited: Sequence[Callable[[], str | None] | None] | None = None) -> None:
        if not engines:
            raise ValueError("EnginePool: give at least one engine")
        if on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure {on_failure!r}: choose one of {list(ON_FAILURE)}")
        names = (
            list(names)
            if names is not None
            else [str(getattr(e, "base_url", f"engine {i + 1}")) for i, e in enumerate(engines)]
        )
        exited = list(exited) if exited is not None else [None] * len(engines)
        if len(names) != len(engines) or len(exited) != len(engines):
            raise ValueError("EnginePool: names and exited need one entry per engine")
        self.endpoints = [Endpoint(e, n, i + 1, x) for i, (e, n, x) in enumerate(zip(engines, names, exited))]
        self.on_failure = on_failure
        self.log = log
        self.sync_figures: dict[str, dict[str, float]] = {}
        self.requests_sent = [0] * len(engines)  # chunks each endpoint answered (tests, diagnostics)
        self._state = threading.Lock()
        self._reference = threading.Lock()
        self._reference_cache: dict[tuple, list[list[float]]] = {}
        self._threads: list[threading.Thread] = []  # the calls' threads; close() waits for those still running
        for ep in self.endpoints:  # the endpoints share the trainer's model: one forward at a time, each done once
            verify = getattr(ep.engine, "verify_logprobs", None)
            if verify is not None:
                ep.engine.verify_logprobs = partial(self._shared_reference, verify)
            for saver in ("save_adapter", "save_weights"):
                save = getattr(ep.engine, saver, None)
                if save is not None:
                    setattr(ep.engine, saver, partial(self._locked, save))

    # ---- the endpoints ------------------------------------------------------------------
    @property
    def engines(self) -> list[Engine]:
        """Every engine of the pool, live or not, in order."""
        return [ep.engine for ep in self.endpoints]

    @property
    def live(self) -> list[Endpoint]:
        """The endpoints still in use, in order."""
        return [ep for ep in self.endpoints if ep.live]

    def metrics(self) -> dict[str, float]:
        """``pool/endpoints_live`` and ``pool/endpoints`` (for the step's record)."""
        return {"pool/endpoints_live": float(len(self.live)), "pool/endpoints": float(len(self.endpoints))}

    def _say(self, line: str) -> None:
        if self.log is not None:
            self.log(line)

    def fail(self, ep: Endpoint, reason: str) -> None:
        """Mark ``ep`` dead and say so in one line; raise :class:`EndpointFailed` with ``on_failure=stop`` or when
        no endpoint is left."""
        with self._state:
            if not ep.live:
                return
            ep.live, ep.reason = False, reason
            left = self.live
        head = f"rollout endpoint {ep.index} of {len(self.endpoints)} ({ep.name}) failed: {reason}"
        if self.on_failure == "stop":
            raise EndpointFailed(f"{head}; stopping (rollout.on_endpoint_failure=stop)")
        if not left:
            earlier = "; ".join(
                f"endpoint {e.index} ({e.name}) failed earlier: {e.reason}" for e in self.endpoints if e is not ep
            )
            raise EndpointFailed(f"{head}; no rollout endpoint is left" + (f" ({earlier})" if earlier else ""))
        self._say(f"{head}; continuing on {len(left)} endpoint{'s' if len(left) > 1 else ''}")

    def _watch(self, waiting: set[int], since: float) -> None:
        """While a call waits on the endpoints ``waiting`` (indices): a managed server whose process exited is dead at
        once; one that has not answered for :data:`PROBE_AFTER_S` gets its ``/health`` probed."""
        now = time.monotonic()
        for ep in self.endpoints:
            if ep.index not in waiting or not ep.live:
                continue
            why = ep.exited() if ep.exited is not None else None
            if why:
                self.fail(ep, why)
                continue
            health = getattr(ep.engine, "health", None)
            if health is None or now - since < PROBE_AFTER_S or now - ep.last_probe < PROBE_EVERY_S:
                continue
            ep.last_probe = now
            try:
                health(timeout=HEALTH_TIMEOUT_S)
                ep.probe_failures = 0
            except ServerUnreachable as e:  # an error status means it answers: alive
                ep.probe_failures += 1
                if ep.probe_failures >= PROBE_FAILURES:
                    self.fail(
                        ep,
                        f"no answer to GET /health {ep.probe_failures} times in a row within {HEALTH_TIMEOUT_S:g} s "
                        f"({_reason(e)})",
                    )
            except ServerError:
                ep.probe_failures = 0

    def _run(self, jobs: Sequence[tuple[Endpoint, Callable[[], Any]]]) -> list[tuple[bool, Any]]:
        """Run each job (an endpoint and a call on it) on its own thread; returns ``(True, value)`` per job that ended,
        ``(False, None)`` per job whose endpoint failed (marked dead, said in one line). Any other error is raised.
        A job of a dead endpoint is abandoned (its daemon thread may still end later; its answer is dropped)."""
        answers: queue.Queue = queue.Queue()

        def work(k: int, fn: Callable[[], Any]) -> None:
            try:
                answers.put((k, True, fn()))
            except BaseException as e:  # handed to the waiting thread
                answers.put((k, False, e))

        self._threads = [t for t in self._threads if t.is_alive()]
        for k, (ep, fn) in enumerate(jobs):
            thread = threading.Thread(target=work, args=(k, fn), daemon=True, name=f"teamrl-pool-endpoint{ep.index}")
            thread.start()
            self._threads.append(thread)
        out: list[tuple[bool, Any]] = [(False, None)] * len(jobs)
        pending = set(range(len(jobs)))
        since = time.monotonic()
        while pending:
            try:
                k, ok, value = answers.get(timeout=WAIT_SLICE_S)
            except queue.Empty:
                self._watch({jobs[k][0].index for k in pending}, since)
                pending -= {k for k in pending if not jobs[k][0].live}
                continue
            if k not in pending:
                continue
            pending.discard(k)
            ep = jobs[k][0]
            if ok:
                out[k] = (True, value)
            elif isinstance(value, ENDPOINT_FAILURES):
                self.fail(ep, _reason(value))
            elif not ep.live:  # it failed some other way after it was given up
                continue
            else:
                raise value
        return out

    # ---- Engine ----------------------------------------------------------------------------
    def generate(
        self, policy: str, requests: Sequence[GenerationRequest], seed: int | None = None
    ) -> list[list[Completion]]:
        """Completions for ``requests`` from ``policy``, spread over the live endpoints (module docstring)."""
        return self.generate_many([(policy, requests, seed)])[0]

    def generate_many(
        self, calls: Sequence[tuple[str, Sequence[GenerationRequest], int | None]]
    ) -> list[list[list[Completion]]]:
        """Every chunk of every call at once; each call's answers are what its own :meth:`generate` returns."""
        results: list[list[list[Completion] | None]] = [[None] * len(requests) for _, requests, _ in calls]
        chunks = [_Chunk(c, ep, idx, s) for c, (_, requests, seed) in enumerate(calls)
                  for ep, idx, s in spread(requests, seed, self._live_or_raise())]
        attempt = 0
        while chunks:
            jobs = [(ch.endpoint, partial(ch.endpoint.engine.generate, calls[ch.call][0],
                                          [calls[ch.call][1][i] for i in ch.indices], ch.seed)) for ch in chunks]
            again: list[_Chunk] = []
            attempt += 1
            for ch, (ok, completions) in zip(chunks, self._run(jobs)):
                if ok:
                    for i, c in zip(ch.indices, completions):
                        results[ch.call][i] = c
                    self.requests_sent[ch.endpoint.index - 1] += 1
                    continue
                # the endpoint failed: its share goes to the live ones, spread the same way
                requests = calls[ch.call][1]
                sub = [requests[i] for i in ch.indices]
                seed = None if ch.seed is None else derive_seed(ch.seed, attempt)
                again += [_Chunk(ch.call, ep, [ch.indices[i] for i in idx], s)
                          for ep, idx, s in spread(sub, seed, self._live_or_raise())]
            chunks = again
        return results  # type: ignore[return-value]

    def _live_or_raise(self) -> list[Endpoint]:
        live = self.live
        if not live:
            raise EndpointFailed(
                "no rollout endpoint is left: "
                + "; ".join(f"endpoint {e.index} ({e.name}) failed: {e.reason}" for e in self.endpoints)
            )
        return live

    def sync_weights(self, policy: str) -> None:
        """Sync ``policy`` on every live endpoint at once (each runs its own sync check when it has one); a dead
        endpoint is not synced. Keeps ``sync_figures[policy]`` (module docstring)."""
        with self._reference:
            self._reference_cache.clear()  # new weights: the reference log-probs of the last sync are stale
        live = self._live_or_raise()
        answers = self._run([(ep, partial(ep.engine.sync_weights, policy)) for ep in live])
        per = {ep.index: getattr(ep.engine, "sync_figures", {}).get(policy)
               for ep, (ok, _) in zip(live, answers) if ok}
        per = {i: f for i, f in per.items() if f}
        if not per:
            return
        worst: dict[str, float] = {}
        for f in per.values():
            for k, v in f.items():
                if k == "tokens":
                    worst[k] = worst.get(k, 0.0) + v
                elif k == "moved":  # the least an update moved the probe: the weakest stale-adapter check
                    worst[k] = (
                        v
                        if k not in worst or math.isnan(worst[k])
                        else (worst[k] if math.isnan(v) else min(worst[k], v))
                    )
                else:
                    worst[k] = v if k not in worst else max(worst[k], v)
        for i, f in per.items():
            for k in ("max_logprob_gap", "check_s"):
                if k in f:
                    worst[f"endpoint{i}/{k}"] = f[k]
        worst["endpoints_synced"] = float(len(per))
        self.sync_figures[policy] = worst

    def _shared_reference(self, fn: Callable[..., list[list[float]]], policy: str, prompts: Any, completions: Any,
                          temperature: float, **kwargs: Any) -> list[list[float]]:
        """The trainer's log-probs for a sync check, computed once per weights and rows for all endpoints."""
        # the function by what it is (each endpoint holds its own bound-method object of the trainer's one method)
        key = (id(getattr(fn, "__self__", None)), id(getattr(fn, "__func__", fn)), policy,
               tuple(tuple(p) if isinstance(p, (list, tuple)) else p for p in prompts),
               tuple(tuple(c.token_ids) for c in completions), temperature, tuple(sorted(kwargs.items())))
        with self._reference:
            if key not in self._reference_cache:
                self._reference_cache[key] = fn(policy, prompts, completions, temperature, **kwargs)
            return [list(row) for row in self._reference_cache[key]]

    def _locked(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._reference:
            return fn(*args)

    def close(self) -> None:
        """Wait (up to :data:`CLOSE_WAIT_S`) for the calls still in flight, then close every live endpoint (unload this
        run's adapters); a dead one is left as it is."""
        # a stop leaves the other endpoints' calls running; a daemon thread still inside native code (torch, the
        # tokenizer) when the interpreter ends aborts the process ('terminate called without an active exception')
        ends = time.monotonic() + CLOSE_WAIT_S
        for thread in self._threads:
            thread.join(max(0.0, ends - time.monotonic()))
        left = [t.name for t in self._threads if t.is_alive()]
        if left:
            self._say(f"{len(left)} rollout call(s) still running after {CLOSE_WAIT_S:g} s are abandoned "
                      f"({', '.join(left)})")
        self._threads = []
        errors = []
        for ep in self.live:
            close = getattr(ep.engine, "close", None)
            if close is None:
                continue
            try:
                close()
            except Exception as e:  # close the others all the same
                errors.append(e)
        if errors:
            raise errors[0]
