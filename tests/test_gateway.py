"""The training gateway: OpenAI-API calls of an episode become exact Samples (teamrl.rollout.gateway).

Episodes run on the tiny random model through a real uvicorn server and the real ``openai`` client.
"""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import openai
import pytest

from teamrl.core.config import ConfigError, load_config
from teamrl.policies.chat import encode_chat
from teamrl.policies.router import role_type
from teamrl.rollout.engine import SamplingParams
from teamrl.rollout.gateway import Gateway, GatewayOptions
from teamrl.rollout.gateway_episode import EpisodeHost
from teamrl.rollout.hf_engine import HFEngine
from teamrl.rollout.scheduler import GenerationScheduler
from teamrl.tasks.solve import MathSolve, MathSolveOptions
from teamrl.workflows.context import EpisodeContext
from teamrl.algorithms.grpo import WorkflowGRPO
from teamrl.core.config import InputError
from teamrl.workflows import Workflow
from teamrl.workflows.openai_workflow import GatewayOutcome, openai_workflow, run_gateway_episode
from teamrl.algorithms import make_algorithm
from teamrl.tasks import make_task

ROLES = ("writer", "checker")


class RecordingEngine(HFEngine):
    """The tiny model's engine; remembers every completion it sampled (and can be slowed down)."""

    def __init__(self, model, tok, delay: float = 0.0) -> None:
        super().__init__(lambda policy: contextlib.nullcontext(model), tok)
        self.sampled: list[tuple[int, ...]] = []
        self.delay = delay
        self.batch_sizes: list[int] = []

    def generate_many(self, calls):
        time.sleep(self.delay)
        out = super().generate_many(calls)
        self.batch_sizes.append(sum(len(requests) for _, requests, _ in calls))
        self.sampled += [tuple(c.token_ids) for per_policy in out for per_request in per_policy for c in per_request]
        return out


@pytest.fixture(scope="module")
def task():
    return MathSolve(MathSolveOptions(num_problems=8, test_size=2))


@pytest.fixture
def engine(tiny):
    model, tok = tiny
    return RecordingEngine(model, tok)


@contextlib.contextmanager
def serving(**options):
    gw = Gateway(GatewayOptions(**options))
    gw.start()
    try:
        yield gw
    finally:
        gw.close()


def run_episodes(gw, engine, task, fn, n, opts=None, roles=ROLES, max_new_tokens=6):
    """``n`` episodes of ``fn`` (None: external) on one scheduler; (contexts, outcomes)."""
    sched = GenerationScheduler(engine, seed=1)
    problems = task.problems()
    ctxs = [EpisodeContext(sched, role_type, engine.tokenizer, SamplingParams(max_new_tokens=max_new_tokens),
                           problems[i % 2].id, i) for i in range(n)]
    opts = opts or gw.options
    outcomes = sched.run([run_gateway_episode("t", fn, roles, ctx, task, problems[i % 2], opts, gateway=gw)
                          for i, ctx in enumerate(ctxs)])
    return ctxs, outcomes, sched


def test_openai_client_calls_are_recorded_with_the_engine_tokens_and_returned_as_vllm_does(engine, task):
    seen: dict[str, list] = {}

    def episode(problem, client):
        a = client.chat.completions.create(model="writer", messages=[{"role": "user", "content": problem["question"]}])
        b = client.chat.completions.create(model="checker", logprobs=True, messages=[
            {"role": "user", "content": problem["question"]}, {"role": "assistant", "content": a.choices[0].message.content},
            {"role": "user", "content": "Check it."}])
        seen[problem["id"] + str(id(client))] = [a, b]
        return {"reward": 0.5, "roles": {"checker": 1.0}}

    with serving(batch_window_s=0.05) as gw:
        ctxs, outcomes, sched = run_episodes(gw, engine, task, episode, 4)
    assert [o.reward for o in outcomes] == [0.5] * 4 and not any(o.stats["dropped"] for o in outcomes)
    samples = [s for c in ctxs for s in c.samples]
    assert [s.role for c in ctxs for s in c.samples] == ["writer", "checker"] * 4
    assert sorted(tuple(s.completion_ids) for s in samples) == sorted(engine.sampled)  # exactly what the engine sampled
    assert {s.role_reward for s in samples if s.role == "checker"} == {1.0}
    assert all(s.turn == 0 for s in samples)
    responses = [r for pair in seen.values() for r in pair]
    assert sorted(tuple(r.choices[0].token_ids) for r in responses) == sorted(engine.sampled)
    by_id = {p.id: p for p in task.problems()}
    for c in ctxs:  # the prompt ids are the chat template applied once, server side
        question = task.question(by_id[c.problem_id])
        assert c.samples[0].prompt_ids == encode_chat(engine.tokenizer, [{"role": "user", "content": question}])
    checker_resp = [pair[1] for pair in seen.values()]
    for r in checker_resp:
        match = next(s for s in samples if tuple(s.completion_ids) == tuple(r.choices[0].token_ids))
        assert r.prompt_token_ids == match.prompt_ids
        assert [t.logprob for t in r.choices[0].logprobs.content] == pytest.approx(match.sampling_logprobs)
    assert max(engine.batch_sizes) > 1  # the episodes' calls shared batches


