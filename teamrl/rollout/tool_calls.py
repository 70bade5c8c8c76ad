"""Tool calls: the model's tool-call text parsed into OpenAI ``tool_calls``, by a parser per model family.

A parser turns a completion's text into ``(content, payloads)``: the text outside its tool-call blocks and each
block's raw payload (a JSON text). :func:`parse_tool_calls` decodes the payloads, checks them against the request's
``tools`` and ``tool_choice`` and returns a :class:`ToolParse`: the calls (each an OpenAI ``tool_calls`` entry) or,
when any block is malformed (bad JSON, an unknown function, arguments that are no object or lack a required
parameter, a call ``tool_choice`` does not allow), no calls at all, the whole text as content, and the reasons.

Parsing only shapes the HTTP answer: the Sample keeps the completion's token ids exactly as sampled.

Parsers are registered like tasks and rewards (:class:`~teamrl.core.registry.Registry`): ``@TOOL_CALL_PARSERS.register
("name")`` on a ``parse(text) -> (content, payloads)`` function, or ``package.module:function`` in the config
(``workflow.options.tool_parser``). Shipped:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen2.5/Qwen3, SmolLM3 and
  the gateway's fallback rendering of tool calls for templates without tool support);
- ``llama3_json``: the whole answer is one JSON object ``{"name": ..., "parameters": {...}}`` (or several joined by
  ``;``), as Llama 3.1+ writes a call with its JSON tool-calling prompt.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from teamrl.core.registry import Registry
from teamrl.core.sample import Sample
from teamrl.rollout.asgi import MAX_JSON_DEPTH, RequestError, json_depth, short_repr

Parser = Callable[[str], tuple[str, list[str]]]  # text -> (content outside the calls, each call's raw payload)
TOOL_CALL_PARSERS: Registry[Parser] = Registry("tool-call parser")

# Bounds on what a model's answer can make the parser do (the answer is untrusted text): blocks per answer and
# characters parsed at all; a payload nests at most MAX_JSON_DEPTH deep, as a request body to the gateway.
MAX_TOOL_CALL_BLOCKS = 128
MAX_TOOL_CALL_TEXT = 1_000_000
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


@TOOL_CALL_PARSERS.register("hermes")
def hermes(text: str) -> tuple[str, list[str]]:
    """``<tool_call>{json}</tool_call>`` blocks; an opened block that never closes is a payload too (malformed).
    One pass over the text (a block's payload ends at the first ``</tool_call>`` after its opening)."""
    content: list[str] = []
    payloads: list[str] = []
    at = 0
    while (start := text.find(HERMES_OPEN, at)) >= 0:
        content.append(text[at:start])
        end = text.find(HERMES_CLOSE, start + len(HERMES_OPEN))
        if end < 0:  # cut off (max_tokens) or never closed: its payload will not decode as a whole call
            payloads.append(text[start + len(HERMES_OPEN):] + " (no closing </tool_call>)")
            at = len(text)
            break
        payloads.append(text[start + len(HERMES_OPEN):end])
        at = end + len(HERMES_CLOSE)
    content.append(text[at:])
    return "".join(content).strip(), payloads


@TOOL_CALL_PARSERS.register("llama3_json")
def llama3_json(text: str) -> tuple[str, list[str]]:
    """The answer is one JSON object with a ``name`` (or several separated by ``;``), else plain text."""
    stripped = text.strip()
    if stripped.startswith("<|python_tag|>"):
        stripped = stripped[len("<|python_tag|>"):].strip()
    if not stripped.startswith("{") or '"name"' not in stripped:
        return text, []
    return "", [p for p in (part.strip() for part in stripped.split(";")) if p]


@dataclass
class ToolParse:
    """What one completion's text became: ``calls`` (OpenAI ``tool_calls`` entries; empty: a text answer),
    ``content`` (the text outside the calls, None when empty beside calls) and ``errors`` (why blocks
    were not returned as calls; non-empty means the whole text went back as content)."""

    content: str | None
    calls: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def finish_reason(self) -> str | None:
        """``"tool_calls"`` when the answer is calls, else None (the engine's own reason stands)."""
        return "tool_calls" if self.calls else None

    def info(self) -> dict[str, Any]:
        """What the recorded Sample keeps of the parse (``Sample.tags``): calls by name, and the errors."""
        out: dict[str, Any] = {"tool_calls": [c["function"]["name"] for c in self.calls]}
        if self.errors:
            out["tool_call_errors"] = list(self.errors)
        return out


@dataclass(frozen=True)
class ToolChoice:
    """A request's ``tools`` and ``tool_choice``, checked: ``mode`` none|auto|required|function (``name`` then)."""

    tools: dict[str, dict[str, Any]]  # function name -> its JSON-schema parameters
    mode: str = "auto"
    name: str | None = None

    @property
    def parses(self) -> bool:
        """Whether answers are parsed for calls at all (tools given, and tool_choice is not ``none``)."""
        return bool(self.tools) and self.mode != "none"


def tool_choice(tools: Sequence[dict[str, Any]] | None, choice: Any) -> ToolChoice:
    """Check a request's ``tools`` and ``tool_choice`` (400 naming the field and what is accepted)."""
    table: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise RequestError(400, f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': str, "
                                    f"'parameters': object}}}}; got {short_repr(t)}", "tools")
        params = fn.get("parameters")
        table[fn["name"]] = params if isinstance(params, dict) else {}
    if choice is None:
        return ToolChoice(table, "auto")
    if choice in ("none", "auto", "required"):
        if choice == "required" and not table:
            raise RequestError(400, "tool_choice: 'required' needs tools; send tools or tool_choice 'auto'/'none'",
                               "tool_choice")
        return ToolChoice(table, choice)
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" or not isinstance(name, str):
        raise RequestError(400, f"tool_choice: expected 'none', 'auto', 'required' or {{'type': 'function', "
                                f"'function': {{'name': str}}}}; got {short_repr(choice)}", "tool_choice")
    if name not in table:
        raise RequestError(400, f"tool_choice: function {name!r} is not among the tools {sorted(table)}", "tool_choice")
    return ToolChoice(table, "function", name)


def call_id(seed: Sequence[int], index: int) -> str:
    """A tool call's id, the same for the same sampled tokens (streamed and whole answers agree)."""
    digest = hashlib.sha256(f"{list(seed)}|{index}".encode()).hexdigest()
    return f"call_{digest[:24]}"


def _call(payload: str, choice: ToolChoice) -> tuple[str, str] | str:
    """One payload as (name, arguments JSON text), or the reason it is not a call."""
    if json_depth(payload.encode()) > MAX_JSON_DEPTH:  # json.loads recurses: bound it first, as for a request
        return f"not JSON: nested deeper than {MAX_JSON_DEPTH} arrays/objects: {short_repr(payload)}"
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError) as e:
        return f"not JSON ({e.__class__.__name__}: {e}): {short_repr(payload)}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return f"expected {{'name': str, 'arguments': object}}; got {short_repr(obj)}"
    name = obj["name"]
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        if json_depth(args.encode()) > MAX_JSON_DEPTH:
            return f"{name}: arguments nested deeper than {MAX_JSON_DEPTH} arrays/objects"
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return f"{name}: arguments {short_repr(args)} are not a JSON object"
    if not isinstance(args, dict):
        return f"{name}: arguments {short_repr(args)} are not a JSON object"
    if name not in choice.tools:
        return f"unknown function {name!r}; the tools are {sorted(choice.tools)}"
    if choice.mode == "function" and name != choice.name:
        return f"tool_choice names {choice.name!r}; a call to {name!r} is not returned as a call"
    required = choice.tools[name].get("required")
    missing = [p for p in required if isinstance(p, str) and p not in args] if isinstance(required, list) else []
    if missing:
        return f"{name}: required arguments {missing} are missing"
    return name, json.dumps(args, ensure_ascii=False)


