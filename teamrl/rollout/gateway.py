"""The training gateway: an OpenAI-compatible endpoint whose every call is a Sample of one episode.

Agent code written against the ``openai`` package trains unchanged: each episode gets its own
base URL, ``http://HOST:PORT/episodes/<id>/v1``, and every ``chat.completions.create(model=<role>,
...)`` on it is served through that episode's context (an :class:`EpisodeHost`; the workflows'
``EpisodeContext`` is one): the request joins the generation scheduler's batch (everything in
flight shares it) and becomes a :class:`~teamrl.core.sample.Sample` of the role's policy, with the exact prompt ids
(the chat template applied here, once), the sampled completion ids and their sampling log-probs. The
response carries the token ids as vLLM does (``prompt_token_ids``; ``choices[i].token_ids``), so
nothing is ever re-tokenised. With ``tools``, an answer's tool-call text comes back as OpenAI ``tool_calls``
(parsed by ``tool_parser``, :mod:`teamrl.rollout.tool_calls`; the Sample keeps the tokens as sampled), and each chat
call that continues its agent's previous one is checked for a prefix break (:mod:`teamrl.rollout.chat_turns`).

Endpoints (per episode, under ``/episodes/<id>``): ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models`` (the roles), ``POST /reward``. Programs in other
processes drive episodes themselves: ``POST /episodes`` claims the next episode the trainer wants
run (problem, episode id, base URL, token), then they call the endpoint and post the reward.

Every per-episode request presents that episode's own token (``Authorization: Bearer <token>``, as
an OpenAI client's ``api_key``, or ``X-Episode-Token``): one episode's client cannot write into
another (403). A claim belongs to its connection: a client that leaves while waiting takes nothing.

Robustness: a call whose client disconnects before its answer is written is not recorded; an
episode that reports no reward within ``reward_timeout_s`` is dropped (its samples discarded) and
counted; a ``model`` that is no role is a 404 listing the roles; bodies, messages, prompt length
and ``n`` are bounded (Content-Length and chunked bodies alike), so is JSON nesting; the server binds
to 127.0.0.1 unless told otherwise and, with ``token``, requires ``Authorization: Bearer <token>`` on
every request (an episode's own token also opens that episode's routes). See docs/gateway.md.

This module holds the gateway itself (its episodes, claims, tokens and the batching of calls); its
HTTP side, the FastAPI app with its routes and the OpenAI response bodies, is
:mod:`teamrl.rollout.gateway_app`. FastAPI and uvicorn are imported when a gateway starts (the
``gateway`` extra).
"""


import asyncio
import hmac
import math
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Hashable

from teamrl.core.config import option
from teamrl.core.sample import Sample
from teamrl.policies.chat import render_chat, supports_tools
from teamrl.policies.router import role_type
from teamrl.rollout.asgi import (MAX_JSON_DEPTH, AsgiServer, ConnectionLimits, RequestError, request_number,
                                 short_repr)
from teamrl.rollout.chat_turns import continues, message_key, prefix_break, restore_sampled
from teamrl.rollout.engine import GenerationRequest, SamplingParams
from teamrl.rollout.gateway_episode import ClientGone, EpisodeHost, GatewayEpisode
from teamrl.rollout.tool_calls import ToolChoice, ToolParse, parse_tool_calls, parser_for
from teamrl.rollout.tool_calls import tool_choice as tool_choice_of

BATCH_WAIT_LIMIT = 10  # a call waits at most this many batch windows for others to join its batch
MAX_CLAIM_WAIT_S = 60.0  # the longest ``POST /episodes?wait=`` (seconds)
CLAIM_POLL_S = 0.2  # a waiting claim looks this often whether its client is still connected
EPISODE_PATH = re.compile(r"^/episodes/([^/]+)/")  # the routes of one episode
MAX_BREAK_NOTES = 5  # prefix breaks named on stderr per gateway (all are counted)


