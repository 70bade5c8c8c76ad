"""Tool calls and streaming through the training gateway (teamrl.rollout.tool_calls, chat_turns, gateway_app).

A scripted engine (tests/scripted.py, on the tiny model's byte tokenizer) writes the tool-call text; the real
uvicorn gateway and the real ``openai`` client carry it. Parsing shapes the HTTP answer only: the Samples keep the
tokens the engine produced.
"""

from __future__ import annotations

import contextlib
import copy
import json

import pytest

from teamrl.core.config import ConfigError
from teamrl.policies.chat import render_chat, supports_tools
from teamrl.policies.models import CHATML_TEMPLATE
from teamrl.policies.router import role_type
from teamrl.rollout.engine import SamplingParams
from teamrl.rollout.gateway import GatewayOptions
from teamrl.rollout.hf_engine import HFEngine
from teamrl.rollout.scheduler import GenerationScheduler
from teamrl.rollout.tool_calls import TOOL_CALL_PARSERS, hermes, llama3_json, parse_tool_calls, tool_choice
from teamrl.tasks.solve import MathSolve, MathSolveOptions
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.openai_workflow import run_gateway_episode
from tests.scripted import TOK, ScriptedEngine
from tests.test_gateway import serving

ROLES = ("planner", "worker")
ADD = {"type": "function", "function": {"name": "add", "description": "add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
MUL = {"type": "function", "function": {"name": "mul", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def task():
    return MathSolve(MathSolveOptions(num_problems=4, test_size=1))


def run(gw, engine, task, fn, n=1, tokenizer=TOK, roles=ROLES, max_new_tokens=64):
    sched = GenerationScheduler(engine, seed=3)
    problems = task.problems()
    ctxs = [EpisodeContext(sched, role_type, tokenizer, SamplingParams(max_new_tokens=max_new_tokens), problems[0].id, i)
            for i in range(n)]
    outcomes = sched.run([run_gateway_episode("t", fn, roles, c, task, problems[0], gw.options, gateway=gw)
                          for c in ctxs])
    return ctxs, outcomes


def shipped_tokenizers():
    """The shipped chat templates: the tiny model's ChatML, and SmolLM2-135M-Instruct's where it is converted here."""
    from teamrl.policies.models import cache_dir
    smollm2 = cache_dir() / "models" / "smollm2-135m"
    marks = pytest.mark.skipif(not (smollm2 / "tokenizer.json").is_file(), reason=f"SmolLM2 is not converted at {smollm2}")
    return [pytest.param("tiny", id="tiny-random"), pytest.param(str(smollm2), id="smollm2-135m", marks=marks)]


def load_tokenizer(name):
    from transformers import AutoTokenizer
    return TOK if name == "tiny" else AutoTokenizer.from_pretrained(name)


def scripted(texts, tokenizer=TOK):
    """An engine answering the k-th request with ``texts[k]`` (the last one after that)."""
    calls = []

    def script(policy, prompt, n):
        calls.append(prompt)
        return [texts[min(len(calls) - 1, len(texts) - 1)]] * n
    engine = ScriptedEngine(script, tokenizer)
    engine.calls = calls
    return engine


# ---- the parsers -------------------------------------------------------------------------------------
def test_the_hermes_and_llama3_parsers_split_text_and_calls_and_unknown_parsers_fail_at_config_load():
    assert hermes(f"Let me add.\n{CALL}") == ("Let me add.", ['\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'])
    content, payloads = hermes('<tool_call>{"name": "add", "arguments": {"a": 1')
    assert content == "" and "no closing" in payloads[0]
    assert llama3_json('{"name": "add", "parameters": {"a": 1, "b": 2}}') == ("", ['{"name": "add", "parameters": {"a": 1, "b": 2}}'])
    assert llama3_json("just text") == ("just text", [])
    choice = tool_choice([ADD], None)
    parse = parse_tool_calls('{"name": "add", "parameters": {"a": 1, "b": 2}}', llama3_json, choice, [1, 2])
    assert parse.calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'} and parse.content is None
    assert parse.calls[0]["id"] == parse_tool_calls('{"name": "add", "parameters": {"a": 1, "b": 2}}', llama3_json,
                                                    choice, [1, 2]).calls[0]["id"]  # same tokens, same id
    assert {"hermes", "llama3_json"} <= set(TOOL_CALL_PARSERS)
    with pytest.raises(ConfigError, match="'qwen9' is not a registered tool-call parser; registered: .*hermes"):
        GatewayOptions(tool_parser="qwen9")


@pytest.mark.parametrize("text, choice, tools, calls, error", [
    (CALL, None, [ADD], ["add"], None),
    (CALL, "none", [ADD], [], None),
    (CALL, "auto", None, [], None),  # no tools offered: never parsed
    (CALL, "required", [ADD], ["add"], None),
    ("no call", "required", [ADD], [], "holds no tool call"),
    (CALL, {"type": "function", "function": {"name": "mul"}}, [ADD, MUL], [], "tool_choice names 'mul'"),
    ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": }}</tool_call>', None, [ADD], [], "not JSON"),
    ('<tool_call>{"name": "sub", "arguments": {}}</tool_call>', None, [ADD], [], "unknown function 'sub'"),
    ('<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>', None, [ADD], [], "required arguments ['b']"),
    (CALL + '<tool_call>{"name": "sub", "arguments": {}}</tool_call>', None, [ADD], [], "unknown function"),
])
def test_tool_choice_decides_what_is_returned_as_a_call(text, choice, tools, calls, error):
    parse = parse_tool_calls(text, hermes, tool_choice(tools, choice))
    assert [c["function"]["name"] for c in parse.calls] == calls
    if not calls:
        assert parse.content == text  # a text answer, or a malformed call returned as text
    assert (error is None and not parse.errors) or error in parse.errors[0]


def test_a_bad_tools_or_tool_choice_is_a_400_naming_it():
    from teamrl.rollout.asgi import RequestError
    for tools, choice, field in [([{"type": "function"}], None, "tools"), ([ADD], "sometimes", "tool_choice"),
                                 ([ADD], {"type": "function", "function": {"name": "mul"}}, "tool_choice"),
                                 (None, "required", "tool_choice")]:
        with pytest.raises(RequestError) as e:
            tool_choice(tools, choice)
        assert e.value.status == 400 and e.value.param == field


# ---- through the gateway ---------------------------------------------------------------------------------
def test_tool_call_text_becomes_tool_calls_and_the_sample_keeps_the_sampled_tokens(task):
    engine = scripted([f"I will add.{CALL}", '<tool_call>{"name": "sub", "arguments": {}}</tool_call>', CALL])
    seen = {}

    def episode(problem, client):
        msgs = [{"role": "user", "content": "2 + 3?"}]
        seen["call"] = client.chat.completions.create(model="planner", messages=msgs, tools=[ADD])
        seen["bad"] = client.chat.completions.create(model="worker", messages=msgs, tools=[ADD])
        seen["none"] = client.chat.completions.create(model="worker", messages=msgs, tools=[ADD], tool_choice="none")
        return 1.0

    with serving() as gw:
        (ctx,), _ = run(gw, engine, task, episode)
        assert (gw.stats.tool_calls, gw.stats.tool_calls_malformed) == (1, 1)
    choice = seen["call"].choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will add."
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert call.id.startswith("call_")
    planner, bad, none = ctx.samples
    assert planner.completion_ids == TOK.encode(f"I will add.{CALL}", add_special_tokens=False)  # as sampled
    assert planner.text == f"I will add.{CALL}" and planner.tags["tool_calls"] == ["add"]
    assert seen["bad"].choices[0].message.tool_calls is None and seen["bad"].choices[0].finish_reason == "stop"
    assert seen["bad"].choices[0].message.content == bad.text and "unknown function 'sub'" in bad.tags["tool_call_errors"][0]
    assert seen["none"].choices[0].message.content == CALL and "tool_calls" not in none.tags


def test_malformed_calls_reach_the_metrics_and_the_reward(task):
    from teamrl.workflows import WORKFLOWS, outcome_metrics
    from teamrl.workflows.openai_workflow import openai_workflow

    def episode(problem, client):
        client.chat.completions.create(model="planner", messages=[{"role": "user", "content": "x"}], tools=[ADD])
        return 1.0

    engine = scripted(['<tool_call>{"name": "add"</tool_call>'])
    openai_workflow("tools_metrics_team", roles=ROLES)(episode)
    try:
        with serving() as gw:
            (ctx,), outcomes = run(gw, engine, task, episode)
        metrics = outcome_metrics("tools_metrics_team", outcomes)
    finally:
        del WORKFLOWS["tools_metrics_team"]
    assert metrics["tool_calls_malformed"] == 1 and metrics["tool_calls"] == 0 and metrics["prefix_breaks"] == 0
    assert "not JSON" in ctx.samples[0].tags["tool_call_errors"][0]


def test_streamed_text_and_tool_calls_equal_the_whole_answer(tiny, task):
    model, tok = tiny
    answers = {}

    def episode_for(stream):
        def episode(problem, client):
            msgs = [{"role": "user", "content": "Say something."}]
            if not stream:
                r = client.chat.completions.create(model="planner", messages=msgs, max_tokens=12)
                answers[stream] = (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens)
                return 1.0
            text, finish, usage = "", None, None
            for chunk in client.chat.completions.create(model="planner", messages=msgs, max_tokens=12, stream=True,
                                                        stream_options={"include_usage": True}):
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
                for c in chunk.choices:
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
            answers[stream] = (text, finish, usage)
            return 1.0
        return episode

    engine = HFEngine(lambda policy: contextlib.nullcontext(model), tok)
    with serving() as gw:
        whole = run(gw, engine, task, episode_for(False), tokenizer=tok)[0][0].samples
        streamed = run(gw, engine, task, episode_for(True), tokenizer=tok)[0][0].samples  # same seed: same tokens
        assert gw.stats.calls_recorded == 2 and gw.stats.calls_streamed == 1  # each sample recorded once, whole
    assert whole[0].completion_ids == streamed[0].completion_ids
    assert answers[True] == answers[False] and answers[True][0] == whole[0].text

    calls = {}

    def tools_episode(problem, client):
        msgs = [{"role": "user", "content": "2 + 3?"}]
        calls["whole"] = client.chat.completions.create(model="planner", messages=msgs, tools=[ADD]).choices[0].message
        stream = client.chat.completions.create(model="planner", messages=msgs, tools=[ADD], stream=True)
        parts, finish = {}, None
        for chunk in stream:
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or ():
                    part = parts.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                    part["id"] = d.id or part["id"]
                    part["name"] += d.function.name or ""
                    part["arguments"] += d.function.arguments or ""
        calls["stream"], calls["finish"] = parts, finish
        return 1.0

    with serving() as gw:
        run(gw, scripted([CALL]), task, tools_episode)
    (whole_call,) = calls["whole"].tool_calls
    assert calls["finish"] == "tool_calls"
    assert calls["stream"] == {0: {"id": whole_call.id, "name": "add", "arguments": whole_call.function.arguments}}


# ---- tool calls in, and prefix breaks ---------------------------------------------------------------
def agent_loop(problem, client):
    """An agent's loop as frameworks write it: call, run the tool, send its result back, answer."""
    msgs = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "2 + 3?"}]
    for _ in range(2):
        r = client.chat.completions.create(model="planner", messages=msgs, tools=[ADD])
        message = r.choices[0].message
        msgs.append(message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio", "function_call"}))
        for call in message.tool_calls or ():
            args = json.loads(call.function.arguments)
            msgs.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    return 1.0


@pytest.mark.parametrize("template", shipped_tokenizers())
def test_a_template_without_tool_support_gets_the_fallback_rendering_and_keeps_the_prefix(task, template):
    tok = load_tokenizer(template)
    assert not supports_tools(tok)  # ChatML of the tiny model; SmolLM2's is the same form
    engine = scripted([f"Adding.{CALL}", "It is 5."], tok)
    with serving() as gw:
        (ctx,), _ = run(gw, engine, task, agent_loop, tokenizer=tok)
        assert gw.stats.prefix_breaks == 0 and gw.stats.tool_calls == 1
    first, second = ctx.samples
    assert "<tools>" in first.prompt_text and '"name": "add"' in first.prompt_text  # the tools, Hermes style
    # the second prompt holds the first call's tokens exactly as sampled, then the tool's answer as a user turn
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)] == first.prompt_ids + first.completion_ids
    assert "<tool_response>\n5\n</tool_response>" in second.prompt_text
    assert "prefix_break" not in second.tags


def test_fallback_rendering_of_tool_calls_the_gateway_did_not_return():
    messages = [{"role": "user", "content": "2 + 3?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "x", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
                {"role": "tool", "tool_call_id": "x", "content": "5"}]
    text = render_chat(TOK, [{**m, "content": m["content"] or ""} for m in messages], tools=[ADD])
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>" in text
    assert text.startswith("<|im_start|>system\n# Tools")


def test_a_template_that_re_renders_an_earlier_answer_is_a_counted_prefix_break_naming_role_and_turn(task):
    breaking = copy.deepcopy(TOK)  # renders earlier assistant answers trimmed and bracketed: not what was sampled
    breaking.chat_template = CHATML_TEMPLATE.replace(
        "message['content'] + '<|im_end|>'",
        "(('[' + message['content'] | trim + ']') if message['role'] == 'assistant' else message['content'])"
        " + '<|im_end|>'")

    def episode(problem, client):
        msgs = [{"role": "user", "content": "hi"}]
        for _ in range(3):
            r = client.chat.completions.create(model="worker", messages=msgs)
            msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "go on"}]
        client.chat.completions.create(model="worker", messages=[{"role": "user", "content": "a new chat"}])
        return 1.0

    with serving() as gw:
        (ctx,), outcomes = run(gw, scripted([" one ", "two", "three", "four"]), task, episode, tokenizer=breaking)
        assert gw.stats.prefix_breaks == 2  # calls 2 and 3 continue the worker's previous call; call 4 is a new chat
    assert [s.tags.get("prefix_break", {}).get("turn") for s in ctx.samples] == [None, 1, 2, None]
    assert ctx.samples[1].tags["prefix_break"]["role"] == "worker" and outcomes[0].stats["prefix_breaks"] == 2
    for template in ("tiny", *[p.values[0] for p in shipped_tokenizers()[1:] if not p.marks[0].args[0]]):
        tok = load_tokenizer(template)
        with serving() as gw:  # the same team on the shipped templates: no break
            run(gw, scripted([" one ", "two", "three", "four"], tok), task, episode, tokenizer=tok)
            assert gw.stats.prefix_breaks == 0, template


