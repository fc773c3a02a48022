"""Role segments from the model's chat template, derived by rendering, never hard-coded.

For a conversation `messages` so far and a new message of role r, the template is
rendered with sentinel content: `render(messages + [{r: SENTINEL}])`. What lies between
`render(messages)` and the sentinel is the role's prefix; what follows the sentinel is its
suffix. The assistant's prefix is the generation prompt instead
(`render(messages, add_generation_prompt=True)` past `render(messages)`), so an
assistant gen continues exactly where the template asks the model to.

So a program of role blocks renders to `apply_chat_template(messages, tokenize=False)`
whenever the template renders each message independently of the ones after it and
does not rewrite content (e.g. `| trim`), which holds for common templates.
"""

from __future__ import annotations

from typing import Any

SENTINEL = "\u2063radixrt-role-content\u2063"  # invisible separators: never in real content

Message = dict[str, str]


class ChatTemplate:
    """Renders role prefixes/suffixes with a HF tokenizer's chat template (pure: no state)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render(
        self,
        messages: list[Message],
        add_generation_prompt: bool = False,
        tools: tuple[dict, ...] = (),
    ) -> str:
        """The template applied to `messages`, offering `tools` (OpenAI's `tools`)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                "the model's tokenizer has no chat_template; roles (system/user/assistant) "
                "need one: use plain text instead, or a chat model"
            )
        if not messages and not add_generation_prompt:
            return ""
        return self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            tools=list(tools) or None,
        )

    def prefix(self, messages: list[Message], role: str, tools: tuple[dict, ...] = ()) -> str:
        """Text that opens a message of `role` after `messages`."""
        before = self.render(messages, tools=tools) if messages else ""
        if role == "assistant":
            upto = self.render(messages, add_generation_prompt=True, tools=tools)
        else:
            upto = self._split(messages, role, tools)[0]
        if not upto.startswith(before):
            raise ValueError(
                f"the chat template renders the conversation before a {role!r} message "
                "differently from the conversation alone, so role blocks cannot be rendered "
                "incrementally; build the prompt with apply_chat_template and add it as text"
            )
        return upto[len(before) :]

    def suffix(self, messages: list[Message], role: str, tools: tuple[dict, ...] = ()) -> str:
        """Text that closes a message of `role` after `messages`."""
        return self._split(messages, role, tools)[1]

    def _split(
        self, messages: list[Message], role: str, tools: tuple[dict, ...] = ()
    ) -> tuple[str, str]:
        full = self.render([*messages, {"role": role, "content": SENTINEL}], tools=tools)
        if full.count(SENTINEL) != 1:
            raise ValueError(
                f"the chat template does not render a {role!r} message's content verbatim "
                f"after {len(messages)} message(s), so its role prefix/suffix are unknown"
            )
        head, _, tail = full.partition(SENTINEL)
        return head, tail
