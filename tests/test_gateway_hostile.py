"""The gateway against hostile clients (issue 34, items 4-6): each test is an attack that worked on the old code.

- an abandoned ``POST /episodes?wait=N`` (client gone) must not take the next episode with it;
- ``wait`` must be a finite number of seconds in [0, MAX_CLAIM_WAIT_S] (``nan`` looped forever);
- one episode's client must not write into another episode (the id was the only credential);
- deeply nested JSON is a 400 on every route (``/reward`` was a 500 with a RecursionError), and a
  chunked body over the size bound is the same 413 as a Content-Length one (it was a 400).

Episodes run on the tiny random model through a real uvicorn server; the attacks use raw sockets where
a well-behaved client library would not do what an attacker does.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time

import httpx
import openai
import pytest

from tests.test_gateway import RecordingEngine, run_episodes, serving
from teamrl.tasks.solve import MathSolve, MathSolveOptions
from teamrl.rollout.gateway import MAX_CLAIM_WAIT_S, Gateway, GatewayOptions
from teamrl.rollout.gateway_episode import ClientGone


@pytest.fixture(scope="module")
def task():
    return MathSolve(MathSolveOptions(num_problems=8, test_size=2))


@pytest.fixture(scope="module")
def idle():
    """A gateway with no episodes (default options), shared by the tests that need no rollout."""
    with serving() as gw:
        yield gw


@pytest.fixture
def engine(tiny):
    model, tok = tiny
    return RecordingEngine(model, tok)


def _head(method: str, path: str, host: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_response(sock: socket.socket, timeout: float = 10.0) -> tuple[int, dict]:
    """(status, JSON body or {}) of one HTTP/1.1 response read from ``sock``."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, json.loads(body) if body else {}


def _episode_headers(claimed: dict) -> dict[str, str]:
    """The episode's own credential, as the claim returned it (the old gateway returned none)."""
    return {"X-Episode-Token": claimed["token"]} if claimed.get("token") else {}


# ---- item 4: claims ------------------------------------------------------------------------------------


def test_an_abandoned_waiting_claim_leaves_the_episode_to_the_next_claimer(engine, task):
    got: dict = {}

    def legitimate(gw):
        deadline = time.monotonic() + 10
        while not gw._episodes and time.monotonic() < deadline:  # the episode is open (the abandoned claim is waiting)
            time.sleep(0.01)
        time.sleep(0.3)  # the abandoned claim has had every chance to take it
        with httpx.Client(base_url=gw.url, timeout=10) as http:
            r = http.post("/episodes", params={"wait": 2})
            got["status"] = r.status_code
            if r.status_code != 200:
                return
            claimed = r.json()
            client = openai.OpenAI(base_url=claimed["base_url"], api_key=claimed.get("token") or "x", max_retries=0)
            client.chat.completions.create(model="writer", messages=[{"role": "user", "content": "hi"}])
            got["reward"] = http.post(f"/episodes/{claimed['episode_id']}/reward", json={"reward": 1.0},
                                      headers=_episode_headers(claimed)).status_code

    with serving(reward_timeout_s=4) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as gone:  # waits 30 s for an episode, then its client dies
            gone.sendall(_head("POST", "/episodes?wait=30", f"{host}:{port}", {"Content-Length": "0"}))
            time.sleep(0.2)
        worker = threading.Thread(target=legitimate, args=(gw,))
        worker.start()
        ctxs, outcomes, _ = run_episodes(gw, engine, task, None, 1)
        worker.join(15)
        dropped = gw.stats.episodes_dropped
    assert got.get("status") == 200, got  # old: 204 (the dead claim took the episode)
    assert got.get("reward") == 200 and dropped == 0 and not outcomes[0].stats["dropped"], (got, dropped)
    assert [s.role for s in ctxs[0].samples] == ["writer"]


def test_an_episode_claimed_for_a_client_found_gone_goes_back_first_in_line():
    gw = Gateway(GatewayOptions())  # not serving: claims are made here directly

    async def claims():
        first, second = (gw.open_episode(None, ("writer",), {}, external=True) for _ in range(2))

        async def gone() -> bool:
            return True

        async def here() -> bool:
            return False

        with pytest.raises(ClientGone):
            await gw.claim_within(1.0, gone)
        return first, second, await gw.claim_within(0.0, here), await gw.claim_within(0.0, here), await gw.claim_within(0.0, here)

    first, second, *got = asyncio.run(claims())
    assert got == [first, second, None]  # the released episode is claimed first, and once


@pytest.mark.parametrize("wait", ["nan", "inf", "-inf", "-1", str(MAX_CLAIM_WAIT_S + 1), "1e9", "soon"])
def test_wait_must_be_a_finite_number_of_seconds_within_the_bound(wait, idle):
    with httpx.Client(base_url=idle.url, timeout=3) as http:
        r = http.post("/episodes", params={"wait": wait})  # old: nan/inf/1e9 hung (nan forever), -1 was a 204
        assert r.status_code == 400, (wait, r.status_code)
        error = r.json()["error"]
        assert "wait" in error["message"] and error["param"] and "wait" in error["param"], error
        if wait != "soon":
            assert f"0 to {MAX_CLAIM_WAIT_S:g}" in error["message"], error


