"""Structured output on the tiny model (CPU): constrained samples match their regex / schema
and stop, greedy constrained decoding is the argmax over allowed tokens, jump-forward changes
nothing but the step count, and bad or slow grammars fail alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from radixrt import SamplingParams
from radixrt.deltas import FinishReason
from radixrt.grammar.spec import JSON_OBJECT_EBNF

pytest.importorskip("xgrammar")

DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
IPV4 = r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "string", "maxLength": 4}, "admin": {"type": "boolean"}},
            "required": ["id", "admin"],
        },
    },
    "required": ["name", "color", "ok", "tags", "owner"],
}
PROMPTS = ["The date is ", "Server address: ", "Answer in JSON: ", "x", "Tell me a story"]


def test_regex_samples_full_match_and_stop(make_engine):
    engine = make_engine()
    for regex in (DATE, IPV4):
        outs = engine.generate(
            [PROMPTS[i % len(PROMPTS)] for i in range(200)],
            SamplingParams(max_tokens=40, temperature=1.0, regex=regex),
        )
        for o in outs:
            assert o.finish_reason is FinishReason.STOP, o
            assert re.fullmatch(regex, o.text), o.text
        assert len({o.text for o in outs}) > 20  # really sampled
    stats = engine.stats()
    assert stats["grammar_requests"] == 400 and stats["grammar_forced_tokens"] > 0


def test_json_schema_samples_validate(make_engine):
    engine = make_engine()
    outs = engine.generate(
        [PROMPTS[i % len(PROMPTS)] for i in range(100)],
        [SamplingParams(max_tokens=200, temperature=1.0, json_schema=SCHEMA) for _ in range(100)],
    )
    for o in outs:
        assert o.finish_reason is FinishReason.STOP, o
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs}) > 20


def test_json_object_outputs_parse(make_engine):
    """OpenAI's json_object (any JSON object): the tiny model writes long strings, so some
    outputs run out of tokens; every finished one parses to an object."""
    engine = make_engine()
    outs = engine.generate(
        PROMPTS * 2,
        [
            SamplingParams(max_tokens=120, temperature=0.5, seed=i, grammar=JSON_OBJECT_EBNF)
            for i in range(10)
        ],
    )
    stopped = [o for o in outs if o.finish_reason is FinishReason.STOP]
    assert len(stopped) >= 2
    for o in stopped:
        assert isinstance(json.loads(o.text), dict), o.text
    for o in outs:
        assert o.text.startswith("{") and o.finish_reason in (
            FinishReason.STOP,
            FinishReason.LENGTH,
        )


def test_greedy_is_argmax_over_allowed_tokens(make_engine, tiny_model_dir):
    """Recompute every constrained greedy token from HF transformers' logits of the whole
    sequence and an independent matcher's mask."""
    from grammar_helpers import allowed_tokens
    from transformers import AutoModelForCausalLM

    from radixrt.grammar.spec import GrammarSpec

    engine = make_engine()
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    backend = engine.core.grammar_backend
    vocab = engine.model_config.vocab_size
    cases = [("regex", DATE), ("json_schema", json.dumps(SCHEMA)), ("regex", IPV4)]
    for (kind, text), prompt in zip(cases, PROMPTS):
        field = {"regex": "regex", "json_schema": "json_schema"}[kind]
        out = engine.generate(
            [prompt], SamplingParams(max_tokens=120, temperature=0, **{field: text})
        )[0]
        assert out.finish_reason is FinishReason.STOP
        ids = engine.tokenizer.encode(prompt)
        seq = torch.tensor([ids + out.token_ids])
        with torch.no_grad():
            logits = hf(seq).logits[0, len(ids) - 1 : -1]  # [len(out), V]
        grammar = backend.poll(backend.submit(GrammarSpec(kind, text))).grammar
        matcher = backend.new_matcher(grammar)
        for j, token in enumerate(out.token_ids):
            allowed = allowed_tokens(matcher.next_mask(), vocab)
            masked = logits[j].masked_fill(~allowed, float("-inf"))
            assert int(masked.argmax()) == token, (prompt, j)
            assert matcher.accept(token)
        assert matcher.is_terminated()


def _run(engine, params):
    outs = engine.generate(PROMPTS, params)
    return [(o.token_ids, o.finish_reason, o.logprobs) for o in outs]


