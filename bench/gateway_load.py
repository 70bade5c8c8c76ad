"""Load test of the training gateway on 127.0.0.1: concurrent external episodes vs the in-process engine.

Three rounds on one model and one gateway, each ``--episodes`` episodes x ``--calls`` chat calls
(the roles in turn), every call exactly ``--tokens`` new tokens (EOS ignored), all episodes of a
round on one generation scheduler (one batch per step, as in training):

- in-process: the same episodes as a workflow calling ``ctx.generate`` (no HTTP): the reference;
- gateway: one client thread per episode claims it (``POST /episodes``), makes its calls with the
  ``openai`` client (the episode's token as its api_key) and posts a reward;
- gateway, killed: the same, with ``--kill`` of the clients killed mid-call (the connection is
  dropped while the call waits for its batch; they never post a reward), then a clean round on
  the same server (it keeps serving).

Checked in every gateway round: each completed call of an episode that reported its reward is
recorded exactly once, under its episode and role, with the token ids the client received; nothing
else is recorded; killed clients' episodes are dropped and counted. Printed: calls/s and p50/p99
call latency per round; ``--out`` writes them as a Markdown table.

Usage: python bench/gateway_load.py [--episodes 64] [--calls 3] [--tokens 16] [--kill 0.1]
       [--model tiny-random] [--threads 1] [--out bench/GATEWAY.md]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROLES = ("planner", "worker", "reviewer")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def _summary(name: str, latencies: list[float], wall: float, **extra: Any) -> dict[str, Any]:
    return {"round": name, "calls": len(latencies), "wall_s": wall, "calls_per_s": len(latencies) / wall if wall else 0.0,
            "p50_ms": 1000 * _percentile(latencies, 0.5), "p99_ms": 1000 * _percentile(latencies, 0.99), **extra}


def _contexts(engine: Any, tokenizer: Any, episodes: int, tokens: int, seed: int) -> tuple[Any, list[Any]]:
    from teamrl.policies.router import role_type
    from teamrl.rollout.engine import SamplingParams
    from teamrl.rollout.scheduler import GenerationScheduler
    from teamrl.workflows.context import EpisodeContext

    sched = GenerationScheduler(engine, seed=seed)
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    return sched, [EpisodeContext(sched, role_type, tokenizer, params, f"p{i % 8}", i) for i in range(episodes)]


def _prompt(i: int, k: int, previous: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Episode {i}, step {k}: continue this. {previous[:40]}"}]


def in_process_round(engine: Any, tokenizer: Any, episodes: int, calls: int, tokens: int) -> dict[str, Any]:
    """The reference: the same episodes as a workflow on the episode context."""
    sched, ctxs = _contexts(engine, tokenizer, episodes, tokens, seed=1)
    latencies: list[float] = []

    async def episode(i: int, ctx: Any) -> None:
        text = ""
        for k in range(calls):
            t0 = time.perf_counter()
            text = await ctx.generate(ROLES[k % len(ROLES)], _prompt(i, k, text))
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    sched.run([episode(i, c) for i, c in enumerate(ctxs)])
    return _summary("in-process engine", latencies, time.perf_counter() - t0, engine_batches=len(sched.calls))


def _send_and_die(url: str, body: dict[str, Any], token: str) -> None:
    """A client killed mid-call: the request goes out complete, then the socket closes unread."""
    import json
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    data = json.dumps(body).encode()
    head = (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {token}\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.sendall(head + data)
        time.sleep(0.01)  # the server has read it: the call is in flight


def gateway_round(gateway: Any, engine: Any, tokenizer: Any, task: Any, episodes: int, calls: int, tokens: int,
                  kill: int = 0, name: str = "gateway") -> dict[str, Any]:
    """``episodes`` external episodes driven by client threads, ``kill`` of them killed mid-call; checks exactly-once."""
    import httpx
    import openai

    from teamrl.workflows.openai_workflow import run_gateway_episode

    # the clients are built before the episodes open (building 64 takes seconds on a busy machine; the reward clock runs)
    clients = [openai.OpenAI(base_url=gateway.url, api_key="teamrl", max_retries=0, timeout=60) for _ in range(episodes)]
    http = httpx.Client(base_url=gateway.url, timeout=60, limits=httpx.Limits(max_connections=episodes))  # claims, rewards
    sched, ctxs = _contexts(engine, tokenizer, episodes, tokens, seed=2)
    problems = task.problems()
    latencies: list[float] = []
    received: dict[str, list[tuple[str, tuple[int, ...]]]] = {}  # episode id -> (role, completion ids) the client got
    killed: set[str] = set()
    lock = threading.Lock()
    last_answer, first_call = [0.0], [0.0]
    ready = threading.Barrier(episodes)
    before = dict(vars(gateway.stats))

    errors: list[str] = []

    def client(index: int) -> None:
        try:
            drive(index)
        except Exception as e:  # reported in the summary: the round is not exactly-once then
            with lock:
                errors.append(f"client {index}: {type(e).__name__}: {e}")

    def drive(index: int) -> None:
        claimed = http.post("/episodes", params={"wait": 30}).json()
        ep_id = claimed["episode_id"]
        got: list[tuple[str, tuple[int, ...]]] = []
        dies_at = calls - 1 if index < kill else None  # killed during its last call
        # shares the client's connection pool; the episode's token is its api_key
        oai = clients[index].with_options(base_url=claimed["base_url"], api_key=claimed["token"])
        ready.wait()  # clients built and episodes claimed: the calls start together
        with lock:
            first_call[0] = first_call[0] or time.perf_counter()
        text = ""
        for k in range(calls):
            role = ROLES[k % len(ROLES)]
            if k == dies_at:  # send the whole call, then die: the connection closes while the call waits for its batch
                _send_and_die(claimed["base_url"] + "/chat/completions", {"model": role, "messages": _prompt(index, k, text)},
                              claimed["token"])
                with lock:
                    killed.add(ep_id)
                    received[ep_id] = got
                return
            t0 = time.perf_counter()
            r = oai.chat.completions.create(model=role, messages=_prompt(index, k, text))
            with lock:
                latencies.append(time.perf_counter() - t0)
                last_answer[0] = time.perf_counter()
            text = r.choices[0].message.content
            got.append((role, tuple(r.choices[0].token_ids)))
        with lock:
            received[ep_id] = got
        http.post(f"/episodes/{ep_id}/reward", json={"reward": 1.0},
                  headers={"Authorization": f"Bearer {claimed['token']}"}).raise_for_status()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(episodes)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    outcomes = sched.run([run_gateway_episode("load", None, ROLES, c, task, problems[i % len(problems)], gateway.options,
                                              gateway=gateway) for i, c in enumerate(ctxs)])
    wall = time.perf_counter() - t0
    for t in threads:
        t.join(10)
    http.close()
    recorded = {c.samples[0].tags["gateway_episode"]: [(s.role, tuple(s.completion_ids)) for s in c.samples]
                for c in ctxs if c.samples}
    completed = {e: got for e, got in received.items() if e not in killed}
    after = vars(gateway.stats)
    delta = {k: after[k] - before[k] for k in after}
    # calls/s over the time the calls took (a killed round also waits reward_timeout_s for the dead clients' rewards)
    return _summary(name, latencies, last_answer[0] - first_call[0], round_wall_s=wall, setup_s=first_call[0] - t0, engine_batches=len(sched.calls), killed=len(killed),
                    dropped=sum(bool(o.stats["dropped"]) for o in outcomes),
                    exactly_once=recorded == completed and len(completed) == episodes - len(killed) and not errors,
                    client_errors=errors,
                    withdrawn=delta["calls_withdrawn"], recorded_calls=sum(len(v) for v in recorded.values()))


def run(episodes: int = 64, calls: int = 3, tokens: int = 16, kill_fraction: float = 0.1, model: str = "tiny-random",
        reward_timeout_s: float = 10.0, batch_window_s: float = 0.1) -> list[dict[str, Any]]:
    """The three rounds (plus the clean round after the kills); one summary dict per round."""
    from teamrl.policies.models import load_model
    from teamrl.rollout.hf_engine import HFEngine
    from teamrl.tasks.solve import MathSolve, MathSolveOptions
    from teamrl.rollout.gateway import Gateway, GatewayOptions

    model_, tok = load_model(model, seed=0)
    engine = HFEngine(lambda policy: contextlib.nullcontext(model_), tok)
    task = MathSolve(MathSolveOptions(source="generated_easy", num_problems=16, test_size=2))
    gateway = Gateway(GatewayOptions(reward_timeout_s=reward_timeout_s, max_episodes=max(256, episodes),
                                     batch_window_s=batch_window_s))
    gateway.start()
    try:
        rounds = [in_process_round(engine, tok, episodes, calls, tokens),
                  gateway_round(gateway, engine, tok, task, episodes, calls, tokens)]
        kill = max(1, round(kill_fraction * episodes)) if kill_fraction > 0 else 0
        rounds.append(gateway_round(gateway, engine, tok, task, episodes, calls, tokens, kill=kill,
                                    name=f"gateway, {kill} clients killed mid-call"))
        rounds.append(gateway_round(gateway, engine, tok, task, episodes, calls, tokens, name="gateway, next round"))
    finally:
        gateway.close()
    return rounds


def markdown(rounds: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = ["# Training gateway load test\n",
             f"`python bench/gateway_load.py --episodes {args.episodes} --calls {args.calls} --tokens {args.tokens} "
             f"--kill {args.kill} --model {args.model} --batch-window {args.batch_window}` on 127.0.0.1 ({args.threads} torch thread(s)); "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n",
             "Every call generates exactly --tokens tokens (EOS ignored); all episodes of a round share one generation "
             "scheduler. Latency is per call (client side for the gateway).\n",
             "| round | calls | calls/s | p50 ms | p99 ms | engine batches | killed | dropped | withdrawn | exactly once |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rounds:
        lines.append(f"| {r['round']} | {r['calls']} | {r['calls_per_s']:.1f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
                     f"{r['engine_batches']} | {r.get('killed', '-')} | {r.get('dropped', '-')} | {r.get('withdrawn', '-')} | "
                     f"{r.get('exactly_once', '-')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--kill", type=float, default=0.1, help="fraction of clients killed mid-call in the third round")
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-window", type=float, default=0.1, help="workflow.options.batch_window_s of the gateway")
    p.add_argument("--out", type=Path, default=None, help="write the table here (e.g. bench/GATEWAY.md)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    rounds = run(args.episodes, args.calls, args.tokens, args.kill, args.model, batch_window_s=args.batch_window)
    for r in rounds:
        for e in r.get("client_errors", [])[:5]:
            print(f"{r['round']}: {e}", file=sys.stderr)
        print(f"{r['round']:<40} {r['calls']:>4} calls  {r['calls_per_s']:7.1f} calls/s  p50 {r['p50_ms']:6.0f} ms  "
              f"p99 {r['p99_ms']:6.0f} ms  batches {r['engine_batches']:>3}  killed {r.get('killed', '-')}  dropped "
              f"{r.get('dropped', '-')}  withdrawn {r.get('withdrawn', '-')}  exactly once {r.get('exactly_once', '-')}")
    if args.out:
        args.out.write_text(markdown(rounds, args))
    ok = all(r.get("exactly_once", True) for r in rounds)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