def test_an_async_episode_function_gets_an_async_client_and_completions_work(engine, task):
    async def episode(problem, client):
        assert isinstance(client, openai.AsyncOpenAI)
        r = await client.completions.create(model="writer", prompt="Say hi", max_tokens=3)
        assert len(r.choices[0].token_ids) <= 3
        models = await client.models.list()
        assert [m.id for m in models.data] == list(ROLES)
        return 1

    with serving() as gw:
        ctxs, outcomes, _ = run_episodes(gw, engine, task, episode, 2)
    assert [len(c.samples) for c in ctxs] == [1, 1] and all(o.correct for o in outcomes)
    assert ctxs[0].samples[0].prompt_ids == engine.tokenizer("Say hi", add_special_tokens=False)["input_ids"]


def test_an_unknown_role_is_a_404_listing_the_roles_and_a_bad_request_is_a_400(engine, task):
    errors = []

    def episode(problem, client):
        for call in (lambda: client.chat.completions.create(model="critic", messages=[{"role": "user", "content": "x"}]),
                     lambda: client.chat.completions.create(model="writer", messages=[]),
                     lambda: client.chat.completions.create(model="writer", n=99, messages=[{"role": "user", "content": "x"}]),
                     lambda: client.completions.create(model="writer", stream=True, prompt="x")):  # chat streams (test_gateway_tools.py)
            try:
                call()
            except openai.APIStatusError as e:
                errors.append((e.status_code, e.message))
        return 0.0

    with serving(max_n=4) as gw:
        ctxs, _, _ = run_episodes(gw, engine, task, episode, 1)
    assert errors[0][0] == 404 and "'critic'" in errors[0][1] and "['writer', 'checker']" in errors[0][1]
    assert [e[0] for e in errors[1:]] == [400, 400, 400]
    assert "messages" in errors[1][1] and "n=99" in errors[2][1] and "stream" in errors[3][1]
    assert ctxs[0].samples == []


def test_request_sizes_are_bounded(engine, task):
    statuses = {}

    def episode(problem, client):
        url = str(client.base_url) + "chat/completions"
        mine = {"X-Episode-Token": client.default_headers["X-Episode-Token"]}  # the episode's token, as its client sends it
        big = httpx.post(url, json={"model": "writer", "messages": [{"role": "user", "content": "x" * 5000}]}, headers=mine)
        many = httpx.post(url, json={"model": "writer", "messages": [{"role": "user", "content": "x"}] * 9}, headers=mine)
        long = httpx.post(url, json={"model": "writer", "messages": [{"role": "user", "content": "y" * 900}]}, headers=mine)
        ids = httpx.post(str(client.base_url) + "completions", json={"model": "writer", "prompt": [1, 10 ** 6]}, headers=mine)
        statuses.update(big=(big.status_code, big.json()), many=many.status_code, long=(long.status_code, long.json()),
                        ids=(ids.status_code, ids.json()))
        return 0.0

    with serving(max_request_bytes=4096, max_messages=8, max_prompt_tokens=512) as gw:
        ctxs, _, _ = run_episodes(gw, engine, task, episode, 1)
    assert statuses["big"][0] == 413 and "4096 bytes" in statuses["big"][1]["error"]["message"]
    assert statuses["many"] == 400
    assert statuses["long"][0] == 400 and "at most 512" in statuses["long"][1]["error"]["message"]
    assert statuses["ids"][0] == 400 and "outside the tokenizer's vocabulary" in statuses["ids"][1]["error"]["message"]
    assert ctxs[0].samples == []


def test_a_bearer_token_is_required_when_set_and_the_default_address_is_loopback(engine, task):
    codes = {}

    def episode(problem, client):  # the client was given the token
        client.chat.completions.create(model="writer", messages=[{"role": "user", "content": "x"}])
        codes["without"] = httpx.get(str(client.base_url) + "models").status_code
        codes["wrong"] = httpx.get(str(client.base_url) + "models", headers={"Authorization": "Bearer nope"}).status_code
        return 1.0

    assert GatewayOptions().host == "127.0.0.1"
    with serving(token="s3cret") as gw:
        assert gw.url.startswith("http://127.0.0.1:")
        ctxs, _, _ = run_episodes(gw, engine, task, episode, 1)
    assert codes == {"without": 401, "wrong": 401} and len(ctxs[0].samples) == 1