@pytest.mark.parametrize("overlap", [False, True])
def test_jump_forward_identical_and_counted(make_engine, overlap):
    params = [
        SamplingParams(max_tokens=120, temperature=0, json_schema=SCHEMA, logprobs=True),
        SamplingParams(max_tokens=120, temperature=1.0, seed=7, json_schema=SCHEMA),
        SamplingParams(max_tokens=40, temperature=1.0, seed=11, regex=DATE, logprobs=True),
    ]
    on = make_engine(overlap_schedule=overlap)
    off = make_engine(overlap_schedule=overlap, jump_forward=False)
    for p in params:
        a, b = _run(on, p), _run(off, p)
        assert [x[:2] for x in a] == [x[:2] for x in b]
        # forced tokens have log-prob 0 both ways; the others agree up to float rounding
        # (a forced run is prefilled, not decoded)
        for x, y in zip(a, b):
            assert x[2] == pytest.approx(y[2], abs=1e-4)
            assert [v == 0.0 for v in x[2]] == [v == 0.0 for v in y[2]]
    assert on.stats()["grammar_forced_tokens"] > 0 and off.stats()["grammar_forced_tokens"] == 0
    assert on.stats()["steps"] < off.stats()["steps"]
    assert on.stats()["generated_tokens"] == off.stats()["generated_tokens"]


def test_chunked_prefill_preemption_overlap_same_outputs(make_engine):
    """Greedy constrained outputs do not change with chunked prefill, preemption (the
    matcher keeps the host tokens' state), overlap or mixed unconstrained rows."""
    mixed = [
        SamplingParams(max_tokens=80, temperature=0, json_schema=SCHEMA),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, regex=IPV4),
        SamplingParams(max_tokens=80, temperature=0, json_schema=SCHEMA),
        SamplingParams(max_tokens=40, temperature=0, regex=DATE),
    ]
    ref = [o.token_ids for o in make_engine(prefix_cache="none").generate(PROMPTS, mixed)]
    variants = [
        dict(max_num_batched_tokens=5),
        dict(block_size=4, num_kv_blocks=24, overlap_schedule=True),
        dict(block_size=4, num_kv_blocks=24, jump_forward=False),
        dict(overlap_schedule=True, long_prefill_token_threshold=3),
    ]
    for options in variants:
        engine = make_engine(**options)
        assert [o.token_ids for o in engine.generate(PROMPTS, mixed)] == ref, options
        if "num_kv_blocks" in options:
            assert engine.stats()["preemptions"] > 0


def test_n_children_each_follow_the_grammar(make_engine):
    engine = make_engine()
    outs = engine.generate(
        PROMPTS[:2], SamplingParams(n=8, max_tokens=40, temperature=1.0, regex=IPV4)
    )
    assert len(outs) == 16
    for o in outs:
        assert o.finish_reason is FinishReason.STOP and re.fullmatch(IPV4, o.text)
    assert len({o.text for o in outs}) > 4


SENTENCES = r"((the|a) (cat|dog|bird) (sat|ran|slept)( on the (mat|rug))?\. ){3,8}"


@pytest.mark.parametrize("method", ["ngram", "radix"])
def test_constrained_rows_draft_checked_against_the_grammar(make_engine, method):
    """With a host-side proposer constrained rows draft: drafts are cut where the grammar
    refuses them and every verify position is masked by the state after the drafts before
    it, so outputs (greedy, seeded, JSON) are identical to no speculation, and drafts of
    constrained rows do get accepted (radix: the second run drafts from the tree)."""
    ref = make_engine()
    spec = make_engine(speculative_method=method, ngram_min_n=1)
    prompts = ["the cat sat on the mat. the cat sat on the mat. the cat", "Once upon a time"]
    for p in [
        SamplingParams(max_tokens=80, temperature=0, regex=SENTENCES, logprobs=True),
        SamplingParams(max_tokens=80, temperature=0.8, seed=5, regex=SENTENCES),
        SamplingParams(max_tokens=120, temperature=0, json_schema=SCHEMA),
    ]:
        for _ in range(2):
            want, got = ref.generate(prompts, p), spec.generate(prompts, p)
            assert [(o.token_ids, o.finish_reason) for o in got] == [
                (o.token_ids, o.finish_reason) for o in want
            ]
            for o, w in zip(got, want):
                assert o.logprobs == pytest.approx(w.logprobs, abs=1e-4)
                if p.regex:
                    assert re.fullmatch(SENTENCES, o.text) or o.finish_reason.value == "length"
    s = spec.stats()
    assert s["spec_draft_tokens"] > 0 and s["spec_accepted_tokens"] > 0


