"""The request schemas against the upstream field lists they follow (pinned below), and
what each kind of field does: honoured fields change the request, neutral ones are accepted
at the upstream default and refused (400 naming them) otherwise, names no schema declares
are ignored with one warning (refused with --strict-fields), `model` null / "" / "unknown"
is the served model. No server: these call the validators."""

from __future__ import annotations

import json
import logging

import pytest

from radixrt.server.fields import UnknownFields, field_docs, field_names, neutral_fields
from radixrt.server.protocol import ApiError, ModelInfo
from radixrt.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateRequest,
    GenerateSamplingParams,
    StreamOptions,
)
from radixrt.server.validate import parse_chat, parse_completion, parse_generate

MODEL = ModelInfo("/models/tiny-llama", vocab_size=2048, max_model_len=2048)

# ---- the upstream schemas followed ----
# SGLang 0.5.23 (pip install sglang==0.5.23): python/sglang/srt/entrypoints/openai/protocol.py
# CompletionRequest / ChatCompletionRequest / StreamOptions / ChatCompletionMessageGenericParam,
# srt/managers/io_struct.py GenerateReqInput, srt/sampling/sampling_params.py SamplingParams.
SGLANG_VERSION = "0.5.23"
SGLANG_COMPLETION = [
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "routed_dp_rank",
    "disagg_prefill_dp_rank",
    "model",
    "prompt",
    "best_of",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
    "return_hidden_states",
    "return_routed_experts",
    "routed_experts_start_len",
    "return_cached_tokens_details",
    "return_spec_tokens_details",
    "return_token_ids",
    "top_k",
    "min_p",
    "min_tokens",
    "json_schema",
    "regex",
    "ebnf",
    "repetition_penalty",
    "stop_token_ids",
    "stop_regex",
    "no_stop_trim",
    "ignore_eos",
    "skip_special_tokens",
    "lora_path",
    "session_id",
    "session_params",
    "response_format",
    "custom_params",
    "custom_logit_processor",
    "watermark",
    "images_config",
    "mm_processor_kwargs",
    "data_parallel_rank",
    "rid",
    "extra_key",
    "cache_salt",
    "priority",
    "custom_labels",
]
SGLANG_CHAT = [
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "routed_dp_rank",
    "disagg_prefill_dp_rank",
    "messages",
    "model",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "presence_penalty",
    "response_format",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "user",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "return_hidden_states",
    "return_routed_experts",
    "routed_experts_start_len",
    "return_cached_tokens_details",
    "return_spec_tokens_details",
    "return_prompt_token_ids",
    "return_token_ids",
    "return_meta_info",
    "return_input_ids_in_sglext",
    "return_output_ids_in_sglext",
    "return_sampling_mask",
    "sampling_logprobs_mode",
    "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64",
    "reasoning_effort",
    "thinking",
    "task",
    "top_k",
    "min_p",
    "min_tokens",
    "regex",
    "ebnf",
    "repetition_penalty",
    "stop_token_ids",
    "stop_regex",
    "no_stop_trim",
    "ignore_eos",
    "continue_final_message",
    "skip_special_tokens",
    "lora_path",
    "session_id",
    "session_params",
    "separate_reasoning",
    "stream_reasoning",
    "chat_template_kwargs",
    "max_dynamic_patch",
    "min_dynamic_patch",
    "use_audio_in_video",
    "images_config",
    "video_config",
    "mm_processor_kwargs",
    "custom_logit_processor",
    "custom_params",
    "watermark",
    "input_ids",
    "rid",
    "extra_key",
    "cache_salt",
    "priority",
    "data_parallel_rank",
]
SGLANG_STREAM_OPTIONS = ["include_usage", "continuous_usage_stats"]
SGLANG_GENERATE = [
    "rid",
    "session_id",
    "text",
    "input_ids",
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "mm_hashes",
    "mm_content_hashes",
    "use_audio_in_video",
    "video_config",
    "sampling_params",
    "watermark",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_sampling_mask",
    "sampling_logprobs_mode",
    "return_text_in_logprobs",
    "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64",
    "stream",
    "log_metrics",
    "return_hidden_states",
    "return_routed_experts",
    "routed_experts_start_len",
    "return_indexer_topk",
    "modalities",
    "session_params",
    "lora_path",
    "lora_id",
    "custom_logit_processor",
    "positional_embed_overrides",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
    "routed_dp_rank",
    "data_parallel_rank",
    "disagg_prefill_dp_rank",
    "routing_key",
    "conversation_id",
    "http_worker_ipc",
    "background",
    "require_reasoning",
    "max_thinking_tokens",
    "priority",
    "extra_key",
    "no_logs",
    "custom_labels",
    "return_bytes",
    "return_entropy",
    "return_prompt_token_ids",
    "external_trace_header",
    "received_time",
    "need_wait_for_mm_inputs",
    "num_items_assigned",
    "encoder_urls",
    "max_dynamic_patch",
    "min_dynamic_patch",
    "image_max_dynamic_patch",
    "video_max_dynamic_patch",
    "images_config",
    "mm_processor_kwargs",
    "multi_item_delimiter_indices",
    "token_indices_to_pool",
    "cache_salt",
    "kv_hints",
]
SGLANG_SAMPLING_PARAMS = [
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "beam_width",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "watermark",
    "stop_strs",
    "stop_regex_strs",
    "stop_str_max_len",
    "stop_regex_max_len",
    "is_normalized",
    "ebnf_full_assistant",
]
SGLANG_MESSAGE = [
    "role", "content", "tool_call_id", "name", "phase", "reasoning_content", "tool_calls",
    "tools", "prefix",
]  # fmt: skip
# vLLM's vllm/entrypoints/openai/protocol.py at commit 0052bed36509c7a5a2d8e48265334e40cf2f5a0e
# (the 0.10 series): CompletionRequest, ChatCompletionRequest, StreamOptions.
VLLM_COMMIT = "0052bed36509c7a5a2d8e48265334e40cf2f5a0e"
VLLM_COMPLETION = [
    "model", "prompt", "prompt_embeds", "best_of", "echo", "frequency_penalty", "logit_bias",
    "logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop", "stream",
    "stream_options", "suffix", "temperature", "top_p", "user", "use_beam_search", "top_k",
    "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids",
    "prompt_logprobs", "add_special_tokens", "response_format", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
    "priority", "request_id", "logits_processors", "return_tokens_as_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs",
]  # fmt: skip
VLLM_CHAT = [
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
    "max_tokens", "max_completion_tokens", "n", "presence_penalty", "response_format", "seed",
    "stop", "stream", "stream_options", "temperature", "top_p", "tools", "tool_choice",
    "reasoning_effort", "include_reasoning", "parallel_tool_calls", "user", "best_of",
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "prompt_logprobs", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "structural_tag", "guided_decoding_backend",
    "guided_whitespace_pattern", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
]  # fmt: skip
VLLM_STREAM_OPTIONS = ["include_usage", "continuous_usage_stats"]

