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
from dataclasses import dataclass, replace
from typing import Any

from radixrt.grammar.api import (
    GUIDED_FIELDS,
    SAMPLING_FIELDS,
    constraint_param,
    grammar_kwargs,
    grammar_param,
    guided_kwargs,
)
from radixrt.grammar.regex_limits import check_not_fuzzy
from radixrt.sampling import LOGIT_BIAS_RANGE, SEED_RANGE, RequestOptions, SamplingParams
from radixrt.server.chat import (
    ChatTemplateOptions,
    chat_messages,
    check_chat_length,
    template_options,
)
from radixrt.server.fields import LENIENT, UnknownFields, decode_checked
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
    checked,
)
from radixrt.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    OpenAIFields,
    SamplingFields,
)
from radixrt.server.tools.request import parse_tools, template_messages, tool_constraint

# `model` values that mean "the served model" on every route (routers send null or
# "unknown" when their client named none)
ANY_MODEL = (None, "", "unknown")


# ---- field checks ----
def _int_in(value: int, name: str, lo: int, hi: int, what: str = "") -> None:
    if not lo <= value <= hi:
        allowed = what or f"an integer in [{lo}, {hi}]"
        raise ApiError(f"invalid {name}={_short(value)}: must be {allowed}", param=name)


def _short(value: object) -> str:
    s = repr(value)
    return s if len(s) <= 60 else s[:57] + "..."


def _sampling(f: SamplingFields, model: ModelInfo, prefix: str = "") -> SamplingParams:
    """SamplingParams (max_tokens None) from the shared fields."""
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
    for name in ("stop", "stop_regex"):
        value = getattr(f, name)
        if value is not None:
            kw[name] = _stop_strings(value, p(name))
    for pattern in kw.get("stop_regex", ()):
        try:
            check_not_fuzzy(pattern, p("stop_regex"))
        except ValueError as e:
            raise ApiError(str(e), p("stop_regex")) from None
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
    kw["include_stop_str_in_output"] = f.no_stop_trim
    try:  # structured output: regex / json_schema / ebnf, OpenAI's response_format
        kw.update(grammar_kwargs(f))
    except ValueError as e:
        raise ApiError(str(e), param="response_format") from None
    if isinstance(f, OpenAIFields):
        try:
            kw.update(guided_kwargs(f, kw))
        except ValueError as e:
            raise ApiError(str(e), param=_guided_param(f)) from None
    return _checked(kw, prefix, f)


def _guided_param(f: OpenAIFields) -> str | None:
    given = [n for n in GUIDED_FIELDS if getattr(f, n) is not None]
    return given[0] if given else None


def _stop_strings(value: str | list[str], param: str) -> tuple[str, ...]:
    stop = [value] if isinstance(value, str) else value
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(
            f"{param} has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", param
        )
    for s in stop:
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise ApiError(
                f"invalid {param} string of {len(s)} characters: each must have 1 to "
                f"{MAX_STOP_CHARS}",
                param,
            )
    return tuple(stop)


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


def _checked(kw: dict[str, Any], prefix: str, f: SamplingFields) -> SamplingParams:
    """SamplingParams(max_tokens=None, **kw); errors name `prefix` + field, or for a
    constraint the request field of `f` that held it."""
    try:
        return checked(SamplingParams, max_tokens=None, **kw)
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
            model.check_text_length(len(p), param)
    return prompts, batched


def _check_n(n: int, num_prompts: int, param: str = "n") -> None:
    _int_in(n, param, 1, MAX_N)
    if n * num_prompts > MAX_REQUESTS:
        raise ApiError(
            f"{num_prompts} prompts x {param}={n} is {n * num_prompts} generations; at most "
            f"{MAX_REQUESTS} per request",
            param=param,
        )


def check_model(name: str | None, accepted_names: tuple[str, ...]) -> None:
    """404 unless `name` names the served model (null, "" and "unknown" do, and
    `ModelInfo.accepted_names`)."""
    if name not in ANY_MODEL and name not in accepted_names:
        names = ", ".join(repr(n) for n in accepted_names)
        raise ApiError(
            f"the model {_short(name)} does not exist; this server serves {names}",
            param="model",
            status=404,
            code="model_not_found",
        )