def test_an_episode_without_a_reward_in_time_is_dropped_counted_and_closed(engine, task):
    late = {}

    def episode(problem, client):
        client.chat.completions.create(model="writer", messages=[{"role": "user", "content": "x"}])
        time.sleep(1.5)  # past the reward timeout
        try:
            client.chat.completions.create(model="writer", messages=[{"role": "user", "content": "x"}])
        except openai.APIStatusError as e:
            late["status"] = e.status_code
        except Exception as e:
            late["status"] = repr(e)
        return 1.0

    with serving(reward_timeout_s=0.8) as gw:
        ctxs, outcomes, _ = run_episodes(gw, engine, task, episode, 2)
        assert [o.stats["dropped"] for o in outcomes] == [True, True] and gw.stats.episodes_dropped == 2
        assert all(c.samples == [] for c in ctxs)  # the dropped episodes' calls are not trained on
        deadline = time.monotonic() + 5
        while "status" not in late and time.monotonic() < deadline:
            time.sleep(0.05)
    assert late["status"] == 410


def test_a_client_that_disconnects_mid_call_leaves_no_sample(tiny, task):
    model, tok = tiny
    engine = RecordingEngine(model, tok, delay=0.6)  # every batch takes 0.6 s: the first call is abandoned in flight

    def episode(problem, client):
        impatient = client.with_options(timeout=0.2, max_retries=0)
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(model="writer", messages=[{"role": "user", "content": "first"}])
        ok = client.chat.completions.create(model="checker", messages=[{"role": "user", "content": "second"}])
        return {"reward": 1.0, "roles": {"writer": 0.0}} if ok.choices else 0.0

    with serving() as gw:
        ctxs, outcomes, _ = run_episodes(gw, engine, task, episode, 1)
        assert gw.stats.calls_withdrawn == 1 and gw.stats.calls_recorded == 1
    assert [s.role for s in ctxs[0].samples] == ["checker"]
    assert len(engine.sampled) == 2  # the abandoned call was generated, then not recorded


def test_an_external_program_claims_an_episode_calls_and_posts_the_reward(engine, task):
    results = {}

    def external_client(url):
        with httpx.Client(base_url=url, timeout=30) as http:
            claimed = http.post("/episodes", params={"wait": 20}).json()
            results["claimed"] = claimed
            client = openai.OpenAI(base_url=claimed["base_url"], api_key=claimed["token"])  # the episode's own token
            r = client.chat.completions.create(model="writer", messages=[{"role": "user", "content": claimed["problem"]["question"]}])
            results["ids"] = r.choices[0].token_ids
            mine = {"X-Episode-Token": claimed["token"]}
            bad = http.post(f"/episodes/{claimed['episode_id']}/reward", json={"reward": "high"}, headers=mine)
            results["bad"] = bad.status_code
            http.post(f"/episodes/{claimed['episode_id']}/reward", json={"reward": 0.25, "roles": {"writer": 0.75}},
                      headers=mine).raise_for_status()
            results["again"] = http.post(f"/episodes/{claimed['episode_id']}/reward", json={"reward": 1.0}, headers=mine).status_code
            results["none_left"] = http.post("/episodes").status_code

    with serving() as gw:
        worker = threading.Thread(target=external_client, args=(gw.url,))
        worker.start()
        ctxs, outcomes, _ = run_episodes(gw, engine, task, None, 1)
        worker.join(30)
    assert results["claimed"]["roles"] == list(ROLES) and results["claimed"]["problem"]["id"] == ctxs[0].problem_id
    assert results["bad"] == 400 and results["again"] in (409, 410) and results["none_left"] == 204
    (s,) = ctxs[0].samples
    assert s.completion_ids == results["ids"] and s.role_reward == 0.75 and outcomes[0].reward == 0.25


def _black_box_team(problem, client):  # never run: only its registration is refused
    return 0.0


BLACK_BOX = openai_workflow("gateway_refusal_team", roles=("writer", "checker"))(_black_box_team)


@pytest.mark.parametrize("algorithm, reason", [("at_grpo", "replayable=False"), ("magrpo", "replayable=False"),
                                               ("m_grpo", "sub-episodes")])
def test_algorithms_that_cannot_train_a_black_box_program_are_refused_with_the_reason(algorithm, reason):
    # refused by make_algorithm, which the trainer calls before any model loads
    cfg = load_config(None, ["workflow.name=gateway_refusal_team", f"algorithm={algorithm}", "task.name=math.solve"])
    with pytest.raises(ConfigError, match=reason):
        make_algorithm(cfg, make_task(cfg.task))


