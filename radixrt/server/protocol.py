"""What the HTTP layer and the front share about requests: the limits, `ApiError`,
`ModelInfo`, body decoding, and `GenerationSpec` (a validated request, before
tokenization). The per-API validation that builds specs is in `validate`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import msgspec

from radixrt.errors import RequestValueError
from radixrt.json_depth import MAX_JSON_DEPTH, too_deep_path
from radixrt.sampling import (  # noqa: F401
    MAX_BEAM_WIDTH,
    MAX_N,
    SEED_RANGE,
    RequestOptions,
    SamplingParams,
)

# ---- limits (the README's "Limits" lists them) ----
GENERATE_DEFAULT_MAX_TOKENS = 128  # /generate without max_new_tokens (as SGLang)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens (as OpenAI)
# MAX_N (choices per prompt, n > 1 forks in the scheduler) and MAX_BEAM_WIDTH come from
# radixrt.sampling; both are also capped by --max-running-requests and the KV pool
MAX_PROMPTS = 256  # prompts of one batched request
MAX_REQUESTS = 256  # prompts x n of one HTTP request
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # characters of one stop string
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # entries of logit_bias (as OpenAI)
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions `logprobs` (as OpenAI)
MAX_RID_CHARS = 256  # a client request id (/generate rid)
# A text prompt longer than this many characters per token of context cannot fit; it is
# refused before it is tokenized (tokenizing megabytes would stall every other request).
MAX_CHARS_PER_TOKEN = 64
MAX_TOOLS = 512  # functions offered by one chat request
MODEL_ALIAS = "default"  # a `model` that always names the served model


class ApiError(Exception):
    """An error for the client: OpenAI-shaped JSON body with HTTP `status`."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class ModelInfo:
    """What validation needs to know about the served model."""

    name: str  # the id /v1/models lists
    vocab_size: int
    max_model_len: int  # prompt + output tokens of one request at most
    adapters: tuple[str, ...] = ()  # loaded LoRA adapters: `model` / `lora_path` may name one

    @property
    def accepted_names(self) -> tuple[str, ...]:
        return accepted_names(self.name)

    @property
    def max_prompt_chars(self) -> int:
        return MAX_CHARS_PER_TOKEN * self.max_model_len

    def check_text_length(self, chars: int, param: str) -> None:
        """ApiError naming `param` for a text of `chars` characters that cannot fit."""
        if chars > self.max_prompt_chars:
            raise ApiError(
                f"{param} has {chars} characters; this model's context of "
                f"{self.max_model_len} tokens takes at most {self.max_prompt_chars}",
                param,
            )


def accepted_names(name: str) -> tuple[str, ...]:
    """`model` values that name the model `name`: itself, its last path part, "default"."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    return tuple(dict.fromkeys((name, base, MODEL_ALIAS)))


# ---- validated result ----
@dataclass(frozen=True)
class GenerationSpec:
    """What one HTTP request asks for, before tokenization."""

    prompts: list[str | list[int]]  # per input: text to tokenize, or token ids
    # validated; max_tokens None and n 1 here: `params` / `request_params` set them
    sampling: SamplingParams
    max_tokens: int | None  # as asked; None: not given, use default_max_tokens
    # the client's salt, priority and retention (the tenant's salt and policy replace them
    # before the request is sent); lora None here: the front resolves `adapter` into it
    options: RequestOptions = RequestOptions()
    adapter: str | None = None  # the LoRA adapter the request names (None: the base model)
    # when not given: at most this many, and no more than the context length leaves
    # after the prompt (None: all that it leaves)
    default_max_tokens: int | None = None
    n: int = 1  # samples per prompt (one scheduler request forking n children)
    # /generate beam search: beams kept and returned per prompt (None: sampling, not beams)
    beam_width: int | None = None
    length_penalty: float = 1.0  # beam search: score = cumulative / length ** this
    stream: bool = False
    include_usage: bool = False  # stream: a final chunk with usage
    continuous_usage: bool = False  # stream: usage so far in every chunk
    add_special_tokens: bool = True  # BOS etc. added to text prompts (chat: on top of the
    # template's own)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    batched: bool = False  # the prompt was given as a list (answer with a list)
    echo: bool = False  # /v1/completions: the prompt is part of the returned text
    prompt_param: str = "prompt"  # request fields to name in errors
    max_tokens_param: str = "max_tokens"
    n_param: str = "n"
    beam_width_param: str = "sampling_params.beam_width"
    grammar_param: str | None = None  # the field holding the constraint (regex, ...), if any
    tools: Any = None  # chat: the request's tools.request.ToolRequest (None: no tools)

    def params(self, max_tokens: int, choice: int = 0) -> SamplingParams:
        """SamplingParams for one request; choice i of a seeded n > 1 uses
        (seed + i) mod 2^63."""
        seed = self.sampling.seed
        if seed is not None:
            seed = (seed + choice) % SEED_RANGE
        return checked(replace, self.sampling, max_tokens=max_tokens, seed=seed)

    def request_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams of the one scheduler request of a prompt: n = self.n (the
        scheduler seeds child i with (seed + i) mod 2^63)."""
        return checked(replace, self.sampling, max_tokens=max_tokens, n=self.n)