def check_adapter(name: Any, model: ModelInfo, param: str) -> str:
    """`name` if it names a loaded LoRA adapter: a string (or SGLang's list of one name per
    prompt, all equal); 404 naming it otherwise."""
    if isinstance(name, list) and name and all(n == name[0] for n in name):
        name = name[0]
    if not isinstance(name, str):
        raise ApiError(f"{param} must be one adapter name, got {_short(name)}", param=param)
    if name not in model.adapters:
        raise ApiError(
            f"LoRA adapter {_short(name)} is not loaded",
            param=param,
            status=404,
            code="lora_not_found",
        )
    return name


@dataclass(frozen=True)
class _OpenAIChecked:
    """What both OpenAI routes take from their common fields."""

    sampling: SamplingParams  # without the route's log-prob fields
    options: RequestOptions
    adapter: str | None  # the LoRA adapter `model` or `lora_path` names (None: the base model)


def _check_openai(req: OpenAIFields, model: ModelInfo) -> _OpenAIChecked:
    """`model` (the served model, or a LoRA adapter's name) and the fields of both OpenAI
    routes."""
    adapter = req.model if req.model in model.adapters else None
    if adapter is None:
        check_model(req.model, (*model.accepted_names, *model.adapters))
    sampling = _sampling(req, model)
    if req.lora_path is not None:
        adapter = check_adapter(req.lora_path, model, "lora_path")
    keep_stop = req.include_stop_str_in_output or sampling.include_stop_str_in_output
    sampling = checked(
        replace, sampling, min_tokens=req.min_tokens, include_stop_str_in_output=keep_stop
    )
    options = _options(req.cache_salt, req.priority, req.cache_ttl_s)
    return _OpenAIChecked(sampling, options, adapter)


def _options(
    cache_salt: str | None, priority: int | None, cache_ttl_s: float | None
) -> RequestOptions:
    """The request's cache salt, priority and retention hint (ranges: schemas)."""
    return checked(
        RequestOptions,
        cache_salt=cache_salt,
        priority=priority or 0,
        cache_ttl_s=cache_ttl_s or 0.0,
    )


