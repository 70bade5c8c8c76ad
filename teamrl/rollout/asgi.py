"""What teamrl's HTTP servers share (``teamrl serve`` and the training gateway): FastAPI on uvicorn.

- :class:`RequestError`: a client error, answered as an OpenAI-style JSON error;
- :class:`Guard`: ASGI middleware for an optional bearer token, a bounded request body (Content-Length
  or chunked) and a bounded JSON nesting depth;
- :func:`json_errors`: the app's error handlers (client errors, unknown paths, server bugs);
- :class:`AsgiServer`: an app on a socket bound at construction (so ``url`` is known at once), served
  by uvicorn in the calling thread until :meth:`AsgiServer.shutdown`; with :class:`ConnectionLimits`
  (slowloris: a client that opens connections and never finishes a request must not lock others out):
  a request's header must arrive within ``header_timeout_s`` and its body within ``body_timeout_s``
  (408 after), and at most ``max_connections`` connections are held open (never more than half the
  process's open-file limit): a connection over the cap closes the oldest one that is not being served
  (a partial header, or kept alive between requests) with a 503 naming the limit, else the oldest whose body
  arrives slower than ``min_body_rate`` (a stalled body: a header and then next to nothing).

FastAPI and uvicorn are imported when a server is built (the ``gateway`` extra; installed by ``make setup``).
"""

import itertools
import json
import math
import re
import resource
import socket
import threading
from array import array
from dataclasses import dataclass
from typing import Any, Callable

# deepest nesting of arrays/objects a request body may have (400 deeper): no parser recursion limit is reached
MAX_JSON_DEPTH = 64