# OpenAI's deprecated function calling, and SGLang completion fields radixrt shares with chat
RADIXRT_CHAT = ["functions", "function_call", "json_schema", "custom_labels", "cache_ttl_s",
                "max_tool_calls"]  # fmt: skip
RADIXRT_COMPLETION = ["cache_ttl_s"]  # a retention hint (radixrt.scheduler.retention)
# radixrt's own /generate fields (beyond SGLang's)
RADIXRT_GENERATE = ["model", "return_prompt_logprob", "cache_ttl_s"]
RADIXRT_SAMPLING = ["max_tokens", "seed", "beam_width", "length_penalty"]


@pytest.mark.parametrize(
    "schema, upstream",
    [
        (CompletionRequest, SGLANG_COMPLETION + VLLM_COMPLETION + RADIXRT_COMPLETION),
        (ChatCompletionRequest, SGLANG_CHAT + VLLM_CHAT + RADIXRT_CHAT),
        (StreamOptions, SGLANG_STREAM_OPTIONS + VLLM_STREAM_OPTIONS),
        (ChatMessage, SGLANG_MESSAGE),
        (GenerateRequest, SGLANG_GENERATE + RADIXRT_GENERATE),
        (GenerateSamplingParams, SGLANG_SAMPLING_PARAMS + RADIXRT_SAMPLING),
    ],
)
def test_every_upstream_field_is_declared(schema, upstream):
    declared = set(field_names(schema))
    missing = sorted(set(upstream) - declared)
    assert not missing, f"{schema.__name__} lacks {missing}"
    extra = sorted(declared - set(upstream))
    assert not extra, f"{schema.__name__} declares {extra}, which no pinned schema has"


