"""Structured output under abuse: complexity limits and unenforceable JSON-schema keywords
are refused before compiling, a compile past its time limit is really stopped (its worker
process killed) while other clients' grammars keep compiling, the compile cache stays within
its bytes, and grammars that match nothing fail as the request's fault."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from radixrt import SamplingParams
from radixrt.deltas import FinishReason
from radixrt.grammar.json_schema_support import SUPPORTED_KEYWORDS, check_json_schema
from radixrt.grammar.regex_limits import MAX_OPTIONAL_RUN, check_regex, regex_cost
from radixrt.grammar.spec import GrammarSpec

DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
# compiles for minutes (about cubic in the 600 optional items); no pre-compile limit on EBNF
SLOW_EBNF = "root ::= " + ' ("a" | "b" | "c" | "d")?' * 600


# ---- limits checked before compiling (plain Python) ----
@pytest.mark.parametrize(
    "regex, run",
    [
        ("(a|b|c|d)?" * 3000, 3000),
        ("a?" * 65, 65),
        ("(" + "a?" * 40 + ")" + "b*" * 40, 80),  # a group without quantifier is inlined
        ("[ab]?" * 30 + "(x|)" * 40, 70),
    ],
    ids=["3000-groups", "65", "inlined-group", "mixed"],
)
def test_regexes_with_long_optional_runs_are_refused(regex, run):
    assert regex_cost(regex).longest_optional_run == run
    with pytest.raises(ValueError, match=f"{run} consecutive optional items.*at most 64"):
        check_regex(regex)


@pytest.mark.parametrize(
    "regex",
    [
        DATE,
        r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)",
        r"[\w.+-]+@[\w-]+\.[\w.]+",
        "(a|b|c|d){0,3000}",  # a bounded repeat is one item
        "(" + "a?" * 60 + "){100}",
        "(a?b)" * 500,  # runs of one
        r"\(?\d{3}\)?[ -]?\d{3}-\d{4}",
        "a?" * MAX_OPTIONAL_RUN,
    ],
    ids=["date", "ipv4", "email", "bounded-repeat", "repeated-group", "runs-of-one", "phone",
         "at-limit"],
)  # fmt: skip
def test_ordinary_regexes_pass_the_limits(regex):
    check_regex(regex)


def test_deep_group_nesting_is_refused():
    with pytest.raises(ValueError, match="nested 40 deep; at most 32"):
        check_regex("(" * 40 + "a" + ")" * 40)


@pytest.mark.parametrize(
    "schema, keyword, path",
    [
        ({"type": "integer", "not": {"const": 1}}, '"not"', "/not"),
        ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, '"allOf"', "/allOf"),
        ({"type": "number", "multipleOf": 0.5}, '"multipleOf"', "/multipleOf"),
        ({"properties": {"a": {"type": "array", "contains": {"const": 1}}}}, '"contains"',
         "/properties/a/contains"),
        ({"properties": {"a/b": {"format": "iri"}}}, '"format": "iri"',
         "/properties/a~1b/format"),
        ({"$defs": {"x": {"if": {}, "then": {}}}, "$ref": "#/$defs/x"}, '"if"', "/$defs/x/if"),
        ({"type": "array", "items": {"uniqueItems": True}}, '"uniqueItems"',
         "/items/uniqueItems"),
        ({"anyOf": [{"type": "string"}, {"dependentRequired": {"a": ["b"]}}]},
         '"dependentRequired"', "/anyOf/1/dependentRequired"),
    ],
)  # fmt: skip
def test_unenforceable_schema_keywords_are_refused_with_their_path(schema, keyword, path):
    with pytest.raises(ValueError) as e:
        check_json_schema(schema)
    assert f"unsupported json_schema keyword {keyword} at {path}:" in str(e.value)
    assert "multipleOf" in str(e.value) and "properties" in str(e.value)  # what is allowed


def test_enforced_schemas_pass():
    check_json_schema(
        {
            "title": "t",
            "type": "object",
            "properties": {
                "not": {"type": "integer", "multipleOf": 3, "minimum": 0},  # a name, no keyword
                "when": {"type": "string", "format": "date-time"},
                "ref": {"allOf": [{"$ref": "#/$defs/x"}], "description": "pydantic's shape"},
                "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": False},
            },
            "required": ["not"],
            "$defs": {"x": {"oneOf": [{"type": "string", "pattern": "^[a-z]+$"}, {"enum": [1]}]}},
            "x-vendor": {"not": "an annotation"},
        }
    )
    assert {"not", "if", "contains", "uniqueItems"}.isdisjoint(SUPPORTED_KEYWORDS)
    with pytest.raises(ValueError, match="pattern at /properties/p/pattern is too complex"):
        check_json_schema({"properties": {"p": {"type": "string", "pattern": "x?" * 100}}})


# ---- the compile workers ----
def _backend(tiny_model_dir, **kwargs):
    from radixrt.grammar.xgrammar_backend import XGrammarBackend
    from radixrt.hf_dir import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    return XGrammarBackend(tiny_model_dir, len(tok), [tok.eos_token_id], **kwargs)


def _wait_started(backend, timeout_s: float = 300.0) -> None:
    """Start the workers and wait until all of them can compile."""
    backend.start()
    pool = backend.pool
    deadline = time.monotonic() + timeout_s
    while pool.ready is None or len(pool.processes().idle) < pool.num_workers:
        assert time.monotonic() < deadline, "compile workers did not start"
        time.sleep(0.05)


def _outcome(backend, ticket, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while (outcome := backend.poll(ticket)) is None:
        assert time.monotonic() < deadline, f"{ticket.spec.kind} never finished"
        backend.wait([ticket], 0.05)
    return outcome


def _children(pid: int) -> list[int]:
    """Pids of `pid`'s child processes, as the kernel lists them (not as the pool does)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except OSError:  # the process exited meanwhile
            continue
        if int(fields[1]) == pid:  # fields: state, ppid, ...
            children.append(int(stat.parent.name))
    return children


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_slow_compiles_are_killed_and_do_not_starve_other_clients(tiny_model_dir):
    """Two grammars that compile for minutes hold both compile slots; a simple regex sent
    while they run compiles within about the preemption slice, and again while their
    workers are killed and replaced; the slow ones fail at the time limit (a 400), their
    worker processes gone."""
    from radixrt.grammar.compile_pool import PREEMPT_SLICE_S
    from radixrt.grammar.xgrammar_backend import XGrammarMatcher

    limit = 3.0
    backend = _backend(tiny_model_dir, compile_timeout_s=limit, num_workers=2)
    try:
        _wait_started(backend)
        slow = [backend.submit(GrammarSpec("ebnf", SLOW_EBNF + f' "{i}"')) for i in range(2)]
        time.sleep(0.3)
        busy = backend.pool.processes().busy
        assert len(busy) == 2
        latencies = []
        for text in (DATE, r"[0-9]{4}-x"):
            t = time.monotonic()
            outcome = _outcome(backend, backend.submit(GrammarSpec("regex", text)))
            latencies.append(time.monotonic() - t)
            assert outcome.error is None, outcome.error
            m = XGrammarMatcher(outcome.grammar, backend.vocab_size)
            assert m._matcher.accept_string("2024-05-17" if text == DATE else "1234-x")
        # a loaded machine needs a while to hand the job over; far below the limit
        assert latencies[0] < PREEMPT_SLICE_S + 1.5, latencies
        for ticket in slow:
            outcome = _outcome(backend, ticket)
            assert not outcome.internal
            assert (
                outcome.error
                == f"compiling the grammar took longer than {limit:g} s (the time limit)"
            )
        assert not any(_alive(pid) for pid in busy)  # really stopped
        stats = backend.stats()
        assert stats.grammar_compile_timeouts == 2 and stats.grammar_compile_preemptions >= 1
        # a repeat of a slow grammar fails at once, from the cache
        t = time.monotonic()
        again = _outcome(backend, backend.submit(GrammarSpec("ebnf", SLOW_EBNF + ' "0"')))
        assert "took longer" in again.error and time.monotonic() - t < 0.5
        # a worker that dies mid-compile fails that compile as the engine's fault; the
        # pool replaces it
        crash = backend.submit(GrammarSpec("ebnf", SLOW_EBNF + ' "crash"'))
        deadline = time.monotonic() + 30
        while not (busy := backend.pool.processes().busy):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(busy[0], signal.SIGKILL)
        outcome = _outcome(backend, crash)
        assert outcome.internal and "compile crashed" in outcome.error, outcome
        misses = backend.stats().grammar_cache_misses
        backend.submit(GrammarSpec("ebnf", SLOW_EBNF + ' "crash"'))  # not cached: compiles again
        assert backend.stats().grammar_cache_misses == misses + 1
        assert _outcome(backend, backend.submit(GrammarSpec("regex", "[a-c]{2}"))).error is None
        backend.check_integrity()
        procs = backend.pool.processes()
        assert procs.template is not None and set(_children(procs.template)) >= {
            *procs.idle,
            *procs.busy,
        }
        pids = [procs.template, *procs.idle, *procs.busy, *_children(procs.template)]
    finally:
        backend.close()
    assert len(pids) > 1 and not any(_alive(pid) for pid in pids)  # close() stops them all


