"""The gateway's HTTP side: its FastAPI app (routes, request schemas) and the OpenAI response bodies.

The routes (under ``/episodes/<id>``, and ``POST /episodes`` to claim one) serve a
:class:`~teamrl.rollout.gateway.Gateway`: they check the episode's token, validate the body against the
pydantic schemas here, and hand the call to the gateway. The answers are OpenAI's ``chat.completion`` and
``text_completion`` bodies with vLLM's token-id fields (``prompt_token_ids``; ``choices[i].token_ids``), tool calls in
``message.tool_calls``; ``stream: true`` on chat sends the whole recorded answer as ``chat.completion.chunk`` events.

FastAPI and uvicorn are imported when a gateway starts (the ``gateway`` extra).
"""

import json
import time
import uuid
from typing import Any, Iterator, Sequence

from teamrl.core.sample import Sample
from teamrl.rollout.asgi import Guard, RequestError, json_errors, require_asgi
from teamrl.rollout.gateway_episode import ClientGone, GatewayEpisode
from teamrl.rollout.tool_calls import ToolParse


# vLLM/OpenAI finish reasons from the engine's
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def _content_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for p in content:
        if not isinstance(p, dict) or p.get("type") != "text":
            raise RequestError(400, f"messages: content part {p!r} is not supported; send text parts only", "messages")
        parts.append(str(p.get("text", "")))
    return "".join(parts)


def chat_response(role: str, samples: list[Sample], tokenizer: Any, logprobs: bool,
                  parses: Sequence[ToolParse | None] = ()) -> dict[str, Any]:
    """The ``chat.completion`` body, with vLLM's token-id fields; an answer parsed as tool calls (``parses``)
    carries them in ``message.tool_calls`` with ``finish_reason: "tool_calls"``."""
    choices = []
    for j, s in enumerate(samples):
        parse = parses[j] if j < len(parses) else None
        message: dict[str, Any] = {"role": "assistant", "content": s.text}
        if parse is not None and parse.calls:
            message = {"role": "assistant", "content": parse.content, "tool_calls": parse.calls}
        choice: dict[str, Any] = {
            "index": j,
            "message": message,
            "finish_reason": (parse and parse.finish_reason) or FINISH.get(s.finish_reason, s.finish_reason),
            "token_ids": list(s.completion_ids),
            "logprobs": None,
        }
        if logprobs:
            choice["logprobs"] = {
                "content": [
                    {"token": tokenizer.convert_ids_to_tokens(t), "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(s.completion_ids, s.sampling_logprobs)
                ]
            }
        choices.append(choice)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": role,
        "choices": choices,
        "prompt_token_ids": list(samples[0].prompt_ids),
        "usage": _usage(samples),
    }


def completion_response(role: str, samples: list[Sample], tokenizer: Any, logprobs: bool) -> dict[str, Any]:
    """The ``text_completion`` body, with vLLM's token-id fields."""
    choices = []
    for j, s in enumerate(samples):
        lp = None
        if logprobs:
            lp = {
                "tokens": tokenizer.convert_ids_to_tokens(list(s.completion_ids)),
                "token_logprobs": list(s.sampling_logprobs),
                "top_logprobs": None,
                "text_offset": None,
            }
        choices.append({"index": j, "text": s.text, "finish_reason": FINISH.get(s.finish_reason, s.finish_reason),
                        "token_ids": list(s.completion_ids), "prompt_token_ids": list(s.prompt_ids), "logprobs": lp})
    return {
        "id": f"cmpl-{uuid.uuid4().hex[:24]}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": role,
        "choices": choices,
        "usage": _usage(samples),
    }