def test_installed_sglang_matches_the_pinned_lists():
    """When SGLang is installed at the pinned version, its classes list the same fields."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        if version("sglang") != SGLANG_VERSION:
            pytest.skip(f"sglang {version('sglang')} is installed, not {SGLANG_VERSION}")
    except PackageNotFoundError:
        pytest.skip("sglang is not installed")
    import ast
    import importlib.util
    from pathlib import Path

    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt"

    def fields(path: str, cls: str) -> list[str]:
        classes = {
            n.name: n for n in ast.parse((root / path).read_text()).body
            if isinstance(n, ast.ClassDef)
        }  # fmt: skip
        node, out = classes[cls], []
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out += fields(path, base.id)
        return out + [
            s.target.id for s in node.body
            if isinstance(s, ast.AnnAssign) and not s.target.id.startswith("_")
        ]  # fmt: skip

    protocol = "entrypoints/openai/protocol.py"
    assert fields(protocol, "CompletionRequest") == SGLANG_COMPLETION
    assert fields(protocol, "ChatCompletionRequest") == SGLANG_CHAT
    assert fields("managers/io_struct.py", "GenerateReqInput") == SGLANG_GENERATE
    assert fields("sampling/sampling_params.py", "SamplingParams") == SGLANG_SAMPLING_PARAMS


# ---- what the routers and clients send ----
SGLANG_ROUTER_CHAT = {
    "model": "unknown", "no_stop_trim": False, "continue_final_message": False,
    "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
    "include_reasoning": True, "skip_special_tokens": True, "ignore_eos": False,
    "tool_choice": "auto", "parallel_tool_calls": True, "min_tokens": 0, "top_k": -1,
}  # fmt: skip
SGLANG_ROUTER_COMPLETION = {"no_stop_trim": False, "return_hidden_states": False, "model": None}
SGLANG_ROUTER_GENERATE = {
    "model": None, "return_text_in_logprobs": False, "log_metrics": True,
    "return_hidden_states": False, "background": False, "no_logs": False,
    "return_bytes": False, "return_entropy": False, "stream": False, "return_logprob": False,
    "logprob_start_len": -1, "top_logprobs_num": 0, "rid": None, "lora_path": None,
    "data_parallel_rank": None, "bootstrap_host": None, "custom_labels": None,
}  # fmt: skip
SGLANG_FRONTEND_SAMPLING = {
    "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "min_new_tokens": 0, "stop_regex": None, "no_stop_trim": False, "n": 1,
    "max_new_tokens": 8, "stop": [], "stop_token_ids": [], "temperature": 0.0, "top_p": 1.0,
    "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "ignore_eos": False, "regex": None, "json_schema": None,
}  # fmt: skip


def comp(**fields):
    return parse_completion(json.dumps({"prompt": "hi", **fields}).encode(), MODEL)


def chat(**fields):
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat(json.dumps(body).encode(), MODEL, render)


def render(messages, options):
    return json.dumps([messages, options.add_generation_prompt, options.continue_final_message])


def gen(**fields):
    return parse_generate(json.dumps({"text": "hi", **fields}).encode(), MODEL)


def test_router_and_client_bodies_are_accepted():
    chat(**SGLANG_ROUTER_CHAT, stream=True, stream_options={"continuous_usage_stats": True})
    comp(**SGLANG_ROUTER_COMPLETION)
    gen(**SGLANG_ROUTER_GENERATE, sampling_params=SGLANG_FRONTEND_SAMPLING)
    for model in (None, "", "unknown", "default", "tiny-llama", "/models/tiny-llama"):
        comp(model=model)
        gen(model=model)


@pytest.mark.parametrize("call", [comp, chat, gen])
def test_other_model_names_are_404(call):
    with pytest.raises(ApiError) as e:
        call(model="gpt-4")
    assert (e.value.status, e.value.param) == (404, "model")


def neutral_cases():
    """(schema, field, a value radixrt cannot honour) for every neutral field."""
    for schema in (CompletionRequest, ChatCompletionRequest, GenerateRequest):
        for f in neutral_fields(schema):
            bad = "x" if not any(isinstance(a, str) for a in f.accepted) else "required"
            if any(isinstance(a, bool) for a in f.accepted):
                bad = True
            elif any(isinstance(a, (int, float)) for a in f.accepted):
                bad = 7
            yield pytest.param(schema, f.name, f.accepted, bad, id=f"{schema.__name__}.{f.name}")


CALLS = {CompletionRequest: comp, ChatCompletionRequest: chat, GenerateRequest: gen}


@pytest.mark.parametrize("schema, name, accepted, bad", list(neutral_cases()))
def test_neutral_fields_accept_the_default_and_refuse_others(schema, name, accepted, bad):
    call = CALLS[schema]
    for value in accepted:
        call(**{name: value})
    with pytest.raises(ApiError) as e:
        call(**{name: bad})
    assert (e.value.status, e.value.param) == (400, name), e.value.message


def test_neutral_fields_in_nested_objects_are_named():
    with pytest.raises(ApiError) as e:
        gen(sampling_params={"is_normalized": True})
    assert e.value.param == "sampling_params.is_normalized"
    with pytest.raises(ApiError) as e:
        chat(messages=[{"role": "user", "content": "x", "prefix": True}])
    assert e.value.param == "messages[0].prefix"


def test_unknown_names_warn_once_or_are_refused(caplog):
    lenient = UnknownFields()
    body = json.dumps(
        {"prompt": "hi", "zzz_a": 1, "stream": True, "stream_options": {"zzz_b": 2}}
    ).encode()
    with caplog.at_level(logging.WARNING, logger="radixrt.server"):
        for _ in range(3):
            parse_completion(body, MODEL, lenient)
    warned = [r.getMessage() for r in caplog.records if "ignoring field" in r.getMessage()]
    assert len(warned) == 2 and "zzz_a" in warned[0] and "stream_options.zzz_b" in warned[1]
    with pytest.raises(ApiError) as e:
        parse_completion(body, MODEL, UnknownFields(strict=True))
    assert (e.value.status, e.value.param) == (400, "zzz_a")
    sp_body = json.dumps({"text": "a", "sampling_params": {"zzz_c": 1}}).encode()
    with pytest.raises(ApiError) as e:
        parse_generate(sp_body, MODEL, UnknownFields(strict=True))
    assert e.value.param == "sampling_params.zzz_c"
    msgs = {"messages": [{"role": "user", "content": "x", "zzz_d": 1}]}
    with pytest.raises(ApiError) as e:
        parse_chat(json.dumps(msgs).encode(), MODEL, render, UnknownFields(strict=True))
    assert e.value.param == "messages[0].zzz_d"


def test_honoured_fields_reach_the_sampling_params():
    s = comp(min_tokens=3, include_stop_str_in_output=True, stop_regex=["a+b"]).sampling
    assert (s.min_tokens, s.include_stop_str_in_output, s.stop_regex) == (
        3, True, ("a+b",),
    )  # fmt: skip
    s = gen(sampling_params={"min_new_tokens": 2, "no_stop_trim": True, "stop_regex": "x"})
    assert s.gen.sampling.min_tokens == 2 and s.gen.sampling.stop_regex == ("x",)
    assert s.gen.sampling.include_stop_str_in_output
    assert gen(sampling_params={"sampling_seed": 5}).gen.sampling.seed == 5
    assert comp(guided_choice=["yes", "n.o"]).sampling.regex == r"yes|n\.o"
    assert comp(guided_regex="[0-9]+").sampling.regex == "[0-9]+"
    assert comp(guided_grammar='root ::= "a"').sampling.grammar == 'root ::= "a"'
    assert not comp(add_special_tokens=False).add_special_tokens
    assert comp(truncate_prompt_tokens=5).truncate_prompt_tokens == 5
    spec = chat(stream=True, stream_options={"continuous_usage_stats": True})
    assert spec.continuous_usage and not spec.include_usage
    spec = chat(
        messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        continue_final_message=True,
    )
    assert json.loads(spec.prompts[0])[1:] == [False, True]
    assert json.loads(chat().prompts[0])[1:] == [True, False]


@pytest.mark.parametrize(
    "call, fields, param",
    [
        (comp, {"min_tokens": -1}, "min_tokens"),
        (comp, {"stop_regex": "("}, "stop_regex"),
        (comp, {"stop_regex": "a*"}, "stop_regex"),  # matches the empty string
        (comp, {"guided_regex": "a", "guided_choice": ["b"]}, None),
        (comp, {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        (chat, {"continue_final_message": True}, "continue_final_message"),  # user message last
        (chat, {"continue_final_message": True, "add_generation_prompt": True},
         "continue_final_message"),
        (chat, {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        (gen, {"sampling_params": {"min_new_tokens": -3}}, "sampling_params.min_new_tokens"),
        (gen, {"top_logprobs_num": 21}, "top_logprobs_num"),
    ],
)  # fmt: skip
def test_values_we_cannot_honour_are_400_naming_the_field(call, fields, param):
    with pytest.raises(ApiError) as e:
        spec = call(**fields)
        spec = getattr(spec, "gen", spec)
        spec.params(8)  # SamplingParams' own checks (regexes compile)
    assert e.value.status == 400
    assert e.value.param == param or (param is None and "structured output" in e.value.message)


def test_field_docs_cover_every_field_with_its_kind():
    rows = {r.name: r for r in field_docs(GenerateRequest)}
    assert set(field_names(GenerateRequest)) <= set(rows)
    assert {f"sampling_params.{n}" for n in field_names(GenerateSamplingParams)} <= set(rows)
    assert rows["return_bytes"].accepted == (False,)
    assert rows["top_logprobs_num"].range == "[0, 20]"
    assert rows["sampling_params.min_new_tokens"].range == "[0, inf]"
    chat_rows = {r.name for r in field_docs(ChatCompletionRequest)}
    assert "messages.reasoning_content" in chat_rows
    assert "stream_options.continuous_usage_stats" in chat_rows