T = TypeVar("T")


def checked(build: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """build(*args, **kwargs) (a SamplingParams or RequestOptions, made or `replace`d), its
    ValueError turned into ApiError naming the field."""
    try:
        return build(*args, **kwargs)
    except RequestValueError as e:
        raise ApiError(str(e), param=e.field) from e
    except ValueError as e:
        raise ApiError(str(e)) from e


# ---- decoding ----
def decode(body: bytes, schema: type[msgspec.Struct]) -> Any:
    """The body as `schema`; ApiError naming the field for anything wrong."""
    if not body.strip():
        raise ApiError("request body is empty: expected a JSON object")
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as e:
        raise _validation_error(str(e), body) from None
    except msgspec.DecodeError as e:
        where = _surrogate_at(body)
        if where is not None:
            raise ApiError(
                f"invalid {where or 'JSON body'}: it holds a lone UTF-16 surrogate (\\ud800-"
                "\\udfff without its pair), which is not Unicode text",
                param=where or None,
            ) from None
        raise ApiError(f"invalid JSON body: {e}") from None
    except RecursionError:
        where = too_deep_path(body.decode(errors="replace"))
        msg = f"nested too deeply (objects and arrays at most {MAX_JSON_DEPTH} levels)"
        raise ApiError(f"invalid {where or 'JSON body'}: {msg}", param=where) from None


MAX_SHOWN_BODY_BYTES = 1 << 20  # bodies whose bad value an error message quotes


def _surrogate_at(body: bytes) -> str | None:
    """Where ("a.b[2]", "" for the body itself) the JSON `body` holds a string with a lone
    surrogate (which msgspec refuses without saying where), or None: no such string, not
    JSON, or too large to parse again."""
    if len(body) > MAX_SHOWN_BODY_BYTES or b"\\u" not in body.lower():
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str) and _SURROGATE.search(node):
            return where
        if isinstance(node, dict):
            for key, item in reversed(node.items()):
                if _SURROGATE.search(key):
                    return where  # the object whose key it is (the key cannot be shown)
                path = f"{where}.{key}" if where else key
                stack.append((item, path))
        elif isinstance(node, list):
            stack.extend((item, f"{where}[{i}]") for i, item in reversed(list(enumerate(node))))
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")


def _value_at(body: bytes, where: str) -> str | None:
    """repr of the value at `where` ("a.b[2].c") in the JSON `body` (short), or None."""
    if len(body) > MAX_SHOWN_BODY_BYTES:  # decoding it again to show a value costs too much
        return None
    try:
        value: Any = msgspec.json.decode(body)
        for key, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", where):
            value = value[int(index)] if index else value[key]
    except (msgspec.DecodeError, KeyError, IndexError, TypeError, ValueError, RecursionError):
        return None
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _validation_error(text: str, body: bytes = b"") -> ApiError:
    m = re.search(r" - at `\$\.?([^`]*)`$", text)
    where = m.group(1) if m else ""  # e.g. "max_tokens", "messages[0]"
    head = text[: m.start()] if m else text
    if found := re.match(r"Object (missing required|contains unknown) field `([^`]*)`", head):
        param = f"{where}.{found.group(2)}" if where else found.group(2)
        if found.group(1) == "missing required":
            return ApiError(f"missing required field {param}", param=param)
        return ApiError(f"unknown field {param}: this API does not define it", param=param)
    if where:  # "Expected `int | null`, got `str` - at `$.max_tokens`"
        value = _value_at(body, where) if head.startswith("Expected `") else None
        shown = where if value is None else f"{where}={value}"
        return ApiError(f"invalid {shown}: {head}", param=where)
    return ApiError(f"invalid request: {text}")