def test_a_claim_with_wait_zero_or_a_fraction_of_a_second_is_accepted(idle):
    with httpx.Client(base_url=idle.url, timeout=3) as http:
        assert http.post("/episodes", params={"wait": 0}).status_code == 204
        assert http.post("/episodes", params={"wait": "0.05"}).status_code == 204


# ---- item 5: one credential per episode ------------------------------------------------------------------


def test_one_episodes_client_cannot_write_into_another_episode(engine, task):
    seen: dict = {}
    both = threading.Barrier(2)

    def claimer(gw, name):
        with httpx.Client(base_url=gw.url, timeout=20) as http:
            seen[name] = http.post("/episodes", params={"wait": 10}).json()
            both.wait(15)
            mine, other = seen[name], seen["b" if name == "a" else "a"]
            if name == "a":  # the attacker: episode a's client, knowing episode b's id and URL
                forged = openai.OpenAI(base_url=other["base_url"], api_key=mine.get("token") or "x", max_retries=0)
                try:
                    forged.chat.completions.create(model="writer", messages=[{"role": "user", "content": "forged"}])
                    seen["forged_chat"] = 200
                except openai.APIStatusError as e:
                    seen["forged_chat"] = e.status_code
                chat = f"/episodes/{other['episode_id']}/v1/chat/completions"
                body = {"model": "writer", "messages": [{"role": "user", "content": "forged"}]}
                seen["no_token"] = http.post(chat, json=body).status_code
                seen["forged_header"] = http.post(chat, json=body, headers=_episode_headers(mine)).status_code
                seen["forged_models"] = http.get(f"/episodes/{other['episode_id']}/v1/models",
                                                 headers=_episode_headers(mine)).status_code
                seen["forged_reward"] = http.post(f"/episodes/{other['episode_id']}/reward", json={"reward": 0.0},
                                                  headers=_episode_headers(mine)).status_code
            both.wait(15)
            client = openai.OpenAI(base_url=mine["base_url"], api_key=mine.get("token") or "x", max_retries=0)
            client.chat.completions.create(model="checker", messages=[{"role": "user", "content": name}])
            r = http.post(f"/episodes/{mine['episode_id']}/reward", json={"reward": 1.0 if name == "b" else 0.5},
                          headers=_episode_headers(mine))
            seen[name + "_reward"] = r.status_code

    with serving(reward_timeout_s=20) as gw:
        workers = [threading.Thread(target=claimer, args=(gw, n)) for n in "ab"]
        for w in workers:
            w.start()
        ctxs, outcomes, _ = run_episodes(gw, engine, task, None, 2)
        for w in workers:
            w.join(20)
    forged = {k: seen.get(k) for k in ("forged_chat", "forged_header", "forged_models", "forged_reward", "no_token")}
    # old: all 200, the forged samples recorded in episode b and its reward taken from a
    assert forged == {"forged_chat": 403, "forged_header": 403, "forged_models": 403, "forged_reward": 403, "no_token": 401}, seen
    tokens = {seen["a"].get("token"), seen["b"].get("token")}
    assert None not in tokens and len(tokens) == 2, tokens
    assert seen["a_reward"] == seen["b_reward"] == 200, seen
    by_id = {c.samples[0].tags["gateway_episode"]: c for c in ctxs if c.samples}
    assert {e: [s.role for s in c.samples] for e, c in by_id.items()} == {seen["a"]["episode_id"]: ["checker"],
                                                                          seen["b"]["episode_id"]: ["checker"]}
    assert sorted(o.reward for o in outcomes) == [0.5, 1.0]  # the forged reward was not taken