def _include_usage(req: OpenAIFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _continuous_usage(req: OpenAIFields) -> bool:
    return bool(req.stream_options and req.stream_options.continuous_usage_stats)


# ---- per endpoint ----
def parse_completion(
    body: bytes, model: ModelInfo, unknown: UnknownFields = LENIENT
) -> GenerationSpec:
    req: CompletionRequest = decode_checked(body, CompletionRequest, "/v1/completions", unknown)
    common = _check_openai(req, model)
    prompts, batched = _prompt_list(req.prompt, "prompt", model)
    _check_max_tokens(req.max_tokens, "max_tokens")
    _check_n(req.n, len(prompts))
    if req.logprobs is not None:
        _int_in(req.logprobs, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    prompt_logprobs = bool(req.echo and req.logprobs is not None)
    if prompt_logprobs and req.stream:
        raise ApiError("echo with logprobs is not supported when streaming", param="echo")
    sampling = checked(
        replace,
        common.sampling,
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
        prompt_logprobs=prompt_logprobs,  # from the second prompt token on
    )
    return GenerationSpec(
        prompts=prompts,
        sampling=sampling,
        max_tokens=req.max_tokens,
        options=common.options,
        adapter=common.adapter,
        default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS,
        n=req.n,
        stream=bool(req.stream),
        include_usage=_include_usage(req),
        continuous_usage=_continuous_usage(req),
        batched=batched,
        echo=bool(req.echo),
        add_special_tokens=req.add_special_tokens,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        grammar_param=grammar_param(req),
    )


def parse_chat(
    body: bytes,
    model: ModelInfo,
    render: Callable[[list[dict[str, str]], ChatTemplateOptions], str],
    unknown: UnknownFields = LENIENT,
    tool_parser: str = "hermes",
) -> GenerationSpec:
    """`render` applies the chat template (raises ApiError for messages it cannot take);
    `tool_parser`: the format the model writes tool calls in."""
    req: ChatCompletionRequest = decode_checked(
        body, ChatCompletionRequest, "/v1/chat/completions", unknown
    )
    common = _check_openai(req, model)
    if not req.messages:
        raise ApiError("messages is empty: at least one message is needed", param="messages")
    check_chat_length(req.messages, req.tools, model)
    messages = chat_messages(req.messages)
    template_messages(messages, req.messages)
    tool_req = parse_tools(req, tool_parser)
    options = template_options(
        req.add_generation_prompt,
        req.continue_final_message,
        req.chat_template_kwargs,
        messages,
        list(tool_req.template_tools) if tool_req else None,
    )
    sampling, grammar = common.sampling, grammar_param(req)
    if tool_req is not None:
        sampling, grammar = tool_constraint(tool_req, sampling, grammar)
    max_tokens = req.max_completion_tokens
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = req.max_tokens, "max_tokens"
    _check_max_tokens(max_tokens, name)
    _check_n(req.n, 1)
    if req.top_logprobs and not req.logprobs:
        raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    top_logprobs = (req.top_logprobs or 0) if req.logprobs else 0
    sampling = checked(replace, sampling, logprobs=bool(req.logprobs), top_logprobs=top_logprobs)
    return GenerationSpec(
        prompts=[render(messages, options)],
        sampling=sampling,
        max_tokens=max_tokens,
        options=common.options,
        adapter=common.adapter,
        n=req.n,
        stream=bool(req.stream),
        include_usage=_include_usage(req),
        continuous_usage=_continuous_usage(req),
        add_special_tokens=req.add_special_tokens,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        grammar_param=grammar,
        prompt_param="messages",
        max_tokens_param=name,
        tools=tool_req,
    )


@dataclass(frozen=True)
class GenerateSpec:
    """/generate: the generation plus its native options."""

    gen: GenerationSpec
    rid: str | None  # the client's id (opaque; only echoed back and used by /abort)
    # prompt log-probs from this prompt position on (0: the first is null); None: none
    logprob_start_len: int | None
    return_logprob: bool  # output (and, with logprob_start_len, prompt) log-probs
    return_text_in_logprobs: bool  # log-prob entries [logprob, token_id, text]: text set


def check_rid(rid: str, param: str = "rid") -> None:
    if len(rid) > MAX_RID_CHARS:
        raise ApiError(f"{param} has {len(rid)} characters; at most {MAX_RID_CHARS}", param)


def parse_generate(body: bytes, model: ModelInfo, unknown: UnknownFields = LENIENT) -> GenerateSpec:
    req: GenerateRequest = decode_checked(body, GenerateRequest, "/generate", unknown)
    check_model(req.model, model.accepted_names)
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
    if None not in (sp.max_new_tokens, sp.max_tokens) and sp.max_new_tokens != sp.max_tokens:
        raise ApiError(
            f"sampling_params.max_tokens={_short(sp.max_tokens)} and max_new_tokens="
            f"{_short(sp.max_new_tokens)} disagree: set one of them",
            "sampling_params.max_tokens",
        )
    max_tokens = sp.max_new_tokens if sp.max_new_tokens is not None else sp.max_tokens
    _check_max_tokens(max_tokens, "sampling_params.max_new_tokens")
    if sp.sampling_seed is not None and sp.seed is None:
        sp.seed = sp.sampling_seed
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
    adapter = None
    if req.lora_path is not None:
        adapter = check_adapter(req.lora_path, model, "lora_path")
    return_logprob = bool(req.return_logprob)
    start = req.logprob_start_len
    if start == -1 or not (return_logprob or req.return_prompt_logprob):
        start = None  # SGLang: no prompt log-probs
    if req.return_prompt_logprob and start is None:
        start = 1  # radixrt's: from the second prompt token on
    sampling = checked(
        replace,
        sampling,
        min_tokens=sp.min_new_tokens,
        logprobs=return_logprob,
        top_logprobs=(req.top_logprobs_num or 0) if return_logprob else 0,
        prompt_logprobs=start is not None,
        logprob_start_len=max(1, start or 1),
    )
    gen = GenerationSpec(
        prompts=prompts,
        sampling=sampling,
        max_tokens=max_tokens,
        options=_options(req.cache_salt, req.priority, req.cache_ttl_s),
        adapter=adapter,
        default_max_tokens=GENERATE_DEFAULT_MAX_TOKENS,
        n=sp.n,
        beam_width=sp.beam_width,
        length_penalty=length_penalty,
        stream=req.stream,
        batched=batched,
        prompt_param="text" if req.text is not None else "input_ids",
        max_tokens_param="sampling_params.max_new_tokens",
        n_param="sampling_params.n",
        grammar_param=grammar_param(sp, "sampling_params."),
    )
    return GenerateSpec(
        gen=gen,
        rid=req.rid,
        logprob_start_len=start,
        return_logprob=return_logprob,
        return_text_in_logprobs=req.return_text_in_logprobs,
    )