def test_grammar_cache_stays_within_its_bytes(tiny_model_dir):
    """Distinct schemas beyond the bound evict the least recently used ones; a repeat of a
    recent one is a hit, of an evicted one a miss (it compiles again)."""
    import json

    def schema(i: int) -> GrammarSpec:
        text = json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"}}})
        return GrammarSpec("json_schema", text)

    bound = 40_000
    backend = _backend(tiny_model_dir, cache_bytes=bound, num_workers=1)
    try:
        sizes = []
        for i in range(30):
            assert _outcome(backend, backend.submit(schema(i))).error is None
            backend.check_integrity()
            sizes.append(backend.cache_stats.bytes)
        s = backend.stats()
        assert max(sizes) <= bound and s.grammar_cache_bytes <= bound
        assert s.grammar_cache_evictions > 0 and s.grammar_cache_misses == 30
        assert _outcome(backend, backend.submit(schema(29))).error is None
        assert backend.stats().grammar_cache_hits == 1
        assert _outcome(backend, backend.submit(schema(0))).error is None
        assert backend.stats().grammar_cache_misses == 31
        backend.check_integrity()
    finally:
        backend.close()


# ---- through the engine ----
def test_empty_languages_and_limits_fail_as_the_requests_fault(make_engine):
    """A grammar that matches nothing, a regex over a limit and an unenforceable schema each
    fail their request with a 400-kind error (not an internal one); others run on."""
    engine = make_engine()
    params = [
        SamplingParams(max_tokens=20, temperature=0, regex=DATE),
        SamplingParams(max_tokens=5, grammar="root ::= root"),
        SamplingParams(max_tokens=5, regex="[^\\s\\S]"),
        SamplingParams(max_tokens=5, regex="(a|b|c|d)?" * 3000),
        SamplingParams(max_tokens=5, json_schema={"type": "integer", "not": {"const": 3}}),
        SamplingParams(max_tokens=5, grammar='root ::= "a" b\nb ::= b'),  # empty after "a"
    ]
    outs = engine.generate(["a", "b", "c", "d", "e", "f"], params)
    assert outs[0].finish_reason is FinishReason.STOP
    for o, message in zip(
        outs[1:],
        [
            "invalid grammar: no output can match it",
            "invalid regex: no output can match it",
            "regex is too complex to compile: 3000 consecutive optional items",
            'unsupported json_schema keyword "not" at /not',
            "invalid grammar: no output can match it (no token may follow the 1 output tokens",
        ],
    ):
        assert o.finish_reason is FinishReason.ERROR and o.invalid_request, o
        assert o.error.startswith(message), o.error
    stats = engine.stats()
    assert stats["failed_requests"] == 0 and stats["grammar_errors"] == 5
    assert stats["grammar_cache_misses"] == 6