async def _dropped_episode(ctx, task, problem, settings):
    return GatewayOutcome("", None, False, {"dropped": True, "calls": 0})


DROPPING = Workflow(_dropped_episode, ("writer",))  # referenced as tests.test_gateway:DROPPING


def test_a_step_whose_episodes_were_all_dropped_is_a_clear_error(engine, task):
    algorithm = WorkflowGRPO("tests.test_gateway:DROPPING", group_size=2, options=None)
    sched = GenerationScheduler(engine)

    def make_ctx(p, e, tags):
        return EpisodeContext(sched, role_type, engine.tokenizer, SamplingParams(), p.id, e, tags)

    with pytest.raises(InputError, match="all 4 episodes of this step were dropped"):
        algorithm.rollout(task.problems()[:2], task, make_ctx, sched.run)


def test_tool_calls_pass_through_to_the_template_and_a_roles_repeated_calls_are_its_turns(engine, task):
    tools = [{"type": "function", "function": {"name": "add", "description": "add two numbers",
                                               "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]
    messages = [{"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]

    def episode(problem, client):
        for _ in range(2):
            client.chat.completions.create(model="writer", messages=messages, tools=tools)
        client.chat.completions.create(model="checker", messages=messages[:1])
        return 1.0

    with serving() as gw:
        ctxs, _, _ = run_episodes(gw, engine, task, episode, 1)
    writer = [s for s in ctxs[0].samples if s.role == "writer"]
    expected = [{**m, "content": m["content"] or ""} for m in messages]  # OpenAI's null content is the empty string
    assert writer[0].prompt_ids == encode_chat(engine.tokenizer, expected, tools=tools)
    assert "5" in writer[0].prompt_text and [s.turn for s in writer] == [0, 1]  # the role's k-th call is its turn k
    assert [s.turn for s in ctxs[0].samples if s.role == "checker"] == [0]


def test_an_episode_context_is_what_the_gateway_reads(engine):
    """``EpisodeHost`` (declared in rollout/, below the workflows) is met by the workflows' EpisodeContext."""
    ctx = EpisodeContext(GenerationScheduler(engine, seed=1), role_type, engine.tokenizer, SamplingParams(), "p0", 3, {"k": 1})
    assert set(EpisodeHost.__annotations__) == {"tokenizer", "scheduler", "route", "problem_id", "episode", "tags", "params"}
    for name in EpisodeHost.__annotations__:
        assert hasattr(ctx, name), name
    assert ctx.route("writer_1") == "writer" and ctx.tags == {"k": 1} and ctx.episode == 3


def test_a_response_format_the_gateway_cannot_honour_is_a_400_naming_it(engine, task):
    """Issue 56 item 2: ``response_format`` json_object / json_schema was accepted and ignored: a JSON-mode agent got
    free text with status 200. The gateway samples the model as it is (constrained decoding would change the
    distribution the loss assumes), so it says so in one line; ``{"type": "text"}`` is what it does, and passes."""
    answers = []

    def episode(problem, client):
        msgs = [{"role": "user", "content": "x"}]
        for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}},
                    {"type": "text"}):
            try:
                client.chat.completions.create(model="writer", messages=msgs, response_format=fmt)
                answers.append((fmt["type"], 200, ""))
            except openai.APIStatusError as e:
                answers.append((fmt["type"], e.status_code, e.message))
        return 0.0

    with serving() as gw:
        ctxs, _, _ = run_episodes(gw, engine, task, episode, 1)
    assert [(t, s) for t, s, _ in answers] == [("json_object", 400), ("json_schema", 400), ("text", 200)], answers
    assert all("response_format" in m and "{'type': 'text'}" in m for _, s, m in answers if s == 400), answers
    assert len(ctxs[0].samples) == 1  # only the text call was sampled and recorded


def test_an_async_episodes_client_is_closed_in_its_own_loop(engine, task):
    """Issue 56 item 6: the Agents SDK team on SmolLM2 printed 8 `Task exception was never retrieved ...
    RuntimeError: Event loop is closed`: an async episode's AsyncOpenAI client was never closed, so its connections
    were torn down by the garbage collector after the rollout's loop had closed. Now it is closed at the episode's end,
    in that loop (a sync client was already closed)."""
    clients = []

    async def episode(problem, client):
        clients.append(client)
        await client.completions.create(model="writer", prompt="Say hi", max_tokens=2)
        return 1

    def sync_episode(problem, client):
        clients.append(client)
        client.completions.create(model="writer", prompt="Say hi", max_tokens=2)
        return 1

    with serving() as gw:
        run_episodes(gw, engine, task, episode, 2)
        run_episodes(gw, engine, task, sync_episode, 1)
    assert len(clients) == 3 and all(c.is_closed() for c in clients), [c.is_closed() for c in clients]
