"""``teamrl serve`` against hostile requests (issue 44: H7 bounds, H8 sampling values, H4 slowloris).

Each case is an attack that worked on commit d3e8a20; each must now be a 400 naming the field and the
limit or accepted range, in one line, and the server must go on answering normal requests at once.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from teamrl.rollout.server import ModelServer, TeamrlHTTPServer

MODEL = "tiny-random"  # its context (max_position_embeddings) is 2048 tokens
LIMITS = {"max_n": 64, "max_sequences": 256}


@pytest.fixture(scope="module")
def server():
    httpd = TeamrlHTTPServer(ModelServer(MODEL, seed=0, **LIMITS), "127.0.0.1", 0)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    t.join(timeout=10)


def _post(url: str, raw: bytes, timeout: float = 60) -> tuple[int, dict, float]:
    """(status, JSON body, seconds) of a POST of the bytes ``raw``."""
    req = urllib.request.Request(url, data=raw, method="POST", headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), time.monotonic() - t0


def _body(**fields: object) -> bytes:
    return json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, **fields}).encode()


CASES = [
    # H7: bounds (old: no answer in 60 s, a 500 after 21 s, a 500, generation past the context)
    (_body(prompt=[5] * 300000), "prompt", "context of 2048 tokens"),
    (_body(n=1000000), "n", "1 to 64"),
    (_body(max_tokens=10 ** 9), "max_tokens", "context of 2048 tokens"),
    (_body(max_tokens=4000, min_tokens=4000), "max_tokens", "context of 2048 tokens"),
    (_body(prompt=[[1, 2]] * 200, n=2), "n", "256 sequences"),
    # H8: sampling values (old: 200 with null log-probs, 500, 500)
    (_body().replace(b'"max_tokens": 2', b'"max_tokens": 2, "temperature": NaN'), "temperature", "finite"),
    (_body().replace(b'"max_tokens": 2', b'"max_tokens": 2, "temperature": Infinity'), "temperature", "finite"),
    (_body().replace(b'"max_tokens": 2', b'"max_tokens": 2, "top_p": NaN'), "top_p", "(0, 1]"),
    (_body(seed=2 ** 70), "seed", "-9223372036854775808 to 9223372036854775807"),
    (_body(n=2 ** 63), "n", "1 to 64"),
    (_body(top_k=2 ** 70), "top_k", "-1 to"),
]


@pytest.mark.parametrize("raw, field, words", CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_a_request_beyond_the_models_context_or_the_servers_limits_is_a_400_naming_the_field(server, raw, field, words):
    status, body, seconds = _post(server.url + "/v1/completions", raw)
    error = body.get("error", {})
    assert status == 400, (status, str(body)[:300], f"{seconds:.1f} s")
    assert error["param"] == field and error["message"].startswith(field + ":") and words in error["message"], error
    assert "\n" not in error["message"] and seconds < 10, (error, seconds)
    status, body, seconds = _post(server.url + "/v1/completions", _body(temperature=0, logprobs=1))
    assert status == 200 and seconds < 10 and all(x is not None for x in body["choices"][0]["logprobs"]["token_logprobs"])


def test_the_largest_accepted_values_are_served(server):
    """The bounds are not off by one: prompt + max_tokens = the context, n = max_n, the seed range's ends."""
    status, body, _ = _post(server.url + "/v1/completions", _body(prompt=[5] * 2046, max_tokens=2, seed=-2 ** 63))
    assert status == 200, body
    status, body, _ = _post(server.url + "/v1/completions", _body(n=64, seed=2 ** 63 - 1, max_tokens=1))
    assert status == 200 and len(body["choices"]) == 64, body


def test_slow_clients_holding_1100_partial_headers_do_not_lock_a_request_out_of_teamrl_serve(tmp_path):
    """H4 on ``teamrl serve`` (nofile 1024 in its process): a normal completion is answered within 2 s."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.slowloris import limit_open_files, slow_sockets

    repo = Path(__file__).resolve().parents[1]
    ready = tmp_path / "url"
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "teamrl.cli", "serve", "--model", MODEL, "--port", "0", "--threads", "1",
                             "--ready-file", str(ready)], cwd=repo, env=env, preexec_fn=limit_open_files,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "teamrl serve did not start"
            time.sleep(0.1)
        url = ready.read_text()
        with slow_sockets(url, 1100) as held:
            try:
                status, body, seconds = _post(url + "/v1/completions", _body(temperature=0), timeout=15)
            except (urllib.error.URLError, TimeoutError) as e:
                status, body, seconds = type(e).__name__, {}, 15.0
            print(f"completion under 1100 slow sockets: {status} in {seconds:.2f} s")
            assert status == 200 and len(body["choices"]) == 1 and seconds < 2, (status, seconds)
            held[0].settimeout(5)
            first = held[0].recv(4096)
        assert first.startswith(b"HTTP/1.1 503") and b"teamrl serve --max-connections" in first, first[:300]
    finally:
        proc.terminate()
        proc.wait(60)


def test_stalled_bodies_at_the_connection_cap_give_way_to_a_legitimate_request():
    """Issue 57 item 3: connections that sent a whole header and then one byte of a 100000-byte body filled the cap;
    every new client got a 503 for the body timeout (120 s). Now the oldest body that arrives below the minimum rate
    gives way (a 503 naming the setting) and the legitimate completion is answered at once. The cap is scaled down
    to 16 connections (the real size, 1100 sockets under nofile 1024, was measured by a script for the issue)."""
    from tests.slowloris import stalled_bodies

    httpd = TeamrlHTTPServer(ModelServer(MODEL, seed=0, **LIMITS), "127.0.0.1", 0, max_connections=16)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        with stalled_bodies(httpd.url, 16) as held:
            time.sleep(0.3)  # the server has read every header: all 16 are in their body phase
            try:
                status, body, seconds = _post(httpd.url + "/v1/completions", _body(temperature=0), timeout=15)
            except (urllib.error.URLError, OSError) as e:  # old: a 503 and the connection closed mid-request
                status, body, seconds = f"{type(e).__name__}: {e}", {}, 15.0
            print(f"completion with the cap full of stalled bodies: {status} in {seconds:.2f} s")
            assert status == 200 and len(body["choices"]) == 1 and seconds < 5, (status, body, seconds)
            held[0].settimeout(5)
            first = held[0].recv(4096)
        assert first.startswith(b"HTTP/1.1 503") and b"teamrl serve --min-body-rate" in first, first[:300]
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join(timeout=10)