def test_malformed_tools_tool_choice_and_tool_calls_in_messages_are_400s_naming_the_field(task):
    import httpx
    answers = []

    def episode(problem, client):
        url = str(client.base_url) + "chat/completions"
        mine = {"X-Episode-Token": client.default_headers["X-Episode-Token"]}
        user = {"role": "user", "content": "x"}
        for body in [
            {"tools": [ADD], "tool_choice": {"type": "function", "function": "add"}},
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": 5}}}]},
            {"messages": [user, {"role": "assistant", "content": None, "tool_calls": "add"}]},
            {"messages": [user, {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": "add"}]}]},
            {"messages": [user, {"role": "assistant", "content": None,
                                 "tool_calls": [{"id": "c", "function": {"name": 5, "arguments": "{}"}}]}]},
        ]:
            r = httpx.post(url, json={"model": "planner", "messages": [user], **body}, headers=mine)
            answers.append((r.status_code, r.json()["error"]["param"] if r.status_code != 200 else None))
        return 1.0

    with serving() as gw:
        run(gw, scripted([CALL]), task, episode)
    assert answers[0] == (400, "tool_choice")
    assert answers[1][0] in (200, 400)  # a schema's odd `required` is not a crash
    assert [a[0] for a in answers[2:]] == [400, 400, 400] and all("messages" in (a[1] or "") for a in answers[2:])


def test_ctx_generate_with_tools_returns_the_calls_parsed_as_the_gateway_parses_them():
    engine = scripted([f"Adding.{CALL}", "It is 5."])
    sched = GenerationScheduler(engine, seed=0)
    ctx = EpisodeContext(sched, role_type, TOK, SamplingParams(max_new_tokens=64), "p0", 0)

    async def workflow():
        msgs = [{"role": "user", "content": "2 + 3?"}]
        first = await ctx.generate("planner", msgs, tools=[ADD])
        msgs.append(first.message())
        msgs += [{"role": "tool", "tool_call_id": c["id"], "content": "5"} for c in first.tool_calls]
        second = await ctx.generate("planner", msgs, tools=[ADD])
        plain = await ctx.generate("worker", "no tools here")
        return first, second, plain

    (first, second, plain), = sched.run([workflow()])
    assert first == f"Adding.{CALL}" and first.content == "Adding." and first.tool_calls[0]["function"]["name"] == "add"
    assert second.tool_calls == [] and second.message() == {"role": "assistant", "content": "It is 5."}
    assert type(plain) is str
    s1, s2, _ = ctx.samples
    assert "<tools>" in s1.prompt_text and s1.tags["tool_calls"] == ["add"] and ctx.calls[0].tools == [ADD]
    assert s1.completion_ids == TOK.encode(f"Adding.{CALL}", add_special_tokens=False)  # as sampled
    assert "<tool_response>\n5\n</tool_response>" in s2.prompt_text and "<tool_call>" in s2.prompt_text
    with pytest.raises(ConfigError, match="ctx.generate\\(tool_parser=...\\): 'xml' is not a registered"):
        sched.run([ctx.generate("planner", "x", tools=[ADD], tool_parser="xml")])


def test_a_users_parser_registers_like_a_reward_and_is_named_in_the_config():
    from teamrl.api import register_tool_parser

    @register_tool_parser("bracket_calls")
    def bracket(text):  # [[{"name": ..., "arguments": ...}]]
        inside = text.partition("[[")[2].partition("]]")[0]
        return (text.partition("[[")[0].strip(), [inside]) if inside else (text, [])
    try:
        assert GatewayOptions(tool_parser="bracket_calls").tool_parser == "bracket_calls"
        parse = parse_tool_calls('ok [[{"name": "add", "arguments": {"a": 1, "b": 2}}]]', bracket, tool_choice([ADD], None))
        assert parse.content == "ok" and parse.calls[0]["function"]["name"] == "add"
        assert GatewayOptions(tool_parser="teamrl.rollout.tool_calls:hermes")  # package.module:function works too
    finally:
        del TOOL_CALL_PARSERS["bracket_calls"]


@pytest.mark.parametrize("text", ["Hello wörld, 17 + 25 = 42 ✓", " two  spaces", "日本語", ""])
def test_streamed_pieces_spell_the_text_and_split_no_character(text):
    from teamrl.rollout.gateway_app import _text_pieces
    ids = TOK.encode(text, add_special_tokens=False)
    pieces = list(_text_pieces(text, ids, TOK))
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    assert len(pieces) == len(text)  # the byte tokenizer: one piece per character, multi-byte ones whole
    assert "".join(_text_pieces(text[:-1] if text else "", ids, TOK)) == (text[:-1] if text else "")  # a cut text


def test_the_same_call_in_two_choices_or_two_episodes_gets_two_ids():
    """Issue 56 item 4: a call's id was a hash of the sampled tokens alone, so the same call sampled twice from the
    same prompt (two choices of an n=2 request, or two episodes of a group) got the same id. Checked: a call
    repeated later in one conversation already got another (its prompt holds the first); now the episode and the
    choice are part of the id too, and the same sample still gets the same id (streamed and whole answers agree)."""
    from teamrl.core.sample import Sample
    from teamrl.rollout.gateway import Gateway, GatewayOptions

    gw = Gateway(GatewayOptions())
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'

    def sample(episode: int, branch: int) -> Sample:
        return Sample(role="writer", policy="shared", problem_id="p", prompt_ids=[1, 2, 3], completion_ids=[4, 5],
                      sampling_logprobs=[0.0, 0.0], text=text, episode=episode, branch=branch)

    ids = [gw._parse(sample(e, b), tool_choice([ADD], None)).calls[0]["id"] for e, b in ((0, 0), (0, 1), (1, 0), (0, 0))]
    assert ids[0] == ids[3] and len(set(ids[:3])) == 3, ids
