"""Smaller request findings, checked on the validation functions (no server): conflicting
length fields, malformed tool-call history, the tool and text limits counted before any
rendering."""

from __future__ import annotations

import json

import pytest

from radixrt.server.protocol import ApiError, ModelInfo
from radixrt.server.validate import parse_chat, parse_generate

MODEL = ModelInfo("/m", vocab_size=2048, max_model_len=2048)
USER = {"role": "user", "content": "q"}


def _chat(**fields):
    body = {"messages": [USER], **fields}
    return parse_chat(json.dumps(body).encode(), MODEL, lambda m, o: "prompt")


def _error(call, *args, **kw) -> ApiError:
    with pytest.raises(ApiError) as e:
        call(*args, **kw)
    assert e.value.status == 400
    return e.value


def test_max_tokens_and_max_new_tokens_must_agree():
    body = {"text": "x", "sampling_params": {"max_tokens": 5, "max_new_tokens": 7}}
    err = _error(parse_generate, json.dumps(body).encode(), MODEL)
    assert err.param == "sampling_params.max_tokens"
    body["sampling_params"]["max_tokens"] = 7  # the same value twice is fine
    assert parse_generate(json.dumps(body).encode(), MODEL).gen.max_tokens == 7


def _call(call_id: str | None) -> dict:
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    return call if call_id is None else {"id": call_id, **call}


def test_a_tool_message_must_answer_an_earlier_call():
    messages = [USER, {"role": "assistant", "tool_calls": [_call("c1")]},
                {"role": "tool", "tool_call_id": "c2", "content": "r"}]  # fmt: skip
    assert _error(_chat, messages=messages).param == "messages[2].tool_call_id"
    messages[2]["tool_call_id"] = "c1"
    _chat(messages=messages)


def test_a_call_in_the_history_needs_an_id():
    messages = [USER, {"role": "assistant", "tool_calls": [_call("c1"), _call(None)]}]
    assert _error(_chat, messages=messages).param == "messages[1].tool_calls[1].id"


def test_tool_text_counts_before_rendering():
    rendered = []
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 200_000}}
    body = json.dumps({"messages": [USER], "tools": [tool]}).encode()
    err = _error(parse_chat, body, MODEL, lambda m, o: rendered.append(m) or "p")
    assert err.param == "tools" and not rendered


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"prompt": "a\\ud800b"}', "prompt"),
        (b'{"prompt": "x", "stop": ["ok", "\\udc00"]}', "stop[1]"),
        (b'{"prompt": "x", "logit_bias": {"\\ud800": 1}}', "logit_bias"),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(body, param):
    from radixrt.server.validate import parse_completion

    err = _error(parse_completion, body, MODEL)
    assert err.param == param and "surrogate" in err.message
    err.message.encode()  # the message itself is valid text (it can be sent)


@pytest.mark.parametrize("error", [IndexError("list index out of range"), KeyError("content")])
def test_a_template_that_fails_on_the_messages_is_400(error):
    from types import SimpleNamespace

    from radixrt.server.front import Front

    def apply_chat_template(*args, **kw):
        raise error

    front = SimpleNamespace(tokenizer=SimpleNamespace(apply_chat_template=apply_chat_template))
    err = _error(Front.render_chat, front, [USER])
    assert err.param == "messages"


def test_unknown_field_names_are_remembered_up_to_a_bound():
    from radixrt.server.fields import MAX_WARNED_NAMES, UnknownFields
    from radixrt.server.schemas import CompletionRequest

    unknown = UnknownFields()
    for i in range(MAX_WARNED_NAMES + 50):
        unknown.check(json.dumps({"prompt": "x", f"name{i}": 1}).encode(), CompletionRequest, "/c")
    assert len(unknown._warned) == MAX_WARNED_NAMES