@dataclass(frozen=True)
class GatewayOptions:
    """The gateway's settings (``workflow.options`` of an :func:`~teamrl.api.openai_workflow`)."""

    host: str = option("127.0.0.1", doc="address the gateway binds to (127.0.0.1: this machine only)")
    port: int = option(0, ge=0, le=65535, doc="port (0: a free one, printed at start)")
    token: str = option("", doc="when set, every request needs `Authorization: Bearer <token>`")
    reward_timeout_s: float = option(
        600.0, gt=0, doc="an episode without a reward this long after it opens is dropped and counted"
    )
    batch_window_s: float = option(
        0.1,
        ge=0,
        doc="a call waits for the other live episodes' calls until for this long none "
        "has come and no answer gone out (at most 10 times this)",
    )
    max_request_bytes: int = option(1 << 20, ge=1024, doc="largest request body (413 above)")
    max_messages: int = option(256, ge=1, doc="most messages in one chat request")
    max_prompt_tokens: int = option(8192, ge=1, doc="longest prompt in tokens (400 above)")
    max_n: int = option(16, ge=1, doc="most completions per request")
    max_episodes: int = option(256, ge=1, doc="episode functions running at once (threads for sync code)")
    max_json_depth: int = option(
        MAX_JSON_DEPTH, ge=2, doc="deepest nesting of arrays/objects in a request body (400 deeper)"
    )
    header_timeout_s: float = option(
        10.0,
        gt=0,
        doc="a request's header must arrive within this long of its connection "
        "opening (or its first byte on a kept-alive one); 408 after",
    )
    body_timeout_s: float = option(
        30.0, gt=0, doc="a request's body must arrive within this long of its header; 408 after"
    )
    max_connections: int = option(
        1024,
        ge=8,
        doc="open connections held at once (at most half the open-file limit); one "
        "over it closes the oldest that has sent no complete request (503)",
    )
    min_body_rate: float = option(
        1024.0,
        gt=0,
        doc="bytes per second below which a request body in progress gives way to a new connection when "
        "the gateway is at max_connections (503)",
    )
    tool_parser: str = option(
        "hermes",
        doc="how the model writes a tool call (a registered tool-call parser: hermes for Hermes/Qwen "
        "<tool_call> blocks, llama3_json; or package.module:function); docs/gateway.md",
    )

    def __post_init__(self) -> None:
        parser_for(self.tool_parser)  # an unknown parser fails when the config loads, naming the registered ones


@dataclass
class GatewayStats:
    """Counters since the gateway started (the load test and the metrics read them)."""

    calls_recorded: int = 0
    calls_withdrawn: int = 0  # the client disconnected before the answer: nothing recorded
    episodes_dropped: int = 0  # no reward in time
    episodes_finished: int = 0
    tool_calls: int = 0  # answers returned as tool calls
    tool_calls_malformed: int = 0  # answers with tool-call text that is no valid call (returned as text)
    prefix_breaks: int = 0  # chat calls whose prompt does not hold the agent's previous turn as sampled
    calls_streamed: int = 0  # chat answers sent as server-sent events (each recorded once, whole)


