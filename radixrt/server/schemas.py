"""HTTP request bodies: one declarative schema per route (msgspec structs).

Each route's schema declares every field of SGLang's and vLLM's request schemas for that
route (the versions followed are pinned in tests/test_server_fields.py) plus radixrt's own,
each with its JSON type and what radixrt does with it:

- honoured: implemented (`validate` turns it into SamplingParams or response options and
  checks the ranges that depend on the model); a static range is declared here
  (`msgspec.Meta(ge=..., le=...)`), a sampling range comes from radixrt.sampling;
- neutral: declared with `neutral(values)`: accepted at the upstream servers' default(s),
  which mean "feature off", and refused with a 400 naming the field otherwise
  (`fields.check_neutral`);
- informational: any value of its type is accepted (ids, labels, hints that change nothing
  radixrt does).

A name in no schema is ignored with one warning per name (as vLLM does), or refused under
`--strict-fields` (`fields.UnknownFields`). The fuzz test and docs derive their field lists
from these structs.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from radixrt.sampling import (
    MAX_CACHE_SALT_CHARS,
    MAX_CACHE_TTL_S,
    MAX_INT,
    MAX_N,
    MAX_PRIORITY,
    MAX_TOP_LOGPROBS,
    MIN_PRIORITY,
)
from radixrt.server.protocol import MAX_TOOLS
from radixrt.server.tools.request import MAX_TOOL_CALLS

# messages of one chat request: refused while decoding, before the per-message checks (a
# 50 MB body holds 1.5 M short ones); the context length bounds them further
MAX_MESSAGES = 65536

NEUTRAL = "neutral"  # key of `msgspec.Meta.extra`: the accepted values of a neutral field


def neutral(*accepted: object, why: str = "radixrt does not implement it") -> msgspec.Meta:
    """Metadata of a field accepted only at `accepted` (the upstream default(s))."""
    return msgspec.Meta(
        description=f"accepted only as {' or '.join(map(repr, accepted))}: {why}",
        extra={NEUTRAL: accepted, "why": why},
    )


def ints(lo: int, hi: int | None = None) -> msgspec.Meta:
    """An integer range (no upper bound: None)."""
    return msgspec.Meta(ge=lo, le=hi)


# a boolean feature radixrt does not have (upstream default: off)
Off = Annotated[bool, neutral(False)]
# an option radixrt does not have (upstream default: unset)
Unset = Annotated[Any, neutral(None)]
# data-parallel rank hints: one replica is one rank
Rank = Annotated[int | None, neutral(None, 0, why="a radixrt replica is one data-parallel rank")]
NoDisagg = Annotated[Any, neutral(None, why="no prefill/decode disaggregation")]
NoMultimodal = Annotated[Any, neutral(None, why="text-only models")]
NoLora = Annotated[Any, neutral(None, why="no LoRA adapters")]
# vLLM's cache_salt: requests share cached KV only with requests of the same salt (under an
# API key's tenant, radixrt.server.tenants)
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None
# vLLM's priority: lower runs first (admission, preemption and eviction order)
Priority = Annotated[int, ints(MIN_PRIORITY, MAX_PRIORITY)] | None
# radixrt's retention hint: keep the context cached this many seconds after the request
# finishes (radixrt.scheduler.retention; the engine caps it at retention_max_ttl_s)
CacheTtl = Annotated[float, msgspec.Meta(ge=0, le=MAX_CACHE_TTL_S)] | None
AnyBool = bool  # either value is honoured (the field's comment says how)


class Body(msgspec.Struct, kw_only=True):
    """Base of every schema. Unknown names are skipped by decoding and reported by
    `fields.UnknownFields` (a warning, or a 400 under --strict-fields)."""


class SamplingFields(Body, kw_only=True):
    """Sampling fields shared by every route; None means the SamplingParams default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 or 0 also mean "off" (as vLLM/SGLang)
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # regular expressions whose first match ends the output (SGLang); at most MAX_STOP_STRINGS
    stop_regex: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # fast tokenizers put nothing between special tokens: both values decode alike
    spaces_between_special_tokens: AnyBool = True
    no_stop_trim: bool = False  # SGLang: keep the stop string in the text
    regex: str | None = None  # structured output (at most one of the three)
    json_schema: dict[str, Any] | str | None = None
    ebnf: str | None = None
    custom_params: Unset = None
    watermark: Unset = None