def parse_tool_calls(text: str, parser: Parser, choice: ToolChoice, seed: Sequence[int] = ()) -> ToolParse:
    """``text`` as an OpenAI message: tool calls where ``choice`` allows them and every block is a valid call,
    else the whole text as content with the reasons in ``errors``. ``seed``: the sampled token ids (call ids).
    Never raises: an answer over the bounds (characters, blocks, nesting) or a parser that fails is a reason."""
    if not choice.parses:
        return ToolParse(text)
    if len(text) > MAX_TOOL_CALL_TEXT:
        return ToolParse(text, [], [f"the answer has {len(text)} characters; at most {MAX_TOOL_CALL_TEXT} are "
                                    "parsed for tool calls"])
    try:
        content, payloads = parser(text)
    except Exception as e:  # a user's parser: its failure is this answer's reason, not the episode's crash
        name = getattr(parser, "__name__", type(parser).__name__)
        return ToolParse(text, [], [f"the tool-call parser {name!r} raised {e.__class__.__name__}: "
                                    f"{short_repr(str(e))[1:-1]}"])
    if len(payloads) > MAX_TOOL_CALL_BLOCKS:
        return ToolParse(text, [], [f"{len(payloads)} tool-call blocks; at most {MAX_TOOL_CALL_BLOCKS} are parsed"])
    errors: list[str] = []
    calls = []
    for i, payload in enumerate(payloads):
        got = _call(payload, choice)
        if isinstance(got, str):
            errors.append(got)
        else:
            calls.append({"id": call_id(seed, i), "type": "function",
                          "function": {"name": got[0], "arguments": got[1]}})
    if not calls and not errors and choice.mode in ("required", "function"):
        errors.append(f"tool_choice {choice.name or choice.mode!r}: the answer holds no tool call")
    if errors or not calls:
        return ToolParse(text, [], errors)
    return ToolParse(content or None, calls)