def _running_constrained(engine, regex: str):
    """A request constrained by `regex`, stepped until its grammar compiled and it runs:
    (the request, its matcher)."""
    grammar = engine.scheduler.grammar
    engine.add_request(engine.tokenizer.encode("x"), SamplingParams(max_tokens=20, regex=regex))
    while True:  # until the grammar compiled and the request runs
        engine.core.step()
        req = next(iter(engine.scheduler.requests.values()))
        if grammar.matcher(req) is not None:
            break
    return req, grammar.matcher(req)


def test_grammar_drafts_are_cut_at_the_first_refused_token(make_engine):
    """allowed_drafts keeps the longest allowed prefix and leaves the matcher unchanged; the
    row's masks are one per sample (current state, then after each draft)."""
    from grammar_helpers import allowed_tokens

    engine = make_engine()
    tok = engine.tokenizer
    grammar = engine.scheduler.grammar
    req, m = _running_constrained(engine, "abcabc")
    before = (m.num_accepted, m.next_mask())
    good = [t for t in tok.encode("abcabc") if t != tok.bos_token_id]
    bad = tok.encode("z")[-1]
    drafts = grammar.allowed_drafts(req, good[:2] + [bad] + good[2:])
    assert drafts == good[:2]
    assert (m.num_accepted, m.next_mask()) == before
    masks = grammar._masks(req, drafts)
    width = len(before[1])
    assert len(masks) == width * 3 and masks[:width] == before[1]
    vocab = engine.model_config.vocab_size
    assert allowed_tokens(masks[width : 2 * width], vocab)[good[1]]
    assert (m.num_accepted, m.next_mask()) == before
    engine.abort(req.rid)


def test_a_draft_that_ends_the_grammar_gets_a_mask_after_it(make_engine):
    """A draft run that ends on the grammar's stop token is allowed whole, and the row's masks
    still have one per sample (the one after the stop is never used): a terminated matcher
    has no next mask (found by the schema fuzz campaign under ngram speculation)."""
    engine = make_engine()
    tok = engine.tokenizer
    grammar = engine.scheduler.grammar
    req, m = _running_constrained(engine, "[a-z]{1,40}")
    before = (m.num_accepted, m.next_mask())
    whole = [t for t in tok.encode("abc") if t != tok.bos_token_id] + [tok.eos_token_id]
    drafts = grammar.allowed_drafts(req, whole)
    assert drafts == whole
    masks = grammar._masks(req, drafts)
    width = len(before[1])
    assert len(masks) == width * (len(drafts) + 1) and masks[-width:] == b"\xff" * width
    assert (m.num_accepted, m.next_mask()) == before
    engine.abort(req.rid)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("regex", "(ab", "invalid regex: "),
        ("json_schema", '{"type": "frobnicate"}', "invalid json_schema: "),
        ("grammar", 'root ::= "a" |', "invalid grammar: "),
    ],
)
def test_bad_grammar_fails_its_request_only(make_engine, field, value, message):
    engine = make_engine()
    good = SamplingParams(max_tokens=40, temperature=0, regex=DATE)
    bad = SamplingParams(max_tokens=40, **{field: value})
    outs = engine.generate(PROMPTS[:3], [good, bad, good])
    assert outs[1].finish_reason is FinishReason.ERROR and outs[1].invalid_request
    assert outs[1].error.startswith(message) and len(outs[1].error) > len(message)
    assert all(re.fullmatch(DATE, outs[i].text) for i in (0, 2))
    # n > 1: every child fails; a cached failed compile fails again
    kids = engine.generate(PROMPTS[:1], SamplingParams(n=3, **{field: value}))
    assert all(o.finish_reason is FinishReason.ERROR and o.invalid_request for o in kids)
    assert engine.stats()["grammar_errors"] == 2
    assert engine.stats()["failed_requests"] == 0  # not an engine fault


def test_compile_timeout_fails_that_request_only(make_engine):
    """A grammar that compiles for far longer than the limit (an EBNF with 600 optional
    items in a row: minutes) fails alone; its worker is killed."""
    engine = make_engine(grammar_compile_timeout_s=0.5)
    slow = "root ::= " + ' ("a" | "b" | "c" | "d")?' * 600
    outs = engine.generate(
        PROMPTS[:3],
        [
            SamplingParams(max_tokens=40, temperature=0, regex=DATE),
            SamplingParams(max_tokens=40, grammar=slow),
            SamplingParams(max_tokens=8, temperature=0),
        ],
    )
    assert outs[1].finish_reason is FinishReason.ERROR and "took longer" in outs[1].error
    assert outs[1].invalid_request
    assert re.fullmatch(DATE, outs[0].text) and outs[2].finish_reason is FinishReason.LENGTH
    assert engine.stats()["grammar_compile_timeouts"] == 1


