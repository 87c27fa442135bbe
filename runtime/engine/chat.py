"""A chat's prompt tokens: the tokenizer's chat template rendered, then tokenised once."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from kiln.runtime.base.errors import UsageError

Chat = list[dict[str, str]]


def chat_token_ids(
    tokenizer: Any,
    messages: Chat,
    lock: AbstractContextManager[Any] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Render a chat with the tokenizer's template (opening the assistant's turn unless
    `add_generation_prompt` is False) and tokenise it without adding special tokens again (the
    template writes them); `lock` guards the tokenizer if it is shared. UsageError when there
    is no template or it refuses the messages."""
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(
            "this model's tokenizer has no chat template; use /v1/completions or serve a "
            "model whose tokenizer_config.json sets chat_template"
        )
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:  # jinja raises TemplateError for chats the template refuses
        raise UsageError(f"the chat template refused these messages: {exc}") from None
    with lock or nullcontext():
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
