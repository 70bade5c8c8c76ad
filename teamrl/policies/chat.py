"""Chat templates, applied the same way everywhere: one function turns messages into prompt ids."""

from __future__ import annotations

from typing import Sequence

from transformers import PreTrainedTokenizerBase

Messages = Sequence[dict[str, str]]


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: Messages | str) -> str:
    """The prompt text: the tokenizer's chat template with the assistant turn opened.

    A plain string is one user message.
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] = {m!r}: expected a dict with 'role' and 'content'")
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: Messages | str) -> list[int]:
    """Prompt token ids for ``messages`` (the template adds special tokens itself)."""
    return tokenizer(render_chat(tokenizer, messages), add_special_tokens=False)["input_ids"]
