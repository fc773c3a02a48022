"""Request validation: one `parse_*` per API turns an HTTP body into a `GenerationSpec`.

Every field is checked here, before anything is tokenized or queued, against the limits
of `protocol` and the model's (`ModelInfo`); the one check left to `Front` is the prompt's
length in tokens. Every problem raises `ApiError` (HTTP 400 unless said otherwise) whose
message names the field and what is allowed. Nothing built from a spec that passed can
fail on the user's data: every integer fits an int64 (the msgpack messages to the
scheduler).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixrt.grammar.api import SAMPLING_FIELDS, constraint_param, grammar_kwargs, grammar_param
from radixrt.sampling import LOGIT_BIAS_RANGE, MAX_INT, MAX_TOP_LOGPROBS, SEED_RANGE
from radixrt.server.groups import check_beam_fields
from radixrt.server.protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    GENERATE_DEFAULT_MAX_TOKENS,
    MAX_COMPLETION_LOGPROBS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_PROMPTS,
    MAX_REQUESTS,
    MAX_RID_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    ApiError,
    GenerationSpec,
    ModelInfo,
    decode,
    make_params,
)
from radixrt.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    OpenAIFields,
    SamplingFields,
)


# ---- field checks ----
def _int_in(value: int, name: str, lo: int, hi: int, what: str = "") -> None:
    if not lo <= value <= hi:
        allowed = what or f"an integer in [{lo}, {hi}]"
        raise ApiError(f"invalid {name}={_short(value)}: must be {allowed}", param=name)


def _short(value: object) -> str:
    s = repr(value)
    return s if len(s) <= 60 else s[:57] + "..."


def _sampling(f: SamplingFields, model: ModelInfo, prefix: str = "") -> dict[str, Any]:
    """SamplingParams keyword arguments (without max_tokens) from the shared fields."""
    p = lambda name: prefix + name  # the field's name in errors
    kw: dict[str, Any] = {
        name: getattr(f, name)
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        )
        if getattr(f, name) is not None
    }
    vocab = model.vocab_size
    if f.top_k is not None and f.top_k not in (0, -1):
        _int_in(f.top_k, p("top_k"), 1, vocab, f"an integer in [1, {vocab}], or -1/0/null (off)")
        kw["top_k"] = f.top_k
    if f.seed is not None:
        _int_in(f.seed, p("seed"), 0, SEED_RANGE - 1, "an integer in [0, 2^63)")
        kw["seed"] = f.seed
    if f.stop is not None:
        stop = [f.stop] if isinstance(f.stop, str) else f.stop
        if len(stop) > MAX_STOP_STRINGS:
            raise ApiError(
                f"{p('stop')} has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
                p("stop"),
            )
        for s in stop:
            if not 1 <= len(s) <= MAX_STOP_CHARS:
                raise ApiError(
                    f"invalid {p('stop')} string of {len(s)} characters: each must have 1 to "
                    f"{MAX_STOP_CHARS}",
                    p("stop"),
                )
        kw["stop"] = tuple(stop)
    if f.stop_token_ids is not None:
        if len(f.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ApiError(
                f"{p('stop_token_ids')} has {len(f.stop_token_ids)} ids; at most "
                f"{MAX_STOP_TOKEN_IDS} are allowed",
                p("stop_token_ids"),
            )
        for t in f.stop_token_ids:
            _int_in(t, p("stop_token_ids"), 0, vocab - 1, f"token ids in [0, {vocab})")
        kw["stop_token_ids"] = tuple(f.stop_token_ids)
    if f.logit_bias:
        kw["logit_bias"] = _logit_bias(f.logit_bias, vocab, p("logit_bias"))
    kw["ignore_eos"] = f.ignore_eos
    kw["skip_special_tokens"] = f.skip_special_tokens
    try:  # structured output: /generate's regex / json_schema / ebnf, OpenAI's response_format
        kw.update(grammar_kwargs(f))
    except ValueError as e:
        raise ApiError(str(e), param="response_format") from None
    _checked(kw, prefix, f)
    return kw


def _logit_bias(bias: dict[str, float], vocab: int, param: str) -> tuple[tuple[int, float], ...]:
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(f"{param} has {len(bias)} entries; at most {MAX_LOGIT_BIAS}", param)
    pairs = []
    for key, value in bias.items():
        if not re.fullmatch(r"[0-9]{1,10}", key) or int(key) >= vocab:
            raise ApiError(
                f"invalid {param} key {_short(key)}: keys are token ids in [0, {vocab}) "
                "written as strings",
                param,
            )
        if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise ApiError(
                f"invalid {param}[{key!r}]={_short(value)}: a bias must be in "
                f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]",
                param,
            )
        pairs.append((int(key), float(value)))
    if len({t for t, _ in pairs}) != len(pairs):  # "5" and "05"
        raise ApiError(f"{param} names a token id twice", param)
    return tuple(sorted(pairs))


def _checked(kw: dict[str, Any], prefix: str, f: SamplingFields) -> None:
    """SamplingParams accepts `kw` (with any max_tokens); errors name `prefix` + field, or
    for a constraint the request field of `f` that held it."""
    try:
        make_params(**kw)
    except ApiError as e:
        if e.param in SAMPLING_FIELDS:
            e.param = constraint_param(f, e.param, prefix)
        else:
            e.param = None if e.param is None else prefix + e.param
        raise


def _check_max_tokens(value: int | None, name: str) -> None:
    if value is not None and value < 0:
        raise ApiError(f"invalid {name}={_short(value)}: must be an integer >= 0", param=name)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _all_of_type(xs: list[Any], kind: type) -> bool:
    """Every element's type is exactly `kind` (no subclass: bool is not an int here), in
    one C-speed pass."""
    return set(map(type, xs)) <= {kind}


def _token_ids(ids: list[Any], param: str, vocab: int) -> list[int]:
    # the common case in C-speed passes (a long prompt's ids are checked on the event loop
    # every stream shares: the per-id Python loop below took ~0.2 ms per 2k ids)
    if _all_of_type(ids, int) and (not ids or (min(ids) >= 0 and max(ids) < vocab)):
        return ids
    if not all(_is_int(t) for t in ids):
        raise ApiError(f"{param} must be a list of integer token ids", param=param)
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ApiError(
            f"token id {_short(bad[0])} in {param} is outside the vocabulary [0, {vocab})", param
        )
    return ids


def _prompt_list(
    prompt: str | list[Any], param: str, model: ModelInfo
) -> tuple[list[str | list[int]], bool]:
    """Normalise text / [text] / [ids] / [[ids]] into one entry per input (+ batched?)."""
    if isinstance(prompt, str):
        prompts, batched = [prompt], False
    elif not prompt:
        raise ApiError(f"{param} is empty: at least one token is needed", param=param)
    elif _all_of_type(prompt, int):  # the common shape first: one prompt of ids
        prompts, batched = [_token_ids(prompt, param, model.vocab_size)], False
    elif all(isinstance(p, str) for p in prompt):
        prompts, batched = list(prompt), True
    elif all(_is_int(p) for p in prompt):
        prompts, batched = [_token_ids(prompt, param, model.vocab_size)], False
    elif all(isinstance(p, list) for p in prompt):
        prompts = [_token_ids(p, param, model.vocab_size) for p in prompt]
        batched = True
    else:
        raise ApiError(
            f"{param} must be a string, a list of strings, a list of token ids, or a list of "
            "lists of token ids",
            param=param,
        )
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(f"{param} has {len(prompts)} prompts; at most {MAX_PROMPTS}", param)
    for p in prompts:
        if isinstance(p, str):
            _check_text_length(len(p), param, model)
    return prompts, batched


def _check_text_length(chars: int, param: str, model: ModelInfo) -> None:
    if chars > model.max_prompt_chars:
        raise ApiError(
            f"{param} has {chars} characters; this model's context of {model.max_model_len} "
            f"tokens takes at most {model.max_prompt_chars}",
            param,
        )


def _check_n(n: int, num_prompts: int, param: str = "n") -> None:
    _int_in(n, param, 1, MAX_N)
    if n * num_prompts > MAX_REQUESTS:
        raise ApiError(
            f"{num_prompts} prompts x {param}={n} is {n * num_prompts} generations; at most "
            f"{MAX_REQUESTS} per request",
            param=param,
        )


def _check_openai(req: OpenAIFields, model: ModelInfo) -> None:
    """`model`, and the OpenAI fields radixrt does not implement."""
    if req.model is not None and req.model not in model.accepted_names:
        names = ", ".join(repr(n) for n in model.accepted_names)
        raise ApiError(
            f"the model {_short(req.model)} does not exist; this server serves {names}",
            param="model",
            status=404,
            code="model_not_found",
        )
    if req.best_of not in (None, 1):
        raise ApiError(f"invalid best_of={_short(req.best_of)}: only 1 is supported", "best_of")
    for name in ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls"):
        if getattr(req, name) is not None:
            raise ApiError(f"{name} is not supported: this server has no tool calling", name)


def _include_usage(req: OpenAIFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


# ---- per endpoint ----
def parse_completion(body: bytes, model: ModelInfo) -> GenerationSpec:
    req: CompletionRequest = decode(body, CompletionRequest)
    _check_openai(req, model)
    if req.suffix is not None:
        raise ApiError("suffix is not supported", param="suffix")
    prompts, batched = _prompt_list(req.prompt, "prompt", model)
    _check_max_tokens(req.max_tokens, "max_tokens")
    _check_n(req.n, len(prompts))
    sampling = _sampling(req, model)
    if req.logprobs is not None:
        _int_in(req.logprobs, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    sampling["logprobs"] = req.logprobs is not None
    sampling["top_logprobs"] = req.logprobs or 0
    if req.echo and req.logprobs is not None:
        if req.stream:
            raise ApiError("echo with logprobs is not supported when streaming", param="echo")
        sampling["prompt_logprobs"] = True  # from the second prompt token on
    return GenerationSpec(
        prompts=prompts,
        sampling=sampling,
        max_tokens=req.max_tokens,
        default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS,
        grammar_param=grammar_param(req),
        n=req.n,
        stream=req.stream,
        include_usage=_include_usage(req),
        batched=batched,
        echo=req.echo,
    )


def parse_chat(
    body: bytes, model: ModelInfo, render: Callable[[list[dict[str, str]]], str]
) -> GenerationSpec:
    """`render` applies the chat template (raises ApiError for messages it cannot take)."""
    req: ChatCompletionRequest = decode(body, ChatCompletionRequest)
    _check_openai(req, model)
    if not req.messages:
        raise ApiError("messages is empty: at least one message is needed", param="messages")
    messages = []
    chars = 0
    for i, m in enumerate(req.messages):
        for name in ("tool_calls", "tool_call_id"):
            if getattr(m, name) is not None:
                raise ApiError(f"messages[{i}].{name} is not supported", f"messages[{i}].{name}")
        if isinstance(m.content, list):
            bad = [p.type for p in m.content if p.type != "text" or p.text is None]
            if bad:
                raise ApiError(
                    f"messages[{i}].content has a part of type {_short(bad[0])}; only text "
                    "parts are supported",
                    param=f"messages[{i}].content",
                )
            content = "".join(p.text or "" for p in m.content)
        else:
            content = m.content or ""
        chars += len(content)
        message = {"role": m.role, "content": content}
        if m.name is not None:
            message["name"] = m.name
        messages.append(message)
    _check_text_length(chars, "messages", model)
    max_tokens = req.max_completion_tokens
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = req.max_tokens, "max_tokens"
    _check_max_tokens(max_tokens, name)
    _check_n(req.n, 1)
    sampling = _sampling(req, model)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
        _int_in(req.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    sampling["logprobs"] = req.logprobs
    sampling["top_logprobs"] = req.top_logprobs or 0
    return GenerationSpec(
        prompts=[render(messages)],
        sampling=sampling,
        max_tokens=max_tokens,
        grammar_param=grammar_param(req),
        n=req.n,
        stream=req.stream,
        include_usage=_include_usage(req),
        add_special_tokens=False,
        prompt_param="messages",
        max_tokens_param=name,
    )


@dataclass(frozen=True)
class GenerateSpec:
    """/generate: the generation plus its native options."""

    gen: GenerationSpec
    rid: str | None  # the client's id (opaque; only echoed back and used by /abort)
    logprob_start_len: int  # as asked (0 allowed: the first prompt token has no log-prob)


def check_rid(rid: str, param: str = "rid") -> None:
    if len(rid) > MAX_RID_CHARS:
        raise ApiError(f"{param} has {len(rid)} characters; at most {MAX_RID_CHARS}", param)


def parse_generate(body: bytes, model: ModelInfo) -> GenerateSpec:
    req: GenerateRequest = decode(body, GenerateRequest)
    if (req.text is None) == (req.input_ids is None):
        raise ApiError("pass exactly one of text or input_ids", param="text")
    if req.text is not None:
        prompts, batched = _prompt_list(req.text, "text", model)
    else:
        prompts, batched = _prompt_list(req.input_ids, "input_ids", model)
        if any(isinstance(p, str) for p in prompts):
            raise ApiError("input_ids must be token ids, not strings", param="input_ids")
    if req.rid is not None:
        check_rid(req.rid)
    sp = req.sampling_params
    max_tokens = sp.max_new_tokens if sp.max_new_tokens is not None else sp.max_tokens
    _check_max_tokens(max_tokens, "sampling_params.max_new_tokens")
    _int_in(req.logprob_start_len, "logprob_start_len", 0, MAX_INT, f"an integer in [0, {MAX_INT}]")
    _int_in(req.top_logprobs_num, "top_logprobs_num", 0, MAX_TOP_LOGPROBS)
    length_penalty = 1.0
    if sp.beam_width is not None:
        length_penalty = check_beam_fields(req, sp, len(prompts))
    elif sp.length_penalty is not None:
        raise ApiError(
            "sampling_params.length_penalty applies to beam search only: set "
            "sampling_params.beam_width too",
            param="sampling_params.length_penalty",
        )
    _check_n(sp.n, len(prompts), "sampling_params.n")
    sampling = _sampling(sp, model, prefix="sampling_params.")
    sampling["logprobs"] = req.return_logprob
    sampling["top_logprobs"] = req.top_logprobs_num if req.return_logprob else 0
    sampling["prompt_logprobs"] = req.return_prompt_logprob
    sampling["logprob_start_len"] = max(1, req.logprob_start_len)
    gen = GenerationSpec(
        prompts=prompts,
        sampling=sampling,
        max_tokens=max_tokens,
        default_max_tokens=GENERATE_DEFAULT_MAX_TOKENS,
        grammar_param=grammar_param(sp, "sampling_params."),
        n=sp.n,
        beam_width=sp.beam_width,
        length_penalty=length_penalty,
        stream=req.stream,
        batched=batched,
        prompt_param="text" if req.text is not None else "input_ids",
        max_tokens_param="sampling_params.max_new_tokens",
        n_param="sampling_params.n",
    )
    return GenerateSpec(gen=gen, rid=req.rid, logprob_start_len=req.logprob_start_len)