def test_with_a_gateway_token_the_episode_token_still_works_as_the_api_key(engine, task):
    seen: dict = {}

    def claimer(url):
        with httpx.Client(base_url=url, timeout=20) as http:
            seen["unauthorised_claim"] = http.post("/episodes").status_code
            claimed = http.post("/episodes", params={"wait": 10}, headers={"Authorization": "Bearer s3cret"}).json()
            ep = claimed["episode_id"]
            client = openai.OpenAI(base_url=claimed["base_url"], api_key=claimed["token"], max_retries=0)
            client.chat.completions.create(model="writer", messages=[{"role": "user", "content": "hi"}])
            seen["other_path"] = http.post("/episodes", headers={"Authorization": f"Bearer {claimed['token']}"}).status_code
            both = {"Authorization": "Bearer s3cret", "X-Episode-Token": claimed["token"]}
            seen["gateway_token_only"] = http.get(f"/episodes/{ep}/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code
            seen["reward"] = http.post(f"/episodes/{ep}/reward", json={"reward": 1.0}, headers=both).status_code

    with serving(token="s3cret", reward_timeout_s=20) as gw:
        worker = threading.Thread(target=claimer, args=(gw.url,))
        worker.start()
        ctxs, outcomes, _ = run_episodes(gw, engine, task, None, 1)
        worker.join(20)
    # an episode's token opens that episode's routes only; the gateway token alone opens none of an episode's
    assert seen == {"unauthorised_claim": 401, "other_path": 401, "gateway_token_only": 401, "reward": 200}, seen
    assert len(ctxs[0].samples) == 1 and outcomes[0].reward == 1.0


# ---- item 6: bodies ----------------------------------------------------------------------------------------

NESTED = ("[" * 100_000 + "]" * 100_000).encode()  # 200 KB: under the size bound, far over any sane depth
NESTED_FIELD = json.dumps({"reward": 1.0, "roles": {}}).replace("{}", "[" * 500 + "]" * 500).encode()  # parses in Python


def test_deeply_nested_json_is_a_400_on_every_route_and_the_episode_still_completes(engine, task):
    seen: dict = {}

    def attacker(url):
        with httpx.Client(base_url=url, timeout=20) as http:
            claimed = http.post("/episodes", params={"wait": 10}).json()
            ep, headers = claimed["episode_id"], {**_episode_headers(claimed), "Content-Type": "application/json"}
            chat = {"model": "writer", "messages": [{"role": "user", "content": "hi", "tool_calls": json.loads("[" * 400 + "]" * 400)}]}
            routes = {"chat": f"/episodes/{ep}/v1/chat/completions", "completions": f"/episodes/{ep}/v1/completions",
                      "reward": f"/episodes/{ep}/reward", "claim": "/episodes", "health": "/health"}
            for name, path in routes.items():
                r = http.post(path, content=NESTED, headers=headers)
                seen[name] = (r.status_code, r.json()["error"]["message"] if r.status_code >= 400 else "")
            for name, body in (("reward_field", NESTED_FIELD), ("chat_field", json.dumps(chat).encode())):
                r = http.post(routes[name.split("_")[0]], content=body, headers=headers)
                seen[name] = (r.status_code, r.json()["error"]["message"] if r.status_code >= 400 else "")
            for name in ("chat", "reward"):
                r = http.post(routes[name], content=b'{"model": "writer", "messages": [', headers=headers)
                seen[name + "_malformed"] = (r.status_code, r.json()["error"]["message"] if r.status_code >= 400 else "")
            seen["ok"] = (http.post(routes["reward"], json={"reward": 1.0}, headers=_episode_headers(claimed)).status_code, "")

    with serving(reward_timeout_s=20) as gw:
        worker = threading.Thread(target=attacker, args=(gw.url,))
        worker.start()
        ctxs, outcomes, _ = run_episodes(gw, engine, task, None, 1)
        worker.join(20)
    statuses = {k: v[0] for k, v in seen.items()}
    # old: reward 500 (RecursionError), health/claim 200 (body ignored), the rest 400 with "error parsing the body"
    assert statuses == {"chat": 400, "completions": 400, "reward": 400, "claim": 400, "health": 400, "reward_field": 400,
                        "chat_field": 400, "chat_malformed": 400, "reward_malformed": 400, "ok": 200}, seen
    for name in ("chat", "reward", "claim", "reward_field", "chat_field"):
        assert "nested" in seen[name][1] and "64" in seen[name][1], seen[name]
    for name in ("chat_malformed", "reward_malformed"):
        assert "not valid JSON" in seen[name][1], seen[name]
    assert outcomes[0].reward == 1.0 and ctxs[0].samples == []


def _stream_chunked(url: str, path: str, total: int, headers: dict[str, str] | None = None) -> tuple[int, dict, int]:
    """POST ``total`` bytes as a chunked body (no Content-Length), 64 KiB a chunk, until the server answers;
    (status, body, bytes sent). The body is never held in memory whole."""
    host, port = url.removeprefix("http://").split(":")
    chunk = b"x" * 65536
    framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    sent = 0
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(_head("POST", path, f"{host}:{port}", {"Content-Type": "application/json",
                                                            "Transfer-Encoding": "chunked", **(headers or {})}))
        deadline = time.monotonic() + 30
        while sent < total and time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock], [], 1.0)
            if readable:
                break
            if writable:
                try:
                    sock.sendall(framed)
                except (BrokenPipeError, ConnectionResetError):
                    break
                sent += len(chunk)
        if sent >= total:
            sock.sendall(b"0\r\n\r\n")
        status, body = _read_response(sock)
    return status, body, sent


@pytest.mark.parametrize("path", ["/episodes/0123456789abcdef/v1/chat/completions", "/episodes/0123456789abcdef/reward",
                                  "/episodes"])
def test_a_100_mb_chunked_body_is_the_same_413_as_a_content_length_one(path, idle):
    status, body, sent = _stream_chunked(idle.url, path, 100 << 20)  # max_request_bytes: 1 MiB
    declared = httpx.post(idle.url + path, content=b"x" * (2 << 20), headers={"Content-Type": "application/json"})
    # an episode route of an episode that is not open is refused on its header (410), before any body is read
    expected = 413 if path == "/episodes" else 410
    assert declared.status_code == expected
    assert status == expected, (status, body)  # old: 400 "There was an error parsing the body" (chat), 500 (reward)
    assert body["error"]["message"] == declared.json()["error"]["message"]
    assert sent < 16 << 20  # the server stopped reading at the bound (plus what the sockets buffer)
