"""Chat templates, applied the same way everywhere: one function turns messages into prompt ids."""

from __future__ import annotations

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
    extra = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **extra)


def encode_chat(
    tokenizer: PreTrainedTokenizerBase, messages: Messages | str, tools: Sequence[dict[str, Any]] | None = None
) -> list[int]:
    """Prompt token ids for ``messages`` (the template adds special tokens itself)."""
    return tokenizer(render_chat(tokenizer, messages, tools), add_special_tokens=False)["input_ids"]