def require_asgi() -> None:
    """Fail in one line when FastAPI / uvicorn are not installed."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        from teamrl.core.config import InputError

        raise InputError(
            f"teamrl serve and the training gateway need {' and '.join(missing)}: pip install -e \".[gateway]\""
        )


class RequestError(Exception):
    """A client error: becomes an OpenAI-style JSON error response with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        kind = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
                405: "MethodNotAllowed",
                409: "ConflictError", 410: "GoneError", 413: "RequestTooLarge"}.get(self.status, "Error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (a 300000-digit integer is not echoed back whole)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def request_number(value: Any, name: str, accepted: str, bound: float = math.inf) -> float:
    """``value`` as a finite float with ``|x| <= bound`` (NaN, inf and integers beyond any float refused), or a
    :class:`RequestError` 400 naming the field ``name`` and what it ``accepted``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(400, f"{name}: expected {accepted}, got {short_repr(value)}", name)
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        number = math.inf
    if not (math.isfinite(number) and abs(number) <= bound):
        raise RequestError(400, f"{name}: expected {accepted}, got {short_repr(value)}", name)
    return number


async def send_json(send: Any, status: int, body: Any, close: bool = False) -> None:
    """Answer an ASGI request with a JSON body (``close``: and close the connection after it)."""
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if close:  # the client may still be sending a body nobody will read
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


# A JSON string, escapes included; its closing quote is optional so that a match never fails (no rescans:
# linear time on any input, malformed included)
_JSON_STRING = re.compile(rb'"(?:[^"\\]+|\\.)*"?', re.DOTALL)
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_BRACKET_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as signed bytes


def json_depth(body: bytes) -> int:
    """How deep the arrays and objects of the JSON text ``body`` nest (brackets inside strings skipped),
    without parsing it: C-speed, linear, no recursion; for malformed text a count of its brackets."""
    steps = array("b", _JSON_STRING.sub(b"", body).translate(_BRACKET_STEP, _NOT_BRACKET))
    return max(itertools.accumulate(steps), default=0)


class Guard:
    """ASGI middleware in front of an app:

    - with a ``token``, a request without ``Authorization: Bearer <token>`` is a 401, unless
      ``authorize(scope, headers)`` accepts it (the gateway: an episode's own token on its routes);
    - ``check_header(scope, headers)`` may refuse a request by its header alone (a :class:`RequestError`;
      the gateway: an episode route without that episode's token);

    a request refused on its header is answered at once and its connection closed: no body is waited for;
    - a body over ``limit`` bytes is a 413 (``Content-Length`` or chunked: bytes are counted as they
      arrive, and reading stops at the limit), before any of it is parsed;
    - a body whose arrays/objects nest deeper than ``max_depth`` is a 400, before any of it is parsed.

    The body is read here, whole (it is at most ``limit`` bytes), and replayed to the app."""

    def __init__(self, app: Any, limit: int, token: str = "", what: str = "", max_depth: int = MAX_JSON_DEPTH,
                 depth_what: str = "", authorize: Callable[[dict, dict[bytes, bytes]], bool] | None = None,
                 check_header: Callable[[dict, dict[bytes, bytes]], None] | None = None) -> None:
        self.app, self.limit, self.token = app, limit, token
        self.what = what  # the setting that sets the limit, named in the 413
        self.max_depth, self.depth_what = max_depth, depth_what
        self.authorize, self.check_header = authorize, check_header

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.token and headers.get(b"authorization") != f"Bearer {self.token}".encode() \
                and not (self.authorize and self.authorize(scope, headers)):
            return await send_json(
                send,
                401,
                RequestError(
                    401, "missing or wrong bearer token (send Authorization: Bearer <token>)", "authorization"
                ).body(),
                close=True,
            )
        if self.check_header is not None:
            try:
                self.check_header(scope, headers)
            except RequestError as e:
                return await send_json(send, e.status, e.body(), close=True)
        too_large = RequestError(413, f"the request body is over the limit of {self.limit} bytes" +
                                 (f" ({self.what})" if self.what else ""), "body").body()
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await send_json(send, 413, too_large, close=True)
        chunks, seen = [], 0
        while True:  # chunked bodies have no length to check up front: count them as they come
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body was complete: nobody to answer
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.limit:
                return await send_json(send, 413, too_large, close=True)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body and self.max_depth:
            depth = json_depth(body)
            if depth > self.max_depth:
                return await send_json(send, 400, RequestError(
                    400, f"body: the JSON is nested {depth} levels deep; at most {self.max_depth} are accepted" +
                    (f" ({self.depth_what})" if self.depth_what else ""), "body").body())
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the connection's state (http.disconnect)

        await self.app(scope, replay, send)


def json_errors(app: Any, endpoints: Callable[[], list[str]] | None = None) -> None:
    """Install the handlers: :class:`RequestError` as its JSON; an unknown path a 404 listing ``endpoints()``,
    a wrong method a 405; a validation error a 400 naming the field; anything else a 500 naming the exception."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    def answer(e: RequestError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestError)
    async def _request_error(request: Any, e: RequestError) -> JSONResponse:
        return answer(e)

    @app.exception_handler(HTTPException)
    async def _http(request: Any, e: HTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if e.status_code == 404:
            listed = f"; endpoints: {endpoints()}" if endpoints else ""
            return answer(RequestError(404, f"{where}: no such endpoint{listed}"))
        if e.status_code == 405:
            return answer(RequestError(405, f"{where}: method not allowed"))
        return answer(RequestError(e.status_code, f"{where}: {e.detail}"))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Any, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        if first.get("type") == "json_invalid":  # FastAPI's parse error: its loc is the character position
            reason = (first.get("ctx") or {}).get("error", "malformed")
            position = (list(first.get("loc", ())) + ["?"])[1]
            return answer(
                RequestError(
                    400, f"body: the request body is not valid JSON ({reason} at character {position})", "body"
                )
            )
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return answer(RequestError(400, f"{where}: {first.get('msg')}", where))

    @app.exception_handler(Exception)
    # a server bug: say so instead of dropping the connection
    async def _bug(request: Any, e: Exception) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "message": f"{type(e).__name__}: {e}",
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            },
            status_code=500,
        )


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a client may take to send a request, and how many connections are held open at once.
    ``min_body_rate``: bytes per second below which a body in progress gives way to a new connection when the
    server is at its cap (as nginx's ``client_body_timeout`` bounds a slow body; at the cap only, so a slow client
    is served whenever there is room). ``names``: what the 408/503 answers call the four settings (the gateway's
    ``workflow.options.*``)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 1024
    min_body_rate: float = 1024.0
    names: tuple[str, str, str, str] = ("header_timeout_s", "body_timeout_s", "max_connections", "min_body_rate")

    def cap(self) -> int:
        """``max_connections``, but at most half the open-file limit: the rest stays for the process's own files and
        sockets (the gateway runs inside the trainer; a full table failed its checkpoints and rollout requests)."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return self.max_connections if soft == resource.RLIM_INFINITY else max(8, min(self.max_connections, soft // 2))

    def accept_batch(self) -> int:
        """The listen backlog, which is also how many connections asyncio accepts in one go before any of them reaches
        the protocol (so before the cap can close one): the descriptors in use peak near
        ``cap() + 2 * accept_batch()``."""
        return max(8, min(128, self.cap() // 8))


def _raw_error(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection (written outside h11: the connection ends with it)."""
    kind = {408: "RequestTimeout", 503: "ServiceUnavailable"}.get(status, "Error")
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def limited_protocol(limits: ConnectionLimits) -> type:
    """uvicorn's h11 protocol with :class:`ConnectionLimits` (uvicorn has a keep-alive timeout only: a connection
    that never completes its first request is held forever, and every one takes a file descriptor).

    Each connection is in one phase: ``head`` (no complete request header yet: timed by ``header_timeout_s``),
    ``body`` (header read, body not: ``body_timeout_s``), ``app`` (the request is being served: no limit) or
    ``idle`` (kept alive after a response: uvicorn's keep-alive timeout). ``head`` and ``idle`` ones are not
    being served, so they give way, oldest first, when a new connection is over the cap; when there is none, the
    oldest ``body`` one whose body has come slower than ``min_body_rate`` bytes per second gives way (a stalled
    body must not hold the cap for the whole body timeout)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    cap = limits.cap()
    header_name, body_name, cap_name, rate_name = limits.names
    # this server's open connections (closed ones leave at once, not a loop turn later when uvicorn forgets them),
    # and of them those not being served (head, idle), oldest first: O(1) per connection under a flood; and those
    # receiving a body, oldest first
    open_: set[Any] = set()
    waiting: dict[Any, None] = {}
    receiving: dict[Any, None] = {}

    class LimitedH11Protocol(H11Protocol):
        phase = "new"
        timer: Any = None
        body_since = 0.0  # when the body phase began (loop time)
        body_bytes = 0    # bytes received since

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            open_.add(self)
            self._enter("head")
            if len(open_) > cap:
                self._make_room()

        def _stalled(self, now: float) -> bool:
            """Whether this body has come slower than ``min_body_rate`` bytes per second so far."""
            return self.body_bytes < limits.min_body_rate * (now - self.body_since)

        def _make_room(self) -> None:
            """Close the oldest connection that is not being served, else the oldest stalled body; this one when
            every other is being served."""
            oldest = next((c for c in waiting if c is not self), None)
            now = self.loop.time()
            # bodies in order of age: under a flood the stalled ones found first are the attacker's oldest
            slowest = None if oldest is not None else next(
                (c for c in receiving if c is not self and c._stalled(now)), None)
            if oldest is not None:
                oldest._close(
                    503,
                    "Service Unavailable",
                    f"the server holds at most {cap} open connections ({cap_name}, "
                    "at most half the open-file limit); this one had sent no complete request "
                    "and was the oldest",
                )
            elif slowest is not None:
                slowest._close(
                    503,
                    "Service Unavailable",
                    f"the server holds at most {cap} open connections ({cap_name}); this one's body came at "
                    f"{slowest.body_bytes / max(now - slowest.body_since, 1e-9):.0f} bytes/s, under the "
                    f"{limits.min_body_rate:g} bytes/s a body must arrive at when the server is full ({rate_name})",
                )
            else:
                self._close(503, "Service Unavailable", f"the server holds at most {cap} open connections "
                                                        f"({cap_name}), all of them serving requests")

        def _enter(self, phase: str) -> None:
            """Begin ``phase``; arm its deadline (head, body) or none (app, idle)."""
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            self.phase = phase
            waiting.pop(self, None)
            receiving.pop(self, None)
            if phase in ("head", "idle"):
                waiting[self] = None  # to the end: the newest
            elif phase == "body":
                receiving[self] = None
                self.body_since, self.body_bytes = self.loop.time(), 0
            elif phase == "closed":
                open_.discard(self)
            if phase == "head":
                self.timer = self.loop.call_later(
                    limits.header_timeout_s, self._expired, "header", limits.header_timeout_s, header_name
                )
            elif phase == "body":
                self.timer = self.loop.call_later(limits.body_timeout_s, self._expired, "body", limits.body_timeout_s,
                                                  body_name)

        def _expired(self, part: str, seconds: float, setting: str) -> None:
            self.timer = None
            self._close(408, "Request Timeout", f"the request {part} did not arrive within {seconds:g} s ({setting})")

        def _close(self, status: int, reason: str, message: str) -> None:
            """Answer ``status`` (a connection between requests: nothing) and close the connection."""
            if self.transport.is_closing():
                return
            if self.phase != "idle":
                self.transport.write(_raw_error(status, reason, message))
            self._enter("closed")
            self.transport.close()

        def _follow(self) -> None:
            """Move to the phase h11 says the request is in."""
            state = self.conn.their_state
            if self.phase == "head" and state is h11.SEND_BODY:
                self._enter("body")
            elif self.phase in ("head", "body") and state is not h11.IDLE and state is not h11.SEND_BODY:
                self._enter("app")  # the whole request is in (or the connection broke): the app's turn

        def data_received(self, data: bytes) -> None:
            if self.phase == "idle":  # the next request begins: its header is timed from its first byte
                self._enter("head")
            elif self.phase == "body":
                self.body_bytes += len(data)
            super().data_received(data)
            if self.phase != "closed":
                self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.phase != "closed" and not self.transport.is_closing():
                if self.conn.their_state is h11.IDLE:
                    self._enter("idle")
                else:  # a pipelined request already began
                    self._enter("head")
                    self._follow()

        def connection_lost(self, exc: Exception | None) -> None:
            self._enter("closed")
            super().connection_lost(exc)

    return LimitedH11Protocol


def listening_socket(host: str, port: int, host_flag: str = "host", port_flag: str = "port",
                     backlog: int = 2048) -> socket.socket:
    """A socket listening on ``host:port`` (0: a free port). An address that cannot be used (a name that does not
    resolve, an address of another machine, a port in use or out of range) is an ``InputError`` in one line
    naming it (``host_flag`` / ``port_flag``: the setting that gave it) and what is accepted."""
    import errno

    from teamrl.core.config import InputError

    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise InputError(f"{port_flag} {port!r}: a port is from 0 to 65535 (0: any free one)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        reason = e.strerror if isinstance(e, socket.gaierror) else str(e)
        raise InputError(
            f"{host_flag} {host!r} cannot be resolved ({reason}); give an address or name of this machine, "
            "e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"
        ) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise InputError(
                f"{port_flag} {port}: {host}:{port} is in use by another process; choose a free port, "
                "or 0 for any free one"
            ) from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise InputError(
                f"{host_flag} {host!r} is not an address of this machine; give one of its own, e.g. "
                "127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"
            ) from None
        if e.errno == errno.EACCES:
            raise InputError(
                f"{port_flag} {port}: a port below 1024 needs privileges; choose one from 1024 to 65535, "
                "or 0 for any free one"
            ) from None
        raise InputError(
            f"cannot listen on {host}:{port} ({host_flag}, {port_flag}): [Errno {e.errno}] {e.strerror}"
        ) from None
    return sock


class AsgiServer:
    """An ASGI app served by uvicorn on ``host:port`` (0: a free port), the socket bound at construction, each
    connection under ``limits`` (:class:`ConnectionLimits`)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, verbose: bool = False,
                 limits: ConnectionLimits = ConnectionLimits()) -> None:
        require_asgi()
        import uvicorn

        self.socket = listening_socket(host, port, backlog=limits.accept_batch())
        self.server_address = self.socket.getsockname()
        self.limits = limits
        config = uvicorn.Config(app, log_level="info" if verbose else "warning", access_log=verbose, lifespan="off",
                                timeout_keep_alive=30, http=limited_protocol(limits), backlog=limits.accept_batch())
        self._server = uvicorn.Server(config)
        self._done = threading.Event()

    @property
    def url(self) -> str:
        """``http://host:port`` of the bound socket (the real port when 0 was asked for)."""
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def started(self) -> bool:
        return bool(self._server.started)

    def serve_forever(self, poll_interval: float = 0.1) -> None:
        """Serve until :meth:`shutdown` (or, in the main thread, SIGINT/SIGTERM). ``poll_interval``: unused
        (kept from ``http.server``'s signature)."""
        try:
            self._server.run(sockets=[self.socket])
        finally:
            self._done.set()

    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return (after the requests in progress); does not wait."""
        self._server.should_exit = True

    def shutdown(self) -> None:
        """Stop serving and wait until :meth:`serve_forever` has returned."""
        self.stop()
        self._done.wait(timeout=30)

    def server_close(self) -> None:
        self.socket.close()
