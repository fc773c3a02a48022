"""Chat messages as the chat template takes them, and the template's options (vLLM's
add_generation_prompt / continue_final_message / chat_template_kwargs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from radixrt.server.protocol import ApiError, ModelInfo


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How the chat template renders a request's messages."""

    add_generation_prompt: bool = True  # open an assistant turn after the messages
    continue_final_message: bool = False  # leave the last message open (the model goes on)
    extra: dict[str, Any] | None = None  # more template variables (chat_template_kwargs)
    tools: list[dict] | None = None  # the offered tools, as OpenAI's `tools` (the template's)


# template keywords chat_template_kwargs may not set (the renderer's own arguments)
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
     "return_tensors", "return_dict", "tokenizer_kwargs", "chat_template", "tools", "documents"}
)  # fmt: skip


def check_chat_length(req_messages: list, tools: list | None, model: ModelInfo) -> None:
    """ApiError when the text of a chat request cannot fit the context: the tools (names,
    descriptions, parameter schemas as JSON), then everything (that plus the messages'
    contents and their calls' arguments), at `ModelInfo.max_prompt_chars`, and the number of
    messages at the context length (the template renders each into one token at least).
    Linear in the request and checked before anything is rendered, parsed or tokenized."""
    if len(req_messages) > model.max_model_len:
        raise ApiError(
            f"messages has {len(req_messages)} messages; this model's context of "
            f"{model.max_model_len} tokens takes at most {model.max_model_len}",
            param="messages",
        )
    chars = 0
    for t in tools or ():
        f = t.function
        chars += len(f.name) + len(f.description or "") + _json_chars(f.parameters)
    model.check_text_length(chars, "tools")
    for m in req_messages:
        if isinstance(m.content, list):
            chars += sum(len(p.text or "") for p in m.content)
        else:
            chars += len(m.content or "")
        chars += len(m.reasoning_content or "")
        for c in m.tool_calls or ():
            chars += len(c.function.name) + _json_chars(c.function.arguments)
    model.check_text_length(chars, "messages")


def _json_chars(value: Any) -> int:
    """Characters of a JSON text, or of an object written as JSON."""
    if value is None:
        return 0
    return len(value) if isinstance(value, str) else len(msgspec.json.encode(value))


def chat_messages(req_messages: list) -> list[dict[str, str]]:
    """The messages as the chat template takes them (text parts joined); ApiError for
    parts that are not text (their length: `check_chat_length`)."""
    messages = []
    for i, m in enumerate(req_messages):
        if isinstance(m.content, list):
            bad = [p.type for p in m.content if p.type != "text" or p.text is None]
            if bad:
                raise ApiError(
                    f"messages[{i}].content has a part of type {bad[0][:40]!r}; only text "
                    "parts are supported",
                    param=f"messages[{i}].content",
                )
            content = "".join(p.text or "" for p in m.content)
        else:
            content = m.content or ""
        message = {"role": m.role, "content": content}
        if m.name is not None:
            message["name"] = m.name
        if m.reasoning_content is not None:
            message["reasoning_content"] = m.reasoning_content
        messages.append(message)
    return messages


def template_options(
    add_generation_prompt: bool | None,
    continue_final_message: bool,
    extra: dict[str, Any] | None,
    messages: list[dict[str, str]],
    tools: list[dict] | None = None,
) -> ChatTemplateOptions:
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final_message
    if add_generation_prompt and continue_final_message:
        raise ApiError(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    if continue_final_message and (not messages or messages[-1]["role"] != "assistant"):
        raise ApiError(
            "continue_final_message needs an assistant message last",
            param="continue_final_message",
        )
    if extra:
        bad = sorted(RESERVED_TEMPLATE_KWARGS & set(extra))
        if bad:
            raise ApiError(
                f"chat_template_kwargs may not set {bad[0]!r}", param="chat_template_kwargs"
            )
    return ChatTemplateOptions(add_generation_prompt, continue_final_message, extra or None, tools)
