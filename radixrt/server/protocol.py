"""HTTP request bodies: typed schemas (msgspec), and their validation into a `GenerationSpec`.

Every problem raises `ApiError` (HTTP 400 unless said otherwise) whose message names the
field and what is allowed; sampling values are checked by `SamplingParams` itself and its
ValueError message is passed on.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from radixrt.sampling import SamplingParams

GENERATE_DEFAULT_MAX_TOKENS = 128  # /generate without max_new_tokens
COMPLETION_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens (as OpenAI)
MAX_N = 128  # choices per prompt


class ApiError(Exception):
    """An error for the client: OpenAI-shaped JSON body with HTTP `status`."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": None}
        }


# ---- schemas ----
class SamplingFields(msgspec.Struct, kw_only=True):
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
    ignore_eos: bool = False
    skip_special_tokens: bool = True


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]  # text, [text], [token id], or [[token id]]
    model: str | None = None
    max_tokens: int | None = None
    n: int = 1
    logprobs: int | None = None  # any value: return the sampled tokens' log-probs
    stream: bool = False
    stream_options: StreamOptions | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # wins over max_tokens
    n: int = 1
    logprobs: bool = False
    top_logprobs: int | None = None  # accepted; only the sampled token's log-prob is given
    stream: bool = False
    stream_options: StreamOptions | None = None


class GenerateSamplingParams(SamplingFields, kw_only=True):
    max_new_tokens: int | None = None
    max_tokens: int | None = None  # alias of max_new_tokens


class GenerateRequest(msgspec.Struct, kw_only=True):
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # [int] or [[int]]
    sampling_params: GenerateSamplingParams = msgspec.field(default_factory=GenerateSamplingParams)
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    return_prompt_logprob: bool = False
    logprob_start_len: int = 1  # 0: the first prompt token gets a null log-prob


class AbortBody(msgspec.Struct, kw_only=True):
    rid: str


# ---- validated result ----
@dataclass(frozen=True)
class GenerationSpec:
    """What one HTTP request asks for, before tokenization."""

    prompts: list[str | list[int]]  # per input: text to tokenize, or token ids
    sampling: dict[str, Any]  # SamplingParams keyword arguments except max_tokens
    max_tokens: int | None  # as asked; None: not given, use default_max_tokens
    # when not given: at most this many, and no more than the context length leaves
    # after the prompt (None: all that it leaves)
    default_max_tokens: int | None = None
    n: int = 1  # independent samples per prompt
    stream: bool = False
    include_usage: bool = False  # stream: a final chunk with usage
    add_special_tokens: bool = True  # False for chat-template text (it has its own)
    batched: bool = False  # the prompt was given as a list (answer with a list)
    prompt_param: str = "prompt"  # request fields to name in errors
    max_tokens_param: str = "max_tokens"

    def params(self, max_tokens: int, choice: int = 0) -> SamplingParams:
        """SamplingParams for one request; choice i > 0 of a seeded n > 1 uses seed + i."""
        kw = dict(self.sampling)
        if choice and kw.get("seed") is not None:
            kw["seed"] += choice
        return make_params(max_tokens=max_tokens, **kw)