def test_sampling_params_validation():
    p = SamplingParams(json_schema={"b": 1, "a": {"type": "string"}})
    assert p.json_schema == '{"a":{"type":"string"},"b":1}'  # canonical: one cache key
    for kwargs, field in [
        (dict(regex="a", grammar="b"), "grammar"),
        (dict(regex=""), "regex"),
        (dict(regex=3), "regex"),
        (dict(json_schema="[1]"), "json_schema"),
        (dict(json_schema="{"), "json_schema"),
        (dict(grammar="x" * (64 * 1024 + 1)), "grammar"),
    ]:
        with pytest.raises(ValueError, match=f"invalid {field}"):
            SamplingParams(**kwargs)


def test_json_strings_never_hold_raw_control_characters(make_engine):
    """xgrammar 0.2.9 lets maxLength strings take raw control bytes (JSON forbids them); the
    backend bans such tokens in JSON-schema masks. Push the model towards them."""
    engine = make_engine()
    tok = engine.tokenizer
    control = [t for t in range(len(tok)) if any(ord(c) < 0x20 for c in tok.decode([t])) and t > 6]
    assert control
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 6}}}
    schema["required"] = ["s"]
    params = SamplingParams(
        max_tokens=40, temperature=0, json_schema=schema, logit_bias={t: 50 for t in control}
    )
    for o in engine.generate(PROMPTS, params):
        assert o.finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(o.text), schema)


def test_string_level_jump_forward_follows_the_grammar_in_fewer_steps(make_engine):
    """`jump_forward_retokenize` appends xgrammar's tokens for each forced string: not
    output-identical by design, but still valid and in fewer steps."""
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=5, json_schema=SCHEMA)
    token = make_engine()
    string = make_engine(jump_forward_retokenize=True)
    for o in string.generate(PROMPTS * 4, params):
        assert o.finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(o.text), SCHEMA)
    token.generate(PROMPTS * 4, params)
    assert string.stats()["steps"] < token.stats()["steps"]
    assert string.stats()["grammar_forced_tokens"] > token.stats()["grammar_forced_tokens"]


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [3, 1]])
def test_apply_token_bitmasks_matches_reference(rows):
    from grammar_helpers import allowed_tokens

    from radixrt.executor.grammar_masks import apply_token_bitmasks

    g = torch.Generator().manual_seed(1)
    vocab = 100  # not a multiple of 32: the last word is partly padding
    masks = [
        torch.randint(-(2**31), 2**31 - 1, (4,), dtype=torch.int32, generator=g).numpy().tobytes()
        for _ in rows
    ]
    logits = torch.randn(4, vocab, generator=g)
    want = logits.clone()
    for r, m in zip(rows, masks):
        want[r] = want[r].masked_fill(~allowed_tokens(m, vocab), float("-inf"))
    apply_token_bitmasks(logits, masks, rows)
    assert torch.equal(logits, want)


def test_torch_mask_fallback_matches():
    from radixrt.executor.grammar_masks import _apply_torch, apply_token_bitmasks, stack_masks

    g = torch.Generator().manual_seed(2)
    masks = [
        torch.randint(-(2**31), 2**31 - 1, (4,), dtype=torch.int32, generator=g).numpy().tobytes()
        for _ in range(3)
    ]
    logits = torch.randn(3, 100, generator=g)
    a, b = logits.clone(), logits.clone()
    apply_token_bitmasks(a, masks, [0, 1, 2])
    _apply_torch(b, stack_masks(masks))
    assert torch.equal(a, b)