def _text_pieces(text: str, ids: Sequence[int], tokenizer: Any) -> Iterator[str]:
    """``text`` in the pieces its tokens decode to, one per token where a token ends a whole character (their
    concatenation is ``text``; what the tokens do not spell, e.g. a cut stop string, is sent last). Decoded
    incrementally as vLLM does: each new piece is the text of a short window of tokens minus that of the window
    without the new ones (a tokenizer's leading-space rules stay right), so a long answer costs linear time."""
    sent, start, read = 0, 0, 0
    for k in range(1, len(ids) + 1):
        before = tokenizer.decode(ids[start:read], skip_special_tokens=True)
        after = tokenizer.decode(ids[start:k], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            continue  # no whole new character yet
        piece = after[len(before):]
        if text.startswith(piece, sent):
            yield piece
            sent += len(piece)
        start, read = read, k
    if sent < len(text):
        yield text[sent:]


def chat_chunks(body: dict[str, Any], samples: list[Sample], tokenizer: Any, include_usage: bool) -> Iterator[str]:
    """The server-sent events of a streamed chat answer, from the whole answer ``body`` (:func:`chat_response`):
    per choice a role delta, its content in token pieces, its tool calls (one delta each: id, name, arguments),
    a last chunk with its ``finish_reason``; then the usage chunk (``include_usage``) and ``data: [DONE]``."""
    head = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}

    def event(index: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        chunk = {**head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish,
                                      **extra}]}
        if include_usage:
            chunk["usage"] = None
        return f"data: {json.dumps(chunk)}\n\n"

    for choice, s in zip(body["choices"], samples):
        j, message = choice["index"], choice["message"]
        yield event(j, {"role": "assistant", "content": ""})
        if message.get("tool_calls"):
            if message["content"]:
                yield event(j, {"content": message["content"]})
            for k, call in enumerate(message["tool_calls"]):
                yield event(j, {"tool_calls": [{"index": k, **call}]})
        else:
            for piece in _text_pieces(message["content"], s.completion_ids, tokenizer):
                yield event(j, {"content": piece})
        yield event(j, {}, choice["finish_reason"], token_ids=choice["token_ids"])
    if include_usage:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': body['usage']})}\n\n"
    yield "data: [DONE]\n\n"


def _usage(samples: list[Sample]) -> dict[str, int]:
    completion = sum(len(s.completion_ids) for s in samples)
    return {"prompt_tokens": len(samples[0].prompt_ids), "completion_tokens": completion,
            "total_tokens": len(samples[0].prompt_ids) + completion}


