"""Request validation without a server: every field is range-checked at the edge (so that
nothing later, msgpack included, can fail on user data), limits hold, and errors name the
field."""

from __future__ import annotations

import json
from dataclasses import replace

import msgspec
import pytest

from radixrt.sampling import (
    MAX_CACHE_SALT_CHARS,
    MAX_CACHE_TTL_S,
    MIN_PRIORITY,
    LoraRef,
    SamplingParams,
)
from radixrt.server.messages import TokenizedRequest, ToScheduler
from radixrt.server.protocol import MAX_N, MAX_STOP_CHARS, MAX_STOP_STRINGS, ApiError, ModelInfo
from radixrt.server.validate import parse_chat, parse_completion, parse_generate

MODEL = ModelInfo("/models/tiny-llama", vocab_size=2048, max_model_len=2048)
BIG = 2**64 - 1


def comp(**fields):
    return parse_completion(json.dumps({"prompt": "hi", **fields}).encode(), MODEL)


def chat(**fields):
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat(json.dumps(body).encode(), MODEL, lambda m, o: m[0]["content"])


def gen(**fields):
    return parse_generate(json.dumps({"text": "hi", **fields}).encode(), MODEL)


def error(fn, **fields) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(**fields)
    return e.value


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"seed": 2**63}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": BIG}, "seed"),
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": 2049}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
        ({"stop_token_ids": [2048]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": MAX_N + 1}, "n"),
        ({"n": BIG}, "n"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": BIG}, "logprobs"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"2048": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "x"}, "suffix"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"echo": True, "logprobs": 1, "stream": True}, "echo"),
        ({"prompt": [1, 2048]}, "prompt"),
        ({"prompt": [[1], [BIG]]}, "prompt"),
        ({"prompt": "x" * (64 * 2048 + 1)}, "prompt"),
        ({"prompt": ["a"] * 3, "n": 100}, "n"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ],
)
def test_completion_field_out_of_range_is_400_naming_it(fields, param):
    e = error(comp, **fields)
    assert (e.status, e.param) == (400, param), e.message


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
        ({"max_completion_tokens": -5}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "t"}]}]}, None),
        ({"parallel_tool_calls": "x"}, "parallel_tool_calls"),
        ({"tools": [{"function": {"name": "f", "parameters": 3}}]}, "tools[0].function.parameters"),
        (
            {"tools": [{"function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{}]}, "functions"),
    ],
)
def test_chat_field_checks(fields, param):
    e = error(chat, **fields)
    assert e.status == 400
    assert e.param == param or (param is None and "tool_calls" in e.param), e.message


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"rid": "r" * 257}, "rid"),
        ({"logprob_start_len": 2**63}, "logprob_start_len"),
        ({"logprob_start_len": -2}, "logprob_start_len"),
        ({"top_logprobs_num": 21}, "top_logprobs_num"),
        ({"sampling_params": {"seed": 2**63}}, "sampling_params.seed"),
        ({"sampling_params": {"top_k": 2**63}}, "sampling_params.top_k"),
        ({"sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
        ({"sampling_params": {"min_new_tokens": -1}}, "sampling_params.min_new_tokens"),
        ({"text": None, "input_ids": [[1], [2, BIG]]}, "input_ids"),
    ],
)
def test_generate_field_checks(fields, param):
    e = error(gen, **fields)
    assert (e.status, e.param) == (400, param), e.message


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'"temperature": 1e400', "temperature"),
        (b'"top_p": -1e400', "top_p"),
        (b'"seed": 1e3', "seed"),
        (b'"n": true', "n"),
    ],
)
def test_numbers_json_cannot_hold_as_asked(raw, param):
    with pytest.raises(ApiError) as e:
        parse_completion(b'{"prompt": "hi", ' + raw + b"}", MODEL)
    assert e.value.param == param, e.value.message


def test_model_names():
    for name in (None, MODEL.name, "tiny-llama", "default"):
        comp(model=name)
    e = error(comp, model="gpt-4o")
    assert (e.status, e.param, e.code) == (404, "model", "model_not_found")
    assert e.body()["error"]["code"] == "model_not_found"
    assert error(chat, model="nope").status == 404


