"""HTTP request bodies as typed schemas (msgspec): the shape of every field.

Decoding checks types only (and refuses unknown fields, as OpenAI does); values and
ranges are checked by `protocol`. Fields that OpenAI defines but radixrt does not
implement are declared so that `protocol` can refuse them by name instead of ignoring
them.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every schema: unknown fields are an error."""


class SamplingFields(Body, kw_only=True):
    """Sampling fields shared by every endpoint; None means the SamplingParams default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 or 0 also mean "off" (as vLLM/SGLang)
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    ignore_eos: bool = False
    skip_special_tokens: bool = True


class StreamOptions(Body, kw_only=True):
    include_usage: bool = False


class OpenAIFields(SamplingFields, kw_only=True):
    """Fields of both OpenAI endpoints."""

    model: str | None = None
    max_tokens: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's records; not used
    # OpenAI fields radixrt does not implement: refused when set
    best_of: int | None = None  # only 1
    response_format: Any = None  # text | json_object | json_schema (radixrt.grammar.api)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None


class CompletionRequest(OpenAIFields, kw_only=True):
    prompt: str | list[Any]  # text, [text], [token id], or [[token id]]
    logprobs: int | None = None  # return sampled log-probs plus this many alternatives
    echo: bool = False  # prepend the prompt to the text (and its log-probs with logprobs)
    suffix: str | None = None  # not implemented: refused when set


class ContentPart(Body, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(Body, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # passed to the chat template
    tool_calls: Any = None  # not implemented: refused when set
    tool_call_id: str | None = None  # not implemented: refused when set


class ChatCompletionRequest(OpenAIFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # with logprobs: alternatives per token, 0-20


class GenerateSamplingParams(SamplingFields, kw_only=True):
    max_new_tokens: int | None = None
    max_tokens: int | None = None  # alias of max_new_tokens
    n: int = 1  # samples of each prompt (a list of n outputs per prompt)
    beam_width: int | None = None  # beam search instead of sampling (W outputs per prompt)
    length_penalty: float | None = None  # beam search only: score = cum / length ** this
    regex: str | None = None  # structured output (at most one of the three)
    json_schema: dict[str, Any] | str | None = None
    ebnf: str | None = None


class GenerateRequest(Body, kw_only=True):
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # [int] or [[int]]
    sampling_params: GenerateSamplingParams = msgspec.field(default_factory=GenerateSamplingParams)
    stream: bool = False
    rid: str | None = None  # the client's id: echoed back, and /abort takes it
    return_logprob: bool = False
    top_logprobs_num: int = 0  # with return_logprob: alternatives per token, 0-20
    return_prompt_logprob: bool = False
    logprob_start_len: int = 1  # 0: the first prompt token gets a null log-prob


class AbortBody(Body, kw_only=True):
    rid: str
