"""Chat templates, applied the same way everywhere: one function turns messages into prompt ids.

Tools: a template that handles them (it reads ``tools`` and ``tool_calls``, as Qwen's and Llama 3.1's do) gets the
messages and tools as they are. A template without tool support (SmolLM2-135M-Instruct's, the tiny test model's
ChatML) gets the Hermes rendering instead (:func:`tool_fallback`): the tool definitions in the system message as
Qwen2.5 writes them, an assistant message's ``tool_calls`` as ``<tool_call>{"name", "arguments"}</tool_call>``
blocks after its content, and a ``tool`` message as a user turn ``<tool_response>...</tool_response>``.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from transformers import PreTrainedTokenizerBase

Messages = Sequence[dict[str, str]]


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: Messages | str, tools: Sequence[dict[str, Any]] | None = None
) -> str:
    """The prompt text: the tokenizer's chat template with the assistant turn opened.

    A plain string is one user message. ``tools``: OpenAI-style tool definitions, passed to the
    template (messages may carry ``tool_calls`` / ``tool_call_id`` the same way).
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] = {m!r}: expected a dict with 'role' and 'content'")
    uses_tools = tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if uses_tools and not supports_tools(tokenizer):
        messages, tools = tool_fallback(messages, tools), None
    extra = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **extra)


def encode_chat(
    tokenizer: PreTrainedTokenizerBase, messages: Messages | str, tools: Sequence[dict[str, Any]] | None = None
) -> list[int]:
    """Prompt token ids for ``messages`` (the template adds special tokens itself)."""
    return tokenizer(render_chat(tokenizer, messages, tools), add_special_tokens=False)["input_ids"]


TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


def supports_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template renders tools itself (it reads ``tools`` and ``tool_calls``)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: the default one
        template = template.get("default", "")
    return isinstance(template, str) and "tool_calls" in template and "tools" in template.replace("tool_calls", "")


def _arguments(arguments: Any) -> Any:
    """A tool call's arguments as a JSON value (OpenAI sends them as JSON text)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def assistant_text(message: dict[str, Any]) -> str:
    """An assistant message as the text a model writes (Hermes): its content, then each tool call as a
    ``<tool_call>`` block, which the gateway's ``hermes`` parser reads back as that call."""
    text = message.get("content") or ""
    blocks = [json.dumps({"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))},
                         ensure_ascii=False) for c in message.get("tool_calls") or ()]
    return "\n".join([text] * bool(text) + [f"<tool_call>\n{b}\n</tool_call>" for b in blocks]) if blocks else text


def tool_fallback(messages: Messages, tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The Hermes rendering of tools and tool calls as plain messages, for a template without tool support."""
    out = []
    for m in messages:
        role, text = m["role"], assistant_text(m)
        if role == "tool":
            role, text = "user", f"<tool_response>\n{text}\n</tool_response>"
        out.append({"role": role, "content": text})
    if tools:
        listing = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{listing}"
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out
