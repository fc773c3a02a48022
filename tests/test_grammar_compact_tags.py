"""JSON-schema contents of a structural tag (tool-call arguments) compile as compact JSON,
as `json_schema` requests do: no blanks for a model to spend its budget on, separators
forced, and the schema keywords checked."""

from __future__ import annotations

import json

import pytest

xgr = pytest.importorskip("xgrammar")

from radixrt.grammar.compile_worker import CompileError, compact_tag  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Rome"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def _tag(schema: dict) -> str:
    call = {"type": "tag", "begin": '<tool_call>\n{"name": "f", "arguments": ',
            "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
            "end": "}\n</tool_call>"}  # fmt: skip
    fmt = {"type": "tags_with_separator", "tags": [call], "separator": "\n",
           "at_least_one": True, "stop_after_first": True}  # fmt: skip
    return json.dumps({"type": "structural_tag", "format": fmt})


@pytest.fixture(scope="module")
def compiler(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))


def _accepts(grammar, text: str) -> bool:
    m = xgr.GrammarMatcher(grammar, terminate_without_stop_token=True)
    return m.accept_string(text) and m.is_terminated()


def test_arguments_are_compact_json(compiler):
    grammar = compiler.compile_structural_tag(compact_tag(_tag(SCHEMA), "tools"))
    head, tail = '<tool_call>\n{"name": "f", "arguments": ', "}\n</tool_call>"
    assert _accepts(grammar, head + '{"city": "Oslo", "unit": "c"}' + tail)
    assert not _accepts(grammar, head + '{"city": "Oslo"\n, "unit": "c"}' + tail)
    assert not _accepts(grammar, head + '{ "city": "Oslo", "unit": "c"}' + tail)
    m = xgr.GrammarMatcher(grammar)
    assert m.accept_string(head + '{"city": "Oslo')
    assert m.find_jump_forward_string() == '", "unit": "'  # the separators are forced


def test_unenforced_keywords_in_a_structural_tag_are_refused():
    schema = {**SCHEMA, "properties": {"xs": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(CompileError, match="uniqueItems"):
        compact_tag(_tag(schema), "sampling_params.structural_tag")