class Gateway:
    """The FastAPI app on a uvicorn thread, and the table of open episodes it serves."""

    def __init__(self, options: GatewayOptions = GatewayOptions()) -> None:
        self.options = options
        self.stats = GatewayStats()
        self._episodes: dict[str, GatewayEpisode] = {}
        self._unclaimed: list[str] = []  # external episodes waiting for a client, oldest first
        self._idle: dict[asyncio.AbstractEventLoop, int] = {}  # per rollout: live episodes without a queued call
        # per rollout: when a call last came in or an answer went out (its episode's next call may follow)
        self._last_change: dict[asyncio.AbstractEventLoop, float] = {}
        self._gates: dict[asyncio.AbstractEventLoop, asyncio.Event] = {}  # per rollout; touched in its loop only
        self._lock = threading.Lock()
        # set (in the server's loop) when an external episode becomes claimable: waiting claims wake at once
        self._claimable: asyncio.Event | None = None
        self._server_loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # ---- lifetime -------------------------------------------------------------------------
    def start(self) -> str:
        """Start serving (once), on a thread; return the base URL ``http://host:port``."""
        if self._server is not None:
            return self.url
        from teamrl.rollout.gateway_app import build_app  # the app's module imports this one

        o = self.options
        limits = ConnectionLimits(
            o.header_timeout_s,
            o.body_timeout_s,
            o.max_connections,
            o.min_body_rate,
            names=tuple(f"workflow.options.{k}"  # type: ignore[arg-type]
                        for k in ("header_timeout_s", "body_timeout_s", "max_connections", "min_body_rate")),
        )
        self._server = AsgiServer(build_app(self), o.host, o.port, limits=limits)
        self._thread = threading.Thread(target=self._server.serve_forever, name="teamrl-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"gateway: uvicorn did not start on {self._server.url}")
            time.sleep(0.01)
        self.url = self._server.url
        return self.url

    def close(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ---- episodes (called from the scheduler's loop) --------------------------------------------
    def open_episode(self, ctx: EpisodeHost, roles: tuple[str, ...], problem: dict[str, Any],
                     external: bool = False) -> GatewayEpisode:
        """Register an episode of ``ctx``; an external one waits in the claim queue until a client takes it."""
        loop = asyncio.get_running_loop()
        ep = GatewayEpisode(uuid.uuid4().hex[:16], ctx, loop, tuple(roles), problem, external=external, active=False,
                            reward=loop.create_future() if external else None)
        with self._lock:
            self._episodes[ep.id] = ep
            self._update(ep, active=not external)
            if external:
                self._unclaimed.append(ep.id)
        if external:
            self._announce()
        return ep

    def episode_url(self, ep: GatewayEpisode) -> str:
        """The OpenAI base URL of one episode."""
        return f"{self.url}/episodes/{ep.id}/v1"

    def finish_episode(self, ep: GatewayEpisode, dropped: bool) -> list[Sample]:
        """Close ``ep`` (later calls get 410); its recorded samples, or none when ``dropped``."""
        with self._lock:
            self._update(ep, active=False)
            ep.closed = True
            self._episodes.pop(ep.id, None)
            if ep.id in self._unclaimed:
                self._unclaimed.remove(ep.id)
            samples = [] if dropped else list(ep.committed)
            if dropped:
                self.stats.episodes_dropped += 1
            else:
                self.stats.episodes_finished += 1
        return samples

    def _update(self, ep: GatewayEpisode, active: bool | None = None, queued: int = 0) -> None:
        """Change ``ep``'s state, keeping the count of live episodes without a queued call (hold the lock).

        An episode whose last answer is on its way back counts as idle: its next call is coming."""
        was = ep.active and ep.queued == 0 and not ep.closed
        if active is not None:
            ep.active = active
        ep.queued += queued
        now = ep.active and ep.queued == 0 and not ep.closed
        idle = self._idle.get(ep.loop, 0) + int(now) - int(was)
        if idle:
            self._idle[ep.loop] = idle
        else:
            self._idle.pop(ep.loop, None)
        if not any(e.loop is ep.loop for e in self._episodes.values()):  # the rollout is over
            self._last_change.pop(ep.loop, None)

    def claim(self) -> GatewayEpisode | None:
        """The oldest unclaimed external episode, now claimed (None when there is none)."""
        with self._lock:
            while self._unclaimed:
                ep = self._episodes.get(self._unclaimed.pop(0))
                if ep is not None and not ep.closed:
                    self._update(ep, active=True)
                    return ep
        return None

    def release(self, ep: GatewayEpisode) -> None:
        """Undo :meth:`claim` (its client left before it was handed over): ``ep`` is the next one claimed."""
        with self._lock:
            if ep.closed or ep.id in self._unclaimed:
                return
            self._update(ep, active=False)
            self._unclaimed.insert(0, ep.id)
        self._announce()

    def _announce(self) -> None:
        """Wake the waiting claims (from any thread): an episode can be claimed."""
        loop = self._server_loop
        if loop is None:
            return
        def wake() -> None:
            event, self._claimable = self._claimable, asyncio.Event()
            if event is not None:
                event.set()
        try:
            loop.call_soon_threadsafe(wake)
        except RuntimeError:  # the server has stopped
            pass

    async def claim_within(self, wait: float, disconnected: Any) -> GatewayEpisode | None:
        """Claim an episode for a client that waits up to ``wait`` seconds (None: none came); runs in the
        server's loop. ``disconnected``: an ``async () -> bool``. The claim belongs to the connection: a
        client that left while waiting gets nothing, and an episode claimed for a client found gone is
        released to the next claimer (:class:`ClientGone` is raised)."""
        if not (math.isfinite(wait) and 0 <= wait <= MAX_CLAIM_WAIT_S):
            raise RequestError(
                400, f"wait={wait!r}: expected a number of seconds from 0 to {MAX_CLAIM_WAIT_S:g}", "wait"
            )
        self._server_loop = asyncio.get_running_loop()
        deadline = time.monotonic() + wait
        while True:
            if self._claimable is None:
                self._claimable = asyncio.Event()
            arrival = self._claimable  # taken before looking, so an episode opening now still wakes this claim
            ep = self.claim()
            if await disconnected():
                if ep is not None:
                    self.release(ep)
                raise ClientGone("claim")
            if ep is not None:
                return ep
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(arrival.wait(), min(left, CLAIM_POLL_S))
            except asyncio.TimeoutError:
                pass

    def episode(self, episode_id: str, token: str | None) -> GatewayEpisode:
        """The open episode ``episode_id`` for a request that presented ``token``: 410 when it is not
        open, 401 without a token, 403 with another episode's (or any wrong) token."""
        with self._lock:
            ep = self._episodes.get(episode_id)
        if ep is None or ep.closed:
            raise RequestError(
                410,
                f"episode {episode_id!r} is not open (it ended, was dropped after the reward timeout, "
                "or never existed)",
                "episode",
            )
        if not token:
            raise RequestError(401, f"episode {episode_id!r}: send its token (given when the episode was claimed) as "
                                    "Authorization: Bearer <token> (the OpenAI client's api_key) or X-Episode-Token",
                               "authorization")
        if not hmac.compare_digest(token.encode(), ep.token.encode()):
            raise RequestError(
                403,
                f"episode {episode_id!r}: the token is not this episode's; each episode accepts only "
                "the token its claim returned",
                "authorization",
            )
        return ep

    def presented_token(self, headers: dict[bytes, bytes]) -> str | None:
        """The episode token a request presents: ``X-Episode-Token``, else its bearer token unless that
        is the gateway's own ``token``."""
        token = headers.get(b"x-episode-token")
        if token is None:
            auth = headers.get(b"authorization", b"")
            if auth[:7].lower() == b"bearer " and auth[7:].strip():
                token = auth[7:].strip()
                if self.options.token and hmac.compare_digest(token, self.options.token.encode()):
                    return None
        return token.decode("latin-1") if token is not None else None

    def check_episode_header(self, scope: dict, headers: dict[bytes, bytes]) -> None:
        """A request on one episode's routes must present that episode's token (:meth:`episode`'s 410/401/403):
        checked on the header, so that a client without it cannot hold a connection waiting for its body."""
        match = EPISODE_PATH.match(scope.get("path", ""))
        if match is not None:
            self.episode(match.group(1), self.presented_token(headers))

    def authorizes(self, scope: dict, headers: dict[bytes, bytes]) -> bool:
        """For a gateway with a ``token``: a request on one episode's routes with that episode's own token
        passes too (the token was handed out by an authorised claim, or to the in-process client)."""
        match = EPISODE_PATH.match(scope.get("path", ""))
        token = self.presented_token(headers)
        if match is None or not token:
            return False
        with self._lock:
            ep = self._episodes.get(match.group(1))
        return ep is not None and hmac.compare_digest(token.encode(), ep.token.encode())

    # ---- one call ----------------------------------------------------------------------------
    def check_role(self, ep: GatewayEpisode, model: str) -> str:
        """``model`` as a role of ``ep`` (a role type or an instance of one, e.g. ``worker2``); 404 otherwise."""
        if model in ep.roles or role_type(model) in ep.roles:
            return model
        raise RequestError(404, f"model {model!r} is not a role of this team; the roles are {list(ep.roles)}", "model")

    async def _join_batch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait at the rollout's gate: it opens for every waiting call at once (so they reach the
        scheduler in one batch) when every live episode has a call queued, or when for ``batch_window_s``
        no call has come and no answer gone out (at most ``BATCH_WAIT_LIMIT`` windows after it formed):
        calls that trickle in, and the next calls of episodes just answered, join one batch."""
        gate = self._gates.get(loop)
        if gate is None:
            gate = self._gates[loop] = asyncio.Event()
            asyncio.ensure_future(self._open_gate(loop, gate))
        await gate.wait()

    async def _open_gate(self, loop: asyncio.AbstractEventLoop, gate: asyncio.Event) -> None:
        window = self.options.batch_window_s
        give_up = time.monotonic() + BATCH_WAIT_LIMIT * window
        try:
            while True:
                now = time.monotonic()
                with self._lock:
                    idle, last = self._idle.get(loop, 0), self._last_change.get(loop, 0.0)
                if not idle or now - last >= window or now >= give_up:
                    break
                await asyncio.sleep(0.002)
        finally:  # also when the rollout ends under it
            self._gates.pop(loop, None)  # later calls form the next gate
            gate.set()

    async def _generate(self, ep: GatewayEpisode, role: str, prompt: Any, chat: bool, tools: list | None,
                        params: SamplingParams, n: int) -> list[Sample]:
        """Runs in the scheduler's loop: encode once, join the batch, return unrecorded Samples."""
        tok = ep.ctx.tokenizer
        if chat:
            if not supports_tools(tok):  # the fallback rendering shows the model its own tool-call text
                with self._lock:
                    prompt = restore_sampled(prompt, ep.sampled)
            prompt_text = render_chat(tok, prompt, tools=tools)  # the template, applied once, here
            prompt_ids = tok(prompt_text, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, str):
            prompt_ids, prompt_text = tok(prompt, add_special_tokens=False)["input_ids"], prompt
        else:
            bad = [t for t in prompt if not 0 <= t < len(tok)]
            if bad:
                raise RequestError(
                    400, f"prompt: token id {bad[0]} is outside the tokenizer's vocabulary [0, {len(tok)})", "prompt"
                )
            prompt_ids, prompt_text = list(prompt), tok.decode(prompt)
        if len(prompt_ids) > self.options.max_prompt_tokens:
            raise RequestError(
                400,
                f"the prompt is {len(prompt_ids)} tokens; this gateway accepts at most "
                f"{self.options.max_prompt_tokens} (workflow.options.max_prompt_tokens)",
                "messages",
            )
        if not prompt_ids:
            raise RequestError(400, "the prompt is empty; send at least one token", "prompt")
        with self._lock:
            self._update(ep, queued=1)
            self._last_change[ep.loop] = time.monotonic()
        try:
            await self._join_batch(ep.loop)
            policy = ep.ctx.route(role)
            completions = await ep.ctx.scheduler.generate(policy, GenerationRequest(prompt_ids, params, n=n))
        finally:
            with self._lock:
                self._update(ep, queued=-1)
                self._last_change[ep.loop] = time.monotonic()
        return [
            Sample(
                role=role,
                policy=policy,
                problem_id=ep.ctx.problem_id,
                prompt_ids=list(prompt_ids),
                completion_ids=c.token_ids,
                sampling_logprobs=c.logprobs,
                text=c.text,
                finish_reason=c.finish_reason,
                episode=ep.ctx.episode,
                branch=j,
                temperature=params.temperature,
                prompt_text=prompt_text,
                tags={**ep.ctx.tags, "gateway_episode": ep.id},
            )
            for j, c in enumerate(completions)
        ]

    def _commit(self, ep: GatewayEpisode, samples: list[Sample], messages: list | None = None,
                choice: ToolChoice | None = None) -> list[ToolParse | None] | None:
        """Record ``samples`` (the answer is about to be written); None when the episode has closed. A chat
        call's answers are parsed for tool calls (per ``choice``) and its prompt checked for a prefix break."""
        parses = [self._parse(s, choice) if messages is not None else None for s in samples]
        with self._lock:
            if ep.closed:
                return None
            turn = sum(1 for s in ep.committed if s.role == samples[0].role and s.branch == 0)
            for s, parse in zip(samples, parses):
                s.turn = turn  # the role's k-th answered call: groups compare the k-th calls of G episodes
                if parse is not None and parse.errors:
                    self.stats.tool_calls_malformed += 1
                if parse is not None and parse.calls:
                    self.stats.tool_calls += 1
                    ep.sampled.update((c["id"], s.text) for c in parse.calls)
            if messages is not None:
                self._check_prefix(ep, samples, messages, turn)
            ep.committed += samples
            self.stats.calls_recorded += 1
        return parses

    def _parse(self, sample: Sample, choice: ToolChoice | None) -> ToolParse | None:
        """``sample``'s text parsed for tool calls (None: the request offered no tools); what it found goes into
        ``sample.tags`` (``tool_calls``: the names, ``tool_call_errors``), for the reward and the logs."""
        if choice is None or not choice.parses:
            return None
        # the ids: one per sampled call, the same for the same sample (streamed and whole answers agree), another
        # for the same tokens sampled in another episode or as another choice of the request
        parse = parse_tool_calls(sample.text, parser_for(self.options.tool_parser), choice,
                                 [*sample.prompt_ids, -1, *sample.completion_ids, -2, sample.episode, sample.branch])
        sample.tags.update(parse.info())
        return parse

    def _check_prefix(self, ep: GatewayEpisode, samples: list[Sample], messages: list, turn: int) -> None:
        """Count (and tag) a prefix break: the call continues the role's previous call, but its prompt is not that
        call's prompt + completion token for token (hold the lock)."""
        role = samples[0].role
        previous = ep.last_call.get(role)
        if previous is not None and continues(previous[0], messages):
            eos = [ep.ctx.tokenizer.eos_token_id]
            at = prefix_break(samples[0].prompt_ids, previous[1], previous[2], eos)
            if at is not None:
                self.stats.prefix_breaks += 1
                for s in samples:
                    s.tags["prefix_break"] = {"role": role, "turn": turn, "token": at}
                if self.stats.prefix_breaks <= MAX_BREAK_NOTES:
                    print(f"teamrl gateway: prefix break: role {role!r} turn {turn} (episode {ep.id}): the prompt "
                          f"differs from its previous prompt + sampled answer at token {at}; the chat template or the "
                          "framework re-renders that answer (docs/gateway.md, 'Prefix breaks')", file=sys.stderr)
        ep.last_call[role] = ([message_key(m) for m in messages], list(samples[0].prompt_ids),
                              [list(s.completion_ids) for s in samples])

    async def serve_call(self, ep: GatewayEpisode, role: str, prompt: Any, chat: bool, tools: list | None,
                         max_tokens: int | None, stop: list[str], n: int, disconnected: Any,
                         tool_choice: Any = None) -> tuple[list[Sample], list[ToolParse | None]]:
        """Generate for one request (in the episode's scheduler loop) and record it unless the client left;
        the Samples and, for a chat call with ``tools``, each answer's tool calls (per ``tool_choice``).

        ``disconnected``: an ``async () -> bool`` polled while waiting. A client gone before the
        answer is ready gets nothing recorded (counted in ``stats.calls_withdrawn``)."""
        choice = tool_choice_of(tools, tool_choice) if chat else None
        if not 1 <= n <= self.options.max_n:
            raise RequestError(
                400, f"n={n}: this gateway samples 1 to {self.options.max_n} completions per request", "n"
            )
        base = ep.ctx.params
        limit = base.max_new_tokens if max_tokens is None else min(max_tokens, base.max_new_tokens)
        params = SamplingParams(max_new_tokens=limit, temperature=base.temperature, top_p=base.top_p, top_k=base.top_k,
                                stop=tuple(dict.fromkeys((*base.stop, *stop))), ignore_eos=base.ignore_eos)
        if ep.closed:
            raise RequestError(410, f"episode {ep.id!r} is not open", "episode")
        try:
            future = asyncio.run_coroutine_threadsafe(self._generate(ep, role, prompt, chat, tools, params, n), ep.loop)
        except RuntimeError as e:  # the rollout's loop has closed: the episode ended as the call came in
            raise RequestError(410, f"episode {ep.id!r} ended during the call", "episode") from e
        waiting = asyncio.wrap_future(future)
        gone = False
        while not waiting.done():
            done, _ = await asyncio.wait([waiting], timeout=0.05)
            if not done and await disconnected():
                gone = True  # let the generation finish (it shares a batch), then drop its result
        try:
            samples = waiting.result()
        except asyncio.CancelledError as e:  # the rollout ended under the call
            raise RequestError(410, f"episode {ep.id!r} ended during the call ({type(e).__name__})", "episode") from e
        if gone or await disconnected():
            with self._lock:
                self.stats.calls_withdrawn += 1
            raise ClientGone(ep.id)
        parses = self._commit(ep, samples, prompt if chat else None, choice)
        if parses is None:
            raise RequestError(410, f"episode {ep.id!r} closed during the call (reward timeout?)", "episode")
        return samples, parses

    def post_reward(self, ep: GatewayEpisode, body: dict[str, Any]) -> None:
        """An external episode's reward: resolves the episode in the scheduler's loop."""
        if not ep.external:
            raise RequestError(
                400, f"episode {ep.id!r} runs an episode function: its reward is what the function returns", "episode"
            )
        value = parse_reward(body, ep.roles)
        with self._lock:
            if ep.rewarded:
                raise RequestError(409, f"episode {ep.id!r}: its reward was already posted", "episode")
            ep.rewarded = True
        ep.loop.call_soon_threadsafe(lambda: ep.reward.done() or ep.reward.set_result(value))


def parse_reward(value: Any, roles: tuple[str, ...]) -> tuple[float, dict[str, float], bool | None]:
    """A reward as (team reward, per-role rewards, correct or None).

    Accepted: a number (the team's reward) or ``{"reward": number, "roles": {role: number}, "correct": bool}``
    (``roles`` and ``correct`` optional)."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"reward", "roles", "correct"})
        if unknown or "reward" not in value:
            raise RequestError(
                400,
                f"reward: expected {{'reward': number, 'roles': {{role: number}}, 'correct': bool}}; got keys "
                f"{sorted(value)}",
                "reward",
            )
        per_role = value.get("roles")
        if per_role is None:  # absent or null; [] and false are no mapping (they were taken as "no roles")
            per_role = {}
        if not isinstance(per_role, dict) or any(role_type(r) not in roles and r not in roles for r in per_role):
            raise RequestError(
                400,
                f"reward.roles: expected a mapping of this team's roles {list(roles)} to numbers; got "
                f"{short_repr(per_role)}",
                "reward.roles",
            )
        correct = value.get("correct")
        if correct is not None and not isinstance(correct, bool):
            raise RequestError(400, f"reward.correct: expected true or false; got {correct!r}", "reward")
        return (
            _number(value["reward"], "reward"),
            {r: _number(v, f"reward.roles.{r}") for r, v in per_role.items()},
            correct,
        )
    return _number(value, "reward"), {}, None


FLOAT32_MAX = 3.4028234663852886e38  # the trainer holds rewards in float32 tensors: a larger one becomes inf there


def _number(value: Any, name: str) -> float:
    """``value`` as a float the trainer can hold: finite in float32, or a 400 naming ``name`` and the range."""
    return request_number(value, name, f"a finite number within float32's range (|x| <= {FLOAT32_MAX:.7g})",
                          bound=FLOAT32_MAX)


_GATEWAYS: dict[Hashable, Gateway] = {}
_GATEWAYS_LOCK = threading.Lock()


def shared_gateway(options: GatewayOptions) -> Gateway:
    """The process's started gateway for ``options`` (one server across every rollout of a run)."""
    with _GATEWAYS_LOCK:
        gw = _GATEWAYS.get(options)
        if gw is None:
            gw = _GATEWAYS[options] = Gateway(options)
            url = gw.start()
            print(f"teamrl gateway: serving episodes on {url} (POST {url}/episodes claims one)", file=sys.stderr)
        return gw
