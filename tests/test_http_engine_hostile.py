"""The rollout client against endpoints that answer badly (issue 44: H9 malformed 200s, H10 a dribbled answer).

Each test is an attack on commit d3e8a20: a malformed 200 crashed the trainer with an AttributeError, KeyError,
TypeError or IndexError; an answer dribbled at 1 byte/s (``/health`` fine) was never timed out. Now a bad answer
or one not complete within ``rollout.request_deadline_s`` is a failed endpoint: dropped from a pool (the run
goes on) or one line naming it (``rollout.on_endpoint_failure=stop``, or a single endpoint).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import pytest

from teamrl.rollout.completions_api import ServerError
from teamrl.rollout.engine import GenerationRequest
from teamrl.rollout.http_engine import HTTPEngine
from teamrl.rollout.pool import EndpointFailed, EnginePool
from tests.test_rollout_pool import Recorder, _requests

VOCAB = 50


class Tok:
    """All the tokenizer an HTTPEngine needs here: its vocabulary size."""

    def __len__(self) -> int:
        return VOCAB


def _choice(**over: Any) -> dict[str, Any]:
    return {"index": 0, "text": "ab", "finish_reason": "length", "stop_reason": None, "token_ids": [3, 4],
            "logprobs": {"tokens": ["token_id:3", "token_id:4"], "token_logprobs": [-0.5, -0.25]}, **over}


def _served(choices: Any) -> bytes:
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": choices}).encode()


class Endpoint(ThreadingHTTPServer):
    """A stand-in server: ``/health`` and ``/v1/models`` answer at once; ``/v1/completions`` answers ``answer``
    (content type, body), or with ``dribble`` sends its headers and then one byte every ``dribble`` seconds."""

    daemon_threads = True

    def __init__(self, answer: tuple[str, bytes] = ("application/json", b""), dribble: float = 0.0) -> None:
        self.answer, self.dribble, self.stop = answer, dribble, threading.Event()
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.stop.set()
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    server: Endpoint

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, kind: str, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            return self._send("application/json", b"{}")
        cards = [{"id": "m", "object": "model", "owned_by": "teamrl", "parent": None, "max_model_len": 100}]
        self._send("application/json", json.dumps({"object": "list", "data": cards}).encode())

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if not self.server.dribble:
            return self._send(*self.server.answer)
        body = _served([_choice()])
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body) * 100))
        self.end_headers()
        for byte in (body * 100):  # 1 byte per dribble seconds: each read is well within the read timeout
            if self.server.stop.wait(self.server.dribble):
                return
            try:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            except OSError:  # the client gave up
                return


@pytest.fixture
def endpoints() -> Iterator[list[Endpoint]]:
    made: list[Endpoint] = []
    yield made
    for e in made:
        e.close()


MALFORMED = {
    "text/html": ("text/html", b"<html><body>502 Bad Gateway</body></html>"),  # old: AttributeError
    "no index": ("application/json", _served([{k: v for k, v in _choice().items() if k != "index"}])),  # old: KeyError
    "choices a string": ("application/json", _served("none")),  # old: TypeError
    "token id 10**9": ("application/json", _served([_choice(token_ids=[3, 10 ** 9])])),  # old: IndexError in the trainer
    "token id -5": ("application/json", _served([_choice(token_ids=[3, -5])])),
    "choice a number": ("application/json", _served([7])),
    "logprobs a string": ("application/json", _served([_choice(logprobs="x")])),
    "a log-prob a string": ("application/json", _served([_choice(logprobs={"token_logprobs": ["x", -1.0]})])),
    "index twice": ("application/json", _served([_choice(), _choice()])),
}


def _engine(e: Endpoint, **kwargs: Any) -> HTTPEngine:
    engine = HTTPEngine(e.url, Tok(), dialect="teamrl", **kwargs)
    engine.check_base_model("m")
    return engine


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_a_malformed_answer_is_one_line_naming_the_endpoint(endpoints, kind):
    endpoints.append(Endpoint(MALFORMED[kind]))
    with pytest.raises(ServerError) as e:  # old: AttributeError, KeyError, TypeError, or a completion with id 10**9
        _engine(endpoints[0]).generate("m", [GenerationRequest([1, 2])], seed=0)
    message = str(e.value)
    assert "\n" not in message and endpoints[0].url in message and "malformed answer" in message, message


@pytest.mark.parametrize("kind", ["text/html", "token id 10**9"])
def test_a_malformed_answer_fails_the_endpoint_in_a_pool(endpoints, kind):
    """continue: the bad endpoint is dropped (one line) and its share re-sent; stop: one line naming it."""
    endpoints.append(Endpoint(MALFORMED[kind]))
    lines: list[str] = []
    good = Recorder("good")
    pool = EnginePool([_engine(endpoints[0]), good], names=[endpoints[0].url, "good"], log=lines.append)
    out = pool.generate("m", _requests(4, 1), seed=0)
    assert all(c[0].text.startswith("good:") for c in out) and not pool.endpoints[0].live
    assert len(lines) == 1 and "malformed answer" in lines[0] and "continuing on 1 endpoint" in lines[0], lines
    stop = EnginePool([_engine(endpoints[0]), Recorder("good")], names=[endpoints[0].url, "good"], on_failure="stop")
    with pytest.raises(EndpointFailed, match="malformed answer.*rollout.on_endpoint_failure=stop"):
        stop.generate("m", _requests(4, 1), seed=0)


def _generate_within(engine: Any, seconds: float) -> tuple[str, float]:
    """Run one generate call on a thread; (outcome, seconds) where outcome is the result's kind, the error's
    message, or 'still waiting' after ``seconds`` (the call is then abandoned)."""
    got: list[str] = []

    def call() -> None:
        try:
            engine.generate("m", _requests(2, 1), seed=0)
            got.append("answered")
        except Exception as e:  # noqa: BLE001 (reported)
            got.append(f"{type(e).__name__}: {e}")

    t0 = time.monotonic()
    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(seconds)
    return (got[0] if got else "still waiting"), time.monotonic() - t0


def test_an_endpoint_that_dribbles_its_answer_fails_at_the_whole_request_deadline(endpoints):
    """Old: each byte came well within the read timeout, so the request never timed out (150 s, no failover)."""
    endpoints.append(Endpoint(dribble=0.25))
    engine = _engine(endpoints[0], timeout=5.0)
    engine.request_deadline_s = 1.5  # the whole request, headers to last byte
    outcome, seconds = _generate_within(engine, 10.0)
    print(f"single endpoint: {outcome[:160]} after {seconds:.1f} s")
    assert outcome.startswith("ServerUnreachable") and "within 1.5 s" in outcome and "rollout.request_deadline_s" in outcome
    assert 1.4 < seconds < 4, seconds
    lines: list[str] = []
    pool = EnginePool([engine, Recorder("good")], names=[endpoints[0].url, "good"], log=lines.append)
    outcome, seconds = _generate_within(pool, 10.0)
    print(f"pool: {outcome} after {seconds:.1f} s; {lines}")
    assert outcome == "answered" and seconds < 4 and not pool.endpoints[0].live
    assert len(lines) == 1 and "rollout.request_deadline_s" in lines[0] and "continuing on 1 endpoint" in lines[0], lines
