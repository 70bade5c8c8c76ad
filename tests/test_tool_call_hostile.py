"""A model's answer cannot crash or stall tool-call parsing (teamrl.rollout.tool_calls, the gateway, ctx.generate).

An answer nested deeper than the depth bound, thousands of ``<tool_call>`` blocks, an answer longer than the
character bound or a parser that raises come back as content with the reason, counted as malformed, and the call
is recorded like any other.
"""

from __future__ import annotations

import time

import pytest

from teamrl.rollout.asgi import MAX_JSON_DEPTH
from teamrl.rollout.engine import SamplingParams
from teamrl.rollout.scheduler import GenerationScheduler
from teamrl.rollout.tool_calls import (
    MAX_TOOL_CALL_BLOCKS,
    MAX_TOOL_CALL_TEXT,
    TOOL_CALL_PARSERS,
    hermes,
    llama3_json,
    parse_tool_calls,
    tool_choice,
)
from teamrl.policies.router import role_type
from teamrl.workflows.context import EpisodeContext
from tests.scripted import TOK
from tests.test_gateway import serving
from tests.test_gateway_tools import ADD, run, scripted, task  # noqa: F401  (task: the module's fixture)

BRACKETS = '<tool_call>{"name":"f","arguments":{"x":' + "[" * 1800  # 1,811 characters, the red team's answer


def test_an_answer_nested_1800_deep_is_content_with_the_reason_and_the_call_is_recorded(task):  # noqa: F811
    seen = {}

    def episode(problem, client):
        seen["answer"] = client.with_options(max_retries=0).chat.completions.create(
            model="planner", messages=[{"role": "user", "content": "x"}], tools=[ADD])
        return 1.0

    with serving() as gw:
        (ctx,), _ = run(gw, scripted([BRACKETS]), task, episode, max_new_tokens=4096)
        assert (gw.stats.tool_calls, gw.stats.tool_calls_malformed, gw.stats.calls_recorded) == (0, 1, 1)
    choice = seen["answer"].choices[0]
    assert choice.message.tool_calls is None and choice.message.content == BRACKETS
    (sample,) = ctx.samples
    assert sample.text == BRACKETS and f"nested deeper than {MAX_JSON_DEPTH}" in sample.tags["tool_call_errors"][0]


def test_ctx_generate_with_tools_returns_a_deep_answer_as_text_with_the_reason():
    sched = GenerationScheduler(scripted([BRACKETS]), seed=0)
    ctx = EpisodeContext(sched, role_type, TOK, SamplingParams(max_new_tokens=4096), "p0", 0)
    (answer,) = sched.run([ctx.generate("planner", "x", tools=[ADD])])
    assert answer == BRACKETS and answer.tool_calls == [] and "nested deeper than" in answer.errors[0]
    assert ctx.samples[0].tags["tool_call_errors"] == answer.errors


@pytest.mark.parametrize("text", [
    "<tool_call>" * 8000,                                        # unclosed blocks: quadratic for a lazy regex
    "<tool_call>{}</tool_call>" * 8000,                          # closed blocks, each malformed
    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>' * 8000,  # valid, too many
    "[" * 400_000,                                               # llama3_json sees no object; hermes no block
    '{"name": "add", "arguments": ' + "[" * 400_000,             # llama3_json: deep
], ids=["unclosed", "closed", "valid", "brackets", "deep-json"])
@pytest.mark.parametrize("parser", [hermes, llama3_json], ids=["hermes", "llama3_json"])
def test_parsing_thousands_of_blocks_is_linear_and_bounded(text, parser):
    choice = tool_choice([ADD], None)
    start = time.perf_counter()
    parse = parse_tool_calls(text, parser, choice)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"{parser.__name__} took {elapsed:.2f} s on {len(text)} characters"
    assert parse.calls == [] and parse.content == text
    assert len(parse.errors) <= MAX_TOOL_CALL_BLOCKS + 1 and all(len(e) < 400 for e in parse.errors)


def test_too_many_blocks_and_too_long_an_answer_are_named_in_one_reason():
    choice = tool_choice([ADD], None)
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert len(parse_tool_calls(call * MAX_TOOL_CALL_BLOCKS, hermes, choice).calls) == MAX_TOOL_CALL_BLOCKS
    parse = parse_tool_calls(call * (MAX_TOOL_CALL_BLOCKS + 1), hermes, choice)
    assert parse.calls == [] and parse.errors == [
        f"{MAX_TOOL_CALL_BLOCKS + 1} tool-call blocks; at most {MAX_TOOL_CALL_BLOCKS} are parsed"]
    long = call + " " * MAX_TOOL_CALL_TEXT
    parse = parse_tool_calls(long, hermes, choice)
    assert parse.calls == [] and parse.content == long and parse.errors == [
        f"the answer has {len(long)} characters; at most {MAX_TOOL_CALL_TEXT} are parsed for tool calls"]


def test_the_depth_bound_counts_brackets_outside_strings_only():
    choice = tool_choice([ADD], None)
    inside = '{"name": "add", "arguments": {"a": 1, "b": 2, "c": "' + "[" * 5000 + '"}}'
    assert parse_tool_calls(f"<tool_call>{inside}</tool_call>", hermes, choice).calls  # brackets in a string
    deep = '{"name": "add", "arguments": {"a": 1, "b": 2, "c": ' + "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert not parse_tool_calls(f"<tool_call>{deep}}}}}</tool_call>", hermes, choice).calls
    fits = '{"name": "add", "arguments": {"a": 1, "b": 2, "c": ' + "[" * 10 + "]" * 10 + "}}"
    assert parse_tool_calls(f"<tool_call>{fits}</tool_call>", hermes, choice).calls
    escaped = '{"name": "add", "arguments": {"a": 1, "b": 2, "c": "\\"' + "[" * 5000 + '\\\\"}}'
    assert parse_tool_calls(f"<tool_call>{escaped}</tool_call>", hermes, choice).calls  # \" does not end a string


def test_a_parser_that_raises_is_a_reason_not_a_crash():
    @TOOL_CALL_PARSERS.register("raising_parser")
    def raising(text):
        raise IndexError("boom")
    try:
        parse = parse_tool_calls("<tool_call>x</tool_call>", raising, tool_choice([ADD], None))
    finally:
        del TOOL_CALL_PARSERS["raising_parser"]
    assert parse.calls == [] and parse.errors == ["the tool-call parser 'raising' raised IndexError: boom"]