def parser_for(name: str, key: str = "workflow.options.tool_parser") -> Parser:
    """The parser registered as ``name`` (or ``package.module:function``); a ConfigError names the registered ones."""
    return TOOL_CALL_PARSERS.get_entry(name, key)


class ToolAnswer(str):
    """A completion's text (the str itself, as sampled) with its tool calls parsed, what ``ctx.generate(...,
    tools=[...])`` returns: ``tool_calls`` (OpenAI entries, empty for a text answer), ``content`` (the text outside
    them) and ``errors`` (why tool-call text was not returned as calls)."""

    tool_calls: list[dict[str, Any]]
    content: str | None
    errors: list[str]

    def message(self) -> dict[str, Any]:
        """The answer as an OpenAI assistant message (to append to the conversation)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content if self.tool_calls else str(self)}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


def answer_with_tools(sample: Sample, tools: Sequence[dict[str, Any]], choice: Any = None,
                      parser: str = "hermes") -> ToolAnswer:
    """``sample``'s text parsed for calls to ``tools`` (as the gateway parses them; the Sample is not changed but for
    ``tags``, which gain ``tool_calls`` and ``tool_call_errors`` as a gateway call's do). A bad ``tools``,
    ``tool_choice`` or ``parser`` is a ValueError naming it."""
    try:
        parse = parse_tool_calls(sample.text, parser_for(parser, "ctx.generate(tool_parser=...)"),
                                 tool_choice(tools, choice), [*sample.prompt_ids, -1, *sample.completion_ids])
    except RequestError as e:
        raise ValueError(f"ctx.generate: {e.message}") from None
    sample.tags.update(parse.info())
    answer = ToolAnswer(sample.text)
    answer.tool_calls, answer.content, answer.errors = parse.calls, parse.content, parse.errors
    return answer