def test_padded_vocabulary_compiles_and_follows_the_schema(make_engine, tmp_path):
    """A model vocabulary far larger than its tokenizer's (the dummy presets: the tiny
    tokenizer under Llama-3's 128k logits) compiles inside the time limit and never allows a
    padding id. On an idle 16-core machine this timed out (30 s) before the fix: the
    control-byte mask iterated xgrammar's 126k padding "special" ids one FFI call at a time
    while the engine loop spun on `poll` holding the GIL (a loaded machine hides it; the
    scheduler test of the idle wait is the deterministic one)."""
    from radixrt.model.presets import write_dummy_model_dir

    model_dir = write_dummy_model_dir(str(tmp_path / "padded"), "llama-3-8b")
    config_path = tmp_path / "padded" / "config.json"
    config = json.loads(config_path.read_text())
    config.update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    config_path.write_text(json.dumps(config))
    engine = make_engine(model_dir, load_format="dummy", grammar_compile_timeout_s=20.0)
    assert engine.model_config.vocab_size == 128256
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    outs = engine.generate(
        ["Answer: "] * 4,
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, json_schema=schema),
    )
    for o in outs:
        assert o.finish_reason is FinishReason.STOP, o
        assert max(o.token_ids[:-1]) < 2048  # no padding id was ever allowed
        jsonschema.validate(json.loads(o.text), schema)


def test_control_byte_mask_equals_xgrammars_special_ids_reference(tmp_path):
    """The mask built from stop ids + the tokenizer's special ids equals the one built from
    xgrammar's own (slow, padding-inclusive) special-token list."""
    import numpy as np
    import xgrammar as xgr

    from radixrt.grammar.compile_worker import no_control_mask as _no_control_mask
    from radixrt.hf_dir import load_tokenizer
    from radixrt.model.presets import write_dummy_model_dir

    tok = load_tokenizer(write_dummy_model_dir(str(tmp_path / "m"), "llama-3-8b"))
    vocab = 128256
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[2])
    got = _no_control_mask(info, vocab, [*info.stop_token_ids, *tok.all_special_ids])
    want = _no_control_mask(info, vocab, [*info.stop_token_ids, *info.special_token_ids])
    np.testing.assert_array_equal(got, want)
    bits = np.unpackbits(got.view(np.uint8), bitorder="little")[:vocab]
    assert 0 < int((bits == 0).sum()) < 2048  # some real tokens banned, no padding id


def test_jump_forward_runs_through_the_graph_path(make_engine):
    """Forced runs (a row of several tokens sampled only at its last) take the decode-graph
    path, run eagerly on CPU from the graphs' own host metadata (tests/eager_decode_graphs):
    outputs identical to the plain eager engine."""
    from eager_decode_graphs import EagerDecodeGraphs

    params = SamplingParams(max_tokens=120, temperature=1.0, seed=7, json_schema=SCHEMA)
    want = _run(make_engine(), params)
    engine = make_engine()
    graphs = engine.core.runner.cuda_graphs = EagerDecodeGraphs(engine.core.runner)
    got = _run(engine, params)
    assert [x[:2] for x in got] == [x[:2] for x in want]
    # rows of several tokens that sample fewer than they feed went through the graph path
    assert any(samples < tokens and tokens > rows for rows, tokens, samples in graphs.calls)


def test_grammars_refuse_encoded_surrogates():
    """xgrammar decodes the bytes ED A0 80 as U+D800 and lets a negated class take it; no
    UTF-8 text holds it (the detokenizer makes three U+FFFD of it, breaking maxLength).
    `no_surrogates` leaves the surrogates out of every negated class of JSON-schema, regex
    and EBNF grammars, and nothing else: other characters, and grammar literals that look
    like a class, are as before."""
    import xgrammar as xgr

    from radixrt.grammar.compile_worker import no_surrogates

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([chr(i) for i in range(256)]))
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 3}, "b": {"enum": ['[^x"y', "z"]}},
        "required": ["a", "b"],
    }
    grammars = {
        "json_schema": (xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False),
                        '{"a": "', ['{"a": "ab", "b": "[^x\\"y"}', '{"a": "é€", "b": "z"}']),
        "regex": (xgr.Grammar.from_regex("[^a]{2}"), "", ["bc", "é€"]),
        "ebnf": (xgr.Grammar.from_ebnf('root ::= "[^" [^a]+'), "[^", ["[^bc", "[^é"]),
    }  # fmt: skip
    for kind, (grammar, opening, valid) in grammars.items():
        for fixed in (False, True):
            g = compiler.compile_grammar(no_surrogates(grammar) if fixed else grammar)
            for text in valid:
                m = xgr.GrammarMatcher(g)
                assert m.accept_string(text) and m.is_completed(), (kind, fixed, text)
            m = xgr.GrammarMatcher(g)
            assert m.accept_string(opening) or not opening
            # the bug, and its fix
            assert m.accept_string(b"\xed\xa0\x80") is not fixed, (kind, fixed)