def build_app(gateway: Any) -> Any:
    """The FastAPI app of ``gateway`` (a :class:`teamrl.rollout.gateway.Gateway`, which imports this module when it
    starts: named, not imported; request bodies validated against the pydantic schemas below)."""
    require_asgi()
    from fastapi import Depends, FastAPI, Request
    from fastapi.responses import Response, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field

    opts = gateway.options

    class Function(BaseModel):
        model_config = ConfigDict(extra="allow")
        name: str
        arguments: str | dict[str, Any] = "{}"

    class ToolCallIn(BaseModel):
        model_config = ConfigDict(extra="allow")
        id: str | None = None
        type: str = "function"
        function: Function

    class Message(BaseModel):
        model_config = ConfigDict(extra="allow")  # tool_call_id, name: passed to the chat template
        role: str
        content: str | list[dict[str, Any]] | None = None
        tool_calls: list[ToolCallIn] | None = None  # an assistant's calls, checked: the template reads them

    class ChatRequest(BaseModel):
        # Clients send more fields than training uses (temperature, seed, ...): accepted, and the
        # trainer's rollout sampling settings apply (documented in docs/gateway.md).
        model_config = ConfigDict(extra="allow")
        model: str
        messages: list[Message] = Field(min_length=1, max_length=opts.max_messages)
        max_tokens: int | None = Field(None, ge=1)
        max_completion_tokens: int | None = Field(None, ge=1)
        n: int = Field(1, ge=1)
        stop: str | list[str] | None = None
        logprobs: bool | None = False
        tools: list[dict[str, Any]] | None = None
        tool_choice: str | dict[str, Any] | None = None
        stream: bool | None = False
        stream_options: dict[str, Any] | None = None
        response_format: dict[str, Any] | None = None

    class CompletionRequest(BaseModel):
        model_config = ConfigDict(extra="allow")
        model: str
        prompt: str | list[int]
        max_tokens: int | None = Field(None, ge=1)
        n: int = Field(1, ge=1)
        stop: str | list[str] | None = None
        logprobs: int | None = None
        stream: bool | None = False

    app = FastAPI(title="teamrl training gateway", docs_url=None, redoc_url=None, openapi_url=None)
    json_errors(app)

    def _stop(stop: str | list[str] | None) -> list[str]:
        return [stop] if isinstance(stop, str) else list(stop or [])

    async def _episode(episode_id: str, request: Request) -> GatewayEpisode:  # async: no thread hop
        """The route's episode, for a request with its token (a dependency: checked before the body is validated)."""
        return gateway.episode(episode_id, gateway.presented_token(dict(request.scope["headers"])))

    async def _served(
        ep: GatewayEpisode,
        request: Request,
        model: str,
        prompt: Any,
        chat: bool,
        tools: list | None,
        max_tokens: int | None,
        stop: list[str],
        n: int,
        stream: bool | None,
        tool_choice: Any = None,
    ) -> tuple[str, list[Sample], list[ToolParse | None]] | Response:
        if stream and not chat:
            raise RequestError(
                400, "stream: the training gateway streams chat completions only; send stream=false", "stream"
            )
        role = gateway.check_role(ep, model)
        try:
            samples, parses = await gateway.serve_call(
                ep, role, prompt, chat, tools, max_tokens, stop, n, request.is_disconnected, tool_choice
            )
        except ClientGone:
            return Response(status_code=499)  # nobody reads it: the client has gone
        return role, samples, parses

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request, ep: GatewayEpisode = Depends(_episode)) -> Any:
        kind = (body.response_format or {}).get("type", "text")
        if kind != "text":  # constrained decoding would sample another distribution than the loss assumes
            raise RequestError(400, f"response_format {{'type': {str(kind)[:40]!r}}}: the training gateway samples "
                                    "the model unconstrained (the distribution the loss assumes); send "
                                    "{'type': 'text'} or none, and parse the reply yourself", "response_format")
        messages = []
        for m in body.messages:
            extra = {k: v for k, v in (m.model_extra or {}).items() if v is not None}
            if m.tool_calls:
                extra["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
            messages.append({**extra, "role": m.role, "content": _content_text(m.content)})
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        out = await _served(ep, request, body.model, messages, True, body.tools,
                            body.max_completion_tokens or body.max_tokens, _stop(body.stop), body.n, body.stream,
                            body.tool_choice)
        if isinstance(out, Response):
            return out
        role, samples, parses = out
        answer = chat_response(role, samples, ep.ctx.tokenizer, bool(body.logprobs), parses)
        if body.stream:  # generated and recorded whole, then sent as OpenAI's chunks
            gateway.stats.calls_streamed += 1  # the server's loop is the one writer of this count
            return StreamingResponse(chat_chunks(answer, samples, ep.ctx.tokenizer, include_usage),
                                     media_type="text/event-stream")
        return answer

    @app.post("/episodes/{episode_id}/v1/completions")
    async def completions(body: CompletionRequest, request: Request, ep: GatewayEpisode = Depends(_episode)) -> Any:
        out = await _served(ep, request, body.model, body.prompt, False, None, body.max_tokens, _stop(body.stop),
                            body.n, body.stream)
        if isinstance(out, Response):
            return out
        role, samples, _ = out
        return completion_response(role, samples, ep.ctx.tokenizer, body.logprobs is not None)

    @app.get("/episodes/{episode_id}/v1/models")
    async def models(ep: GatewayEpisode = Depends(_episode)) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": r, "object": "model", "owned_by": "teamrl"} for r in ep.roles]}

    @app.post("/episodes")
    async def claim(request: Request, wait: float = 0.0) -> Any:
        """The next episode the trainer wants run: {episode_id, base_url, token, problem, roles}; 204 when
        none came within ``wait`` s (0 to MAX_CLAIM_WAIT_S)."""
        await request.body()  # read (it is unused), so that is_disconnected() sees the connection's state
        try:
            ep = await gateway.claim_within(wait, request.is_disconnected)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it: the client has gone, and took no episode
        if ep is None:
            return Response(status_code=204)
        return {"episode_id": ep.id, "base_url": gateway.episode_url(ep), "token": ep.token, "problem": ep.problem,
                "roles": list(ep.roles)}

    @app.post("/episodes/{episode_id}/reward")
    async def reward(request: Request, ep: GatewayEpisode = Depends(_episode)) -> dict[str, Any]:
        try:
            body = await request.json()
        # RecursionError: cannot pass the Guard's depth bound; kept as a backstop
        except (ValueError, RecursionError) as e:
            raise RequestError(
                400, f"reward: the request body is not valid JSON ({type(e).__name__}: {e})", "reward"
            ) from e
        gateway.post_reward(ep, body)
        return {"episode_id": ep.id, "status": "recorded"}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return Guard(
        app,
        opts.max_request_bytes,
        opts.token,
        what="workflow.options.max_request_bytes",
        max_depth=opts.max_json_depth,
        depth_what="workflow.options.max_json_depth",
        authorize=gateway.authorizes,
        check_header=gateway.check_episode_header,
    )