class StreamOptions(Body, kw_only=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # usage in every chunk


class OpenAIFields(SamplingFields, kw_only=True):
    """Fields of both OpenAI routes (OpenAI's, vLLM's and SGLang's extensions)."""

    model: str | None = None  # null, "" or "unknown": the served model
    max_tokens: Annotated[int, ints(0)] | None = None
    n: Annotated[int, ints(1, MAX_N)] = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # informational
    min_tokens: Annotated[int, ints(0)] = 0  # EOS / stop ids / stop strings wait until then
    include_stop_str_in_output: bool = False  # vLLM's no_stop_trim
    response_format: Any = None  # text | json_object | json_schema (radixrt.grammar.api)
    # vLLM's structured output: each maps onto regex / json_schema / ebnf
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None  # one of these strings exactly
    guided_grammar: str | None = None
    guided_decoding_backend: Annotated[Any, neutral(None, why="one grammar backend")] = None
    guided_whitespace_pattern: Unset = None
    truncate_prompt_tokens: Annotated[int, ints(1)] | None = None  # keep the prompt's last k
    best_of: Annotated[int | None, neutral(None, 1, why="no best-of ranking")] = None
    use_beam_search: Annotated[bool, neutral(False, why="beam search is on /generate")] = False
    length_penalty: Annotated[float, neutral(1.0, why="beam search is on /generate")] = 1.0
    allowed_token_ids: Unset = None
    prompt_logprobs: Annotated[int | None, neutral(None, why="use echo with logprobs")] = None
    priority: Priority = None
    request_id: str | None = None  # informational
    rid: str | list[str] | None = None  # informational
    logits_processors: Unset = None
    return_tokens_as_token_ids: Annotated[bool | None, neutral(None, False)] = None
    cache_salt: CacheSalt = None
    cache_ttl_s: CacheTtl = None
    kv_transfer_params: NoDisagg = None
    vllm_xargs: Unset = None
    # SGLang's extensions
    return_hidden_states: Annotated[bool | str, neutral(False)] = False
    return_routed_experts: Off = False
    routed_experts_start_len: Annotated[int, neutral(0)] = 0
    return_cached_tokens_details: Off = False
    return_spec_tokens_details: Off = False
    return_token_ids: Off = False
    # SGLang's adapter name (one, or one per prompt, all equal); radixrt.server.validate
    lora_path: str | list[str] | None = None
    custom_logit_processor: Annotated[Any, neutral(None, why="no custom logit processors")] = None
    session_id: Unset = None
    session_params: Unset = None
    images_config: NoMultimodal = None
    mm_processor_kwargs: NoMultimodal = None
    extra_key: Unset = None
    custom_labels: dict[str, str] | None = None  # informational
    data_parallel_rank: Rank = None
    routed_dp_rank: Rank = None
    disagg_prefill_dp_rank: Rank = None
    bootstrap_host: NoDisagg = None
    bootstrap_port: NoDisagg = None
    bootstrap_room: NoDisagg = None


class CompletionRequest(OpenAIFields, kw_only=True):
    prompt: str | list[Any]  # text, [text], [token id], or [[token id]]
    logprobs: int | None = None  # return sampled log-probs plus this many alternatives
    echo: bool | None = False  # prepend the prompt to the text (and its log-probs)
    suffix: Annotated[str | None, neutral(None, "", why="no fill-in-the-middle")] = None
    add_special_tokens: bool = True  # BOS etc. added to a text prompt
    prompt_embeds: NoMultimodal = None


class ContentPart(Body, kw_only=True):
    type: str
    text: str | None = None


class FunctionCall(Body, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text (OpenAI), or an object


class ToolCallIn(Body, kw_only=True):
    """An earlier call in an assistant message (passed to the chat template)."""

    id: str | None = None
    type: str = "function"
    function: FunctionCall
    index: int | None = None  # informational (streamed calls carry it)


class ChatMessage(Body, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # passed to the chat template
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls (radixrt.server.tools)
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # passed to the chat template
    phase: str | None = None  # informational
    tools: Annotated[Any, neutral(None, why="no tool calling")] = None
    prefix: Annotated[bool | None, neutral(None, False, why="use continue_final_message")] = None


class FunctionDef(Body, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # arguments match the schema: by construction with
    # tool_choice required or named; auto constrains a call once started (hermes, mistral)


class ToolDef(Body, kw_only=True):
    type: str = "function"  # only "function"
    function: FunctionDef


class ChatCompletionRequest(OpenAIFields, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, ints(0)] | None = None  # wins over max_tokens
    # functions the model may call (radixrt.server.tools)
    tools: Annotated[list[ToolDef], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    # "none" | "auto" (the default with tools) | "required" | {"type": "function",
    # "function": {"name": ...}}
    tool_choice: str | dict[str, Any] | None = None
    functions: Annotated[Any, neutral(None, why="deprecated: use tools")] = None
    function_call: Annotated[Any, neutral(None, why="deprecated: use tool_choice")] = None
    parallel_tool_calls: bool | None = None  # false: at most one call (default true)
    # calls in one answer at most with parallel calls (default tools.DEFAULT_MAX_TOOL_CALLS)
    max_tool_calls: Annotated[int, ints(1, MAX_TOOL_CALLS)] | None = None
    structural_tag: Unset = None
    bad_words: Annotated[Any, neutral(None, [], why="no banned word lists")] = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, ints(0, MAX_TOP_LOGPROBS)] | None = None  # with logprobs
    echo: Annotated[bool, neutral(False, why="no echo of the last message")] = False
    # None: true unless continue_final_message
    add_generation_prompt: bool | None = None
    # the last (assistant) message stays open: the model continues it
    continue_final_message: bool = False
    add_special_tokens: bool = False  # BOS etc. added on top of the template's
    documents: Annotated[Any, neutral(None, why="no RAG documents in templates")] = None
    chat_template: Annotated[Any, neutral(None, why="the model's own template only")] = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables
    # reasoning output: no reasoning parser, so the answer has no separate reasoning part
    # and each value of these is honoured as it is
    reasoning_effort: Annotated[Any, neutral(None, why="no reasoning models")] = None
    include_reasoning: AnyBool = True
    separate_reasoning: AnyBool = True
    stream_reasoning: AnyBool = True
    thinking: Annotated[Any, neutral(None, why="no reasoning models")] = None
    task: Unset = None
    # SGLang's output extensions
    return_prompt_token_ids: Off = False
    return_meta_info: Off = False
    return_input_ids_in_sglext: Off = False
    return_output_ids_in_sglext: Off = False
    return_sampling_mask: Off = False
    sampling_logprobs_mode: Unset = None
    return_flat_raw_output_top_logprobs: Off = False
    return_flat_raw_top_logprobs_b64: AnyBool = True  # format of a flat output never asked
    input_ids: Annotated[Any, neutral(None, why="chat prompts are messages")] = None
    max_dynamic_patch: NoMultimodal = None
    min_dynamic_patch: NoMultimodal = None
    use_audio_in_video: Annotated[bool, neutral(False, why="text-only models")] = False
    video_config: NoMultimodal = None


class GenerateSamplingParams(SamplingFields, kw_only=True):
    """/generate `sampling_params`: SGLang's SamplingParams plus radixrt's beam search."""

    max_new_tokens: Annotated[int, ints(0)] | None = None
    max_tokens: Annotated[int, ints(0)] | None = None  # alias of max_new_tokens
    min_new_tokens: Annotated[int, ints(0)] = 0  # EOS / stop ids / stop strings wait
    n: int = 1  # samples of each prompt (a list of n outputs per prompt)
    beam_width: int | None = None  # beam search instead of sampling (W outputs per prompt)
    length_penalty: float | None = None  # beam search only: score = cum / length ** this
    sampling_seed: int | None = None  # SGLang's name of seed
    # an xgrammar structural tag (JSON text or object; SGLang's), e.g. tool calls
    structural_tag: str | dict[str, Any] | None = None
    stream_interval: Annotated[int, ints(1)] | None = None  # streaming is per step already
    # SGLang's normalised internals (set by its server, accepted at their defaults)
    stop_strs: Unset = None
    stop_regex_strs: Unset = None
    stop_str_max_len: Annotated[int, neutral(0)] = 0
    stop_regex_max_len: Annotated[int, neutral(0)] = 0
    is_normalized: Off = False
    ebnf_full_assistant: Off = False


class GenerateRequest(Body, kw_only=True):
    """/generate: SGLang's GenerateReqInput (one sampling_params for every prompt)."""

    model: str | None = None  # null, "" or "unknown": the served model
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # [int] or [[int]]
    sampling_params: GenerateSamplingParams = msgspec.field(default_factory=GenerateSamplingParams)
    stream: bool = False
    rid: str | None = None  # the client's id: echoed back, and /abort takes it
    return_logprob: bool | None = False
    top_logprobs_num: Annotated[int, ints(0, MAX_TOP_LOGPROBS)] | None = 0
    # with return_logprob: prompt log-probs from this prompt position on (SGLang's rule:
    # None or -1: none; 0: the first prompt token gets a null log-prob)
    logprob_start_len: Annotated[int, ints(-1, MAX_INT)] | None = None
    return_prompt_logprob: bool = False  # radixrt's: prompt log-probs without return_logprob
    return_text_in_logprobs: bool = False  # log-prob entries carry the token's text
    log_metrics: AnyBool = True  # every request is counted in /metrics either way
    no_logs: AnyBool = False  # radixrt logs no request content either way
    custom_labels: dict[str, str] | None = None  # informational
    routing_key: str | None = None  # informational
    conversation_id: str | None = None  # informational
    external_trace_header: dict[str, Any] | None = None  # informational
    received_time: float | None = None  # informational
    priority: Priority = None
    session_id: Unset = None
    session_params: Unset = None
    token_ids_logprob: Unset = None
    return_sampling_mask: Annotated[Any, neutral(None, False)] = None
    sampling_logprobs_mode: Unset = None
    return_flat_raw_top_logprobs: Off = False
    return_flat_raw_output_top_logprobs: Off = False
    return_flat_raw_top_logprobs_b64: Off = False
    return_hidden_states: Annotated[Any, neutral(False)] = False
    return_routed_experts: Off = False
    routed_experts_start_len: Annotated[int, neutral(0)] = 0
    return_indexer_topk: Off = False
    return_bytes: Off = False
    return_entropy: Off = False
    return_prompt_token_ids: Off = False
    background: Annotated[bool, neutral(False, why="no background requests")] = False
    require_reasoning: Off = False
    max_thinking_tokens: Annotated[Any, neutral(None, why="no reasoning models")] = None
    lora_path: str | list[str] | None = None  # as OpenAIFields.lora_path
    lora_id: NoLora = None
    custom_logit_processor: Annotated[Any, neutral(None, why="no custom logit processors")] = None
    positional_embed_overrides: Unset = None
    watermark: Unset = None
    extra_key: Unset = None
    cache_salt: CacheSalt = None
    cache_ttl_s: CacheTtl = None
    kv_hints: Unset = None
    http_worker_ipc: Unset = None
    data_parallel_rank: Rank = None
    routed_dp_rank: Rank = None
    disagg_prefill_dp_rank: Rank = None
    bootstrap_host: NoDisagg = None
    bootstrap_port: NoDisagg = None
    bootstrap_room: NoDisagg = None
    bootstrap_pair_key: NoDisagg = None
    decode_tp_size: NoDisagg = None
    input_embeds: NoMultimodal = None
    image_data: NoMultimodal = None
    video_data: NoMultimodal = None
    audio_data: NoMultimodal = None
    mm_hashes: NoMultimodal = None
    mm_content_hashes: NoMultimodal = None
    modalities: NoMultimodal = None
    use_audio_in_video: Annotated[bool, neutral(False, why="text-only models")] = False
    video_config: NoMultimodal = None
    need_wait_for_mm_inputs: NoMultimodal = None
    num_items_assigned: NoMultimodal = None
    encoder_urls: NoMultimodal = None
    max_dynamic_patch: NoMultimodal = None
    min_dynamic_patch: NoMultimodal = None
    image_max_dynamic_patch: NoMultimodal = None
    video_max_dynamic_patch: NoMultimodal = None
    images_config: NoMultimodal = None
    mm_processor_kwargs: NoMultimodal = None
    multi_item_delimiter_indices: Unset = None
    token_indices_to_pool: Unset = None


class AbortBody(Body, kw_only=True):
    rid: str


MAX_RELEASE_RIDS = 1024  # ids per POST /release_cache_holds


class ReleaseHoldsBody(Body, kw_only=True):
    """POST /release_cache_holds: /generate ids (`meta_info["id"]`) whose holds end."""

    rids: Annotated[list[str], msgspec.Meta(max_length=MAX_RELEASE_RIDS)]


class TokenizeRequest(Body, kw_only=True):
    """vLLM's POST /tokenize: a completion prompt, or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False
    chat_template: Annotated[Any, neutral(None, why="the model's own template only")] = None
    # passed to the chat template with messages
    tools: Annotated[list[ToolDef], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    mm_processor_kwargs: NoMultimodal = None


class DetokenizeRequest(Body, kw_only=True):
    """vLLM's POST /detokenize."""

    model: str | None = None
    tokens: list[int]