def make_params(**kwargs: Any) -> SamplingParams:
    """SamplingParams(**kwargs), turning its ValueError into ApiError naming the field."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        m = re.match(r"invalid (\w+)=", str(e))
        raise ApiError(str(e), param=m.group(1) if m else None) from e


def decode(body: bytes, schema: type[msgspec.Struct]) -> Any:
    if not body.strip():
        raise ApiError("request body is empty: expected a JSON object")
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as e:
        text = str(e)
        m = re.search(r" - at `\$\.?([^`]*)`$", text)
        where = m.group(1) if m else ""  # e.g. "max_tokens", "messages[0]"
        if missing := re.match(r"Object missing required field `(\w+)`", text):
            param = f"{where}.{missing.group(1)}" if where else missing.group(1)
            message = f"missing required field {param}"
        elif where:  # "Expected `int | null`, got `str` - at `$.max_tokens`"
            param, message = where, f"invalid {where}: {text[: m.start()]}"
        else:
            param, message = None, f"invalid request: {text}"
        raise ApiError(message, param=param) from e
    except msgspec.DecodeError as e:
        raise ApiError(f"invalid JSON body: {e}") from e


def _sampling(f: SamplingFields) -> dict[str, Any]:
    kw: dict[str, Any] = {
        name: getattr(f, name)
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        )
        if getattr(f, name) is not None
    }
    if f.top_k is not None and f.top_k not in (0, -1):
        kw["top_k"] = f.top_k
    if f.stop is not None:
        kw["stop"] = (f.stop,) if isinstance(f.stop, str) else tuple(f.stop)
    if f.stop_token_ids is not None:
        kw["stop_token_ids"] = tuple(f.stop_token_ids)
    kw["ignore_eos"] = f.ignore_eos
    kw["skip_special_tokens"] = f.skip_special_tokens
    make_params(**kw)  # check the values now, before anything is tokenized
    return kw


def _check_max_tokens(value: int | None, name: str) -> None:
    if value is not None and value < 0:
        raise ApiError(f"invalid {name}={value}: must be an integer >= 0", param=name)


def _check_n(n: int) -> None:
    if not 1 <= n <= MAX_N:
        raise ApiError(f"invalid n={n}: must be an integer in [1, {MAX_N}]", param="n")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_ids(ids: list[Any], param: str) -> list[int]:
    if not all(_is_int(t) for t in ids):
        raise ApiError(f"{param} must be a list of integer token ids", param=param)
    return ids


def _prompt_list(prompt: str | list[Any], param: str) -> tuple[list[str | list[int]], bool]:
    """Normalise text / [text] / [ids] / [[ids]] into one entry per input (+ batched?)."""
    if isinstance(prompt, str):
        return [prompt], False
    if not prompt:
        raise ApiError(f"{param} is empty: at least one token is needed", param=param)
    if all(isinstance(p, str) for p in prompt):
        return list(prompt), True
    if all(_is_int(p) for p in prompt):
        return [prompt], False
    if all(isinstance(p, list) for p in prompt):
        return [_token_ids(p, param) for p in prompt], True
    raise ApiError(
        f"{param} must be a string, a list of strings, a list of token ids, or a list of "
        "lists of token ids",
        param=param,
    )


# ---- per endpoint ----
def parse_completion(body: bytes) -> GenerationSpec:
    req: CompletionRequest = decode(body, CompletionRequest)
    prompts, batched = _prompt_list(req.prompt, "prompt")
    _check_max_tokens(req.max_tokens, "max_tokens")
    _check_n(req.n)
    sampling = _sampling(req)
    sampling["logprobs"] = req.logprobs is not None
    return GenerationSpec(
        prompts=prompts,
        sampling=sampling,
        max_tokens=req.max_tokens,
        default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS,
        n=req.n,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        batched=batched,
    )


def parse_chat(body: bytes, render: Callable[[list[dict[str, str]]], str]) -> GenerationSpec:
    """`render` applies the chat template (raises ApiError for messages it cannot take)."""
    req: ChatCompletionRequest = decode(body, ChatCompletionRequest)
    if not req.messages:
        raise ApiError("messages is empty: at least one message is needed", param="messages")
    messages = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            bad = [p.type for p in m.content if p.type != "text" or p.text is None]
            if bad:
                raise ApiError(
                    f"messages[{i}].content has a part of type {bad[0]!r}; only text parts "
                    "are supported",
                    param=f"messages[{i}].content",
                )
            content = "".join(p.text or "" for p in m.content)
        else:
            content = m.content or ""
        messages.append({"role": m.role, "content": content})
    max_tokens = req.max_completion_tokens
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = req.max_tokens, "max_tokens"
    _check_max_tokens(max_tokens, name)
    _check_n(req.n)
    sampling = _sampling(req)
    sampling["logprobs"] = req.logprobs
    return GenerationSpec(
        prompts=[render(messages)],
        sampling=sampling,
        max_tokens=max_tokens,
        n=req.n,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        add_special_tokens=False,
        prompt_param="messages",
        max_tokens_param=name,
    )


@dataclass(frozen=True)
class GenerateSpec:
    """/generate: the generation plus its native options."""

    gen: GenerationSpec
    rid: str | None
    logprob_start_len: int  # as asked (0 allowed: the first prompt token has no log-prob)


def parse_generate(body: bytes) -> GenerateSpec:
    req: GenerateRequest = decode(body, GenerateRequest)
    if (req.text is None) == (req.input_ids is None):
        raise ApiError("pass exactly one of text or input_ids", param="text")
    if req.text is not None:
        prompts, batched = _prompt_list(req.text, "text")
    else:
        prompts, batched = _prompt_list(req.input_ids, "input_ids")
        if any(isinstance(p, str) for p in prompts):
            raise ApiError("input_ids must be token ids, not strings", param="input_ids")
    sp = req.sampling_params
    max_tokens = sp.max_new_tokens if sp.max_new_tokens is not None else sp.max_tokens
    _check_max_tokens(max_tokens, "max_new_tokens")
    if req.logprob_start_len < 0:
        raise ApiError(
            f"invalid logprob_start_len={req.logprob_start_len}: must be an integer >= 0",
            param="logprob_start_len",
        )
    sampling = _sampling(sp)
    sampling["logprobs"] = req.return_logprob
    sampling["prompt_logprobs"] = req.return_prompt_logprob
    sampling["logprob_start_len"] = max(1, req.logprob_start_len)
    gen = GenerationSpec(
        prompts=prompts,
        sampling=sampling,
        max_tokens=max_tokens,
        default_max_tokens=GENERATE_DEFAULT_MAX_TOKENS,
        stream=req.stream,
        batched=batched,
        prompt_param="text" if req.text is not None else "input_ids",
        max_tokens_param="max_new_tokens",
    )
    return GenerateSpec(gen=gen, rid=req.rid, logprob_start_len=req.logprob_start_len)