def test_top_k_off_spellings_and_seed_wrap():
    for off in (-1, 0, None):
        assert comp(top_k=off).sampling.top_k is None
    assert comp(top_k=2048).sampling.top_k == 2048
    spec = comp(seed=2**63 - 1, n=3)
    assert [spec.params(4, choice=i).seed for i in range(3)] == [2**63 - 1, 0, 1]


def test_spec_params_set_max_tokens_seed_and_n():
    spec = comp(seed=5, n=3, temperature=0.5)
    assert spec.sampling.max_tokens is None and spec.sampling.n == 1  # set per request
    p = spec.request_params(7)
    assert (p.max_tokens, p.n, p.seed, p.temperature) == (7, 3, 5, 0.5)
    assert spec.params(7, choice=2) == replace(spec.sampling, max_tokens=7, seed=7)
    assert comp(n=2).params(3, choice=1).seed is None


def test_late_sampling_fields_are_refused_when_parsed():
    """Fields set after the shared sampling fields are checked are refused by the parser,
    naming the SamplingParams field, as when the front made the params."""
    for fn, fields in [
        (comp, {"min_tokens": 2**31}),
        (chat, {"min_tokens": 2**40}),
        (gen, {"sampling_params": {"min_new_tokens": 2**31}}),
    ]:
        e = error(fn, **fields)
        assert (e.status, e.param) == (400, "min_tokens")


def test_everything_that_validates_encodes_for_the_scheduler():
    """The msgpack message of the most extreme valid values round-trips."""
    spec = comp(
        seed=2**63 - 1,
        n=MAX_N,
        top_k=2048,
        stop=["s" * MAX_STOP_CHARS] * MAX_STOP_STRINGS,
        stop_token_ids=[2047] * 64,
        logit_bias={"2047": -100, "0": 100},
        logprobs=5,
        max_tokens=2**40,
        cache_salt="c" * MAX_CACHE_SALT_CHARS,
        priority=MIN_PRIORITY,
        cache_ttl_s=MAX_CACHE_TTL_S,
    )
    codec = msgspec.msgpack.Decoder(ToScheduler)
    options = replace(spec.options, lora=LoraRef("judge", "k" * 64, "/adapters/judge"))
    assert options.cache_salt == "c" * MAX_CACHE_SALT_CHARS and options.priority == MIN_PRIORITY
    for choice in range(MAX_N):
        params = spec.params(2**31 - 1, choice)
        msg = TokenizedRequest("r", [1, 2], params, options=options)
        assert codec.decode(msgspec.msgpack.encode(msg)) == msg


def test_logprob_fields():
    s = comp(logprobs=3).sampling
    assert (s.logprobs, s.top_logprobs) == (True, 3)
    s = comp(logprobs=0).sampling
    assert (s.logprobs, s.top_logprobs) == (True, 0)
    assert comp(echo=True, logprobs=1).sampling.prompt_logprobs
    assert not comp(echo=True).sampling.prompt_logprobs
    s = chat(logprobs=True, top_logprobs=20).sampling
    assert (s.logprobs, s.top_logprobs) == (True, 20)
    assert comp(logit_bias={"7": 1.5, "3": -2}).sampling.logit_bias == ((3, -2.0), (7, 1.5))


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"prompt": "\xff\xfe"}',
        b'{"prompt": "a\\ud800"}',
        b'{"prompt": "a",',
        b"[]",
        b"null",
        b"",
    ],
)
def test_malformed_bodies(body):
    with pytest.raises(ApiError) as e:
        parse_completion(body, MODEL)
    assert e.value.status == 400


def test_sampling_params_ranges():
    """The in-process Engine gets the same int64-safe ranges."""
    for kw in (
        {"seed": 2**63},
        {"top_k": 2**31},
        {"stop_token_ids": [2**31]},
        {"max_tokens": 2**31},
        {"logprob_start_len": 0},
        {"top_logprobs": 21},
        {"logit_bias": [(1, 100.5)]},
        {"logit_bias": [(1, 1.0), (1, 2.0)]},
        {"temperature": float("inf")},
        {"top_p": float("nan")},
        {"temperature": 10**400},
        {"seed": True},
    ):
        with pytest.raises(ValueError, match="invalid"):
            SamplingParams(**kw)
    p = SamplingParams(seed=2**63 - 1, top_logprobs=20, logit_bias={9: 1, 2: -1.5})
    assert p.logit_bias == ((2, -1.5), (9, 1))
