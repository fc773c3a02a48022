"""Speculative decoding without a model: the ngram and radix proposers against naive models,
the radix cache's read-only continuation lookup, configuration errors, and the scheduler with
real proposers over a scripted runner (outputs equal plain decoding, counters count what they
say, the pools balance)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from naive_prefix_cache import NaivePrefixCache
from radix_helpers import format_tree
from test_step_plan import make_core, run

from radixrt.cache.radix import RadixCache
from radixrt.config import SpeculativeConfig, resolve_config
from radixrt.deltas import FinishReason
from radixrt.kv.allocator import BlockAllocator
from radixrt.sampling import SamplingParams
from radixrt.scheduler.features import Hooks
from radixrt.scheduler.request import Request
from radixrt.speculative import create_proposer
from radixrt.speculative.base import Proposer
from radixrt.speculative.ngram import NgramProposer, ngram_lookup
from radixrt.speculative.radix import RadixProposer


def naive_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n first, then the most recent earlier occurrence (plain loops)."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n :]
        for end in range(size - 2, n - 2, -1):  # occurrence tokens[end - n + 1 : end + 1]
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_ngram_lookup_examples():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3], 1, 3, 4) == [9, 1, 2, 3]
    # the longest match wins over a more recent shorter one
    assert ngram_lookup([5, 2, 3, 7, 8, 3, 6, 2, 3], 1, 3, 2) == [7, 8]
    # equally long: the most recent occurrence
    assert ngram_lookup([2, 3, 7, 2, 3, 8, 2, 3], 2, 2, 1) == [8]
    assert ngram_lookup([1, 2, 3, 4], 1, 4, 3) == []  # nothing repeats
    assert ngram_lookup([4, 4], 2, 4, 3) == []  # shorter than min_n + 1
    assert ngram_lookup([4, 4, 4], 1, 4, 3) == [4]  # the continuation ends at the sequence


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=0, max_size=40),
    st.integers(1, 4),
    st.integers(0, 3),
    st.integers(1, 6),
)
def test_ngram_lookup_matches_naive(tokens, min_n, extra, k):
    max_n = min_n + extra
    assert ngram_lookup(tokens, min_n, max_n, k) == naive_ngram(tokens, min_n, max_n, k)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), max_size=14),
    st.integers(1, 4),
    st.integers(0, 3),
)
def test_ngram_may_propose_next_is_exact(tokens, min_n, extra):
    """`may_propose_next(tokens)` (the overlapped loop's test, the next token unknown) holds
    exactly when some next token makes `propose` draft (4 stands for a token never seen)."""
    proposer = NgramProposer(min_n, min_n + extra)
    some = any(proposer.propose(tokens + [t], 1) for t in range(5))
    assert proposer.may_propose_next(tokens) == some


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), max_size=20),
    st.lists(st.lists(st.integers(0, 4), max_size=5), max_size=12),
    st.integers(1, 4),
    st.integers(0, 3),
    st.integers(1, 6),
    st.lists(st.integers(0, 40), max_size=13),
)
def test_ngram_index_equals_lookup_on_the_list(prompt, appends, min_n, extra, k, advances):
    """The tracked index (the scheduler's path) drafts what `ngram_lookup` drafts on the
    plain list, and `may_propose_next` agrees, after every batch of appended tokens (accepted
    runs, jump-forward) including lookups between no appends at all, and after the
    scheduler's `advance` over part of the list (prefill chunks)."""
    max_n = min_n + extra
    proposer = NgramProposer(min_n, max_n)
    tokens = list(prompt)
    view = proposer.track(tokens)
    for i, batch in enumerate([[], *appends]):
        tokens.extend(batch)
        if i < len(advances):
            view.advance(advances[i])
            view.check()
        assert len(view) == len(tokens) and list(view) == tokens
        expect = ngram_lookup(tokens, min_n, max_n, k)
        assert proposer.propose(view, k) == expect == proposer.propose(list(tokens), k)
        assert proposer.may_propose_next(view) == proposer.may_propose_next(list(tokens))
        view.check()


def test_ngram_index_long_repetitive_context():
    """Thousands of tokens with many repeats, queried at every length (and a list that got
    shorter is indexed afresh)."""
    rng = random.Random(7)
    tokens: list[int] = []
    proposer = NgramProposer(2, 4)
    view = proposer.track(tokens)
    for _ in range(1500):
        tokens.append(rng.choice([rng.randrange(6), rng.randrange(50)]))
        if len(tokens) % 7 == 0:
            assert proposer.propose(view, 5) == ngram_lookup(tokens, 2, 4, 5)
        assert proposer.may_propose_next(view) == (tokens[-1] in tokens[:-1])
    view.check()
    del tokens[700:]
    assert proposer.propose(view, 5) == ngram_lookup(tokens, 2, 4, 5)
    view.check()
    # far behind (a long prompt never advanced): exact answers from the list meanwhile
    tokens += [rng.randrange(40) for _ in range(3000)]
    for _ in range(6):
        assert proposer.propose(view, 5) == ngram_lookup(tokens, 2, 4, 5)
        assert proposer.may_propose_next(view) == (tokens[-1] in tokens[:-1])
        view.check()
        tokens.append(rng.randrange(40))
    assert view._done == len(tokens) - 1  # caught up CATCH_UP_MAX tokens per lookup


def fill(cache: RadixCache, tokens: list[int]) -> None:
    blocks = cache.allocator.allocate(-(-len(tokens) // cache.block_size))
    cache.insert(tokens, blocks)
    cache.allocator.decref(blocks)


def test_peek_continuation_follows_the_most_recent_branch():
    cache = RadixCache(BlockAllocator(64), 4)
    fill(cache, [1, 2, 3, 4, 5, 6])
    fill(cache, [1, 2, 3, 7, 8])
    assert cache.peek_continuation([1, 2], 10) == [3, 7, 8]  # inserted last
    cache.match([1, 2, 3, 4])  # refreshes the first branch
    assert cache.peek_continuation([1, 2], 10) == [3, 4, 5, 6]
    assert cache.peek_continuation([1, 2, 3, 4], 1) == [5]
    assert cache.peek_continuation([1, 2, 3, 7, 8], 3) == []  # nothing cached after it
    assert cache.peek_continuation([1, 2, 9], 3) == []  # not all of the query is cached
    assert cache.peek_continuation([1, 2, 3, 4, 5, 6, 7], 3) == []
    assert cache.peek_continuation([], 3) == []
    assert cache.peek_continuation([1], 0) == []


def test_radix_may_propose_next():
    """The radix proposer's test for a row whose next token is unknown: some next token is
    followed by one to draft."""
    cache = RadixCache(BlockAllocator(64), 4)
    fill(cache, [1, 2, 3, 4, 5, 6])
    fill(cache, [1, 2, 3, 7, 8])
    proposer = RadixProposer(cache)
    for tokens in ([1], [1, 2], [1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 7], [1, 2, 3, 7, 8], [9]):
        some = any(proposer.propose(tokens + [t], 1) for t in range(10))
        assert proposer.may_propose_next(tokens) == some, tokens


def test_peek_continuation_is_read_only():
    """No split, no access-time refresh, no reference, no counter, no version change."""
    cache = RadixCache(BlockAllocator(64), 4)
    fill(cache, [1, 2, 3, 4, 5, 6])
    fill(cache, [1, 2, 3, 7, 8])
    before = (
        format_tree(cache),
        cache._clock,
        cache.version,
        vars(cache.stats).copy(),
        cache.held_refs(),
        list(cache.allocator.ref_counts),
        [n.id for n in cache._evictable],
    )
    for query in ([1], [1, 2], [1, 2, 3, 4, 5], [1, 2, 3, 7], [9]):
        cache.peek_continuation(query, 8)
    after = (
        format_tree(cache),
        cache._clock,
        cache.version,
        vars(cache.stats).copy(),
        cache.held_refs(),
        list(cache.allocator.ref_counts),
        [n.id for n in cache._evictable],
    )
    assert after == before
    cache.check_integrity()


ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "match", "peek"]), st.lists(st.integers(0, 2), max_size=9)
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(ops, st.sampled_from([1, 2, 4]), st.integers(1, 8))
def test_peek_continuation_matches_naive(operations, block_size, max_tokens):
    cache = RadixCache(BlockAllocator(512), block_size)
    naive = NaivePrefixCache(block_size)
    for kind, tokens in operations:
        if kind == "insert" and tokens:
            blocks = cache.allocator.allocate(-(-len(tokens) // block_size))
            cache.insert(tokens, blocks)
            naive.insert(tokens, blocks)
            cache.allocator.decref(blocks)
        elif kind == "match":
            cache.match(tokens)
            naive.match(tokens)
        else:
            want = naive.peek_continuation(tokens, max_tokens)
            assert cache.peek_continuation(tokens, max_tokens) == want, format_tree(cache)
    cache.check_integrity()


def request(tokens: list[int]) -> Request:
    return Request("r", len(tokens), list(tokens), SamplingParams(), 16)


def test_create_proposer_and_bad_configuration():
    cache = RadixCache(BlockAllocator(8), 4)
    assert create_proposer(SpeculativeConfig(), cache) is None
    ngram = create_proposer(SpeculativeConfig("ngram", 1, 3), cache)
    assert isinstance(ngram, NgramProposer)
    assert ngram.propose([1, 2, 1], 2) == [2, 1]
    assert isinstance(create_proposer(SpeculativeConfig("radix"), cache), RadixProposer)
    from radixrt.cache.none import NoCache

    with pytest.raises(ValueError, match="needs the radix prefix cache"):
        create_proposer(SpeculativeConfig("radix"), NoCache(4))
    with pytest.raises(ValueError, match="prefix_cache is 'blockhash'"):
        resolve_config("-", "cpu", speculative_method="radix", prefix_cache="blockhash")
    with pytest.raises(ValueError, match="speculative_method must be one of"):
        resolve_config("-", "cpu", speculative_method="medusa")
    with pytest.raises(ValueError, match="speculative_draft_model must be given"):
        resolve_config("-", "cpu", speculative_method="draft")
    with pytest.raises(ValueError, match="speculative_draft_model must be given"):
        resolve_config("-", "cpu", speculative_method="ngram", speculative_draft_model="/x")
    with pytest.raises(ValueError, match="tensor_parallel_size 1 only"):
        resolve_config(
            "-",
            "cpu",
            speculative_method="draft",
            speculative_draft_model="/x",
            tensor_parallel_size=2,
        )
    with pytest.raises(ValueError, match="ngram_min_n"):
        resolve_config("-", "cpu", speculative_method="ngram", ngram_min_n=3, ngram_max_n=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        resolve_config("-", "cpu", speculative_method="ngram", num_speculative_tokens=0)


# ---- the scheduler with real proposers over a scripted runner ----


def cyclic_token(rid: str, position: int) -> int:
    """A sequence that repeats with period 5 (n-gram drafts are right once it cycled)."""
    return 200 + (position + int(rid[1:])) % 5


def expected_cyclic(reqs, max_tokens):
    return {
        f"r{i}": ([cyclic_token(f"r{i}", len(p) + j) for j in range(m)], FinishReason.LENGTH)
        for i, (p, m) in enumerate(zip(reqs, max_tokens))
    }


SCRIPTED = [
    dict(),
    dict(max_num_batched_tokens=8),  # chunked prefill
    dict(num_kv_blocks=20, block_size=2),  # preemption
    dict(prefix_cache="none"),
]


@pytest.mark.parametrize("config", SCRIPTED, ids=[str(c) for c in SCRIPTED])
def test_scripted_ngram_equals_plain_decoding(config):
    reqs = [[9, 8, 7, 6, 5, 4, 3 + i] for i in range(5)]
    max_tokens = [6 + 5 * i for i in range(5)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs, stats = {}, {}
    for k in (0, 4):
        core, runner = make_core(overlap=False, num_speculative_tokens=max(k, 1), **config)
        runner.token_fn = cyclic_token
        if k:
            core.scheduler.use_proposer(NgramProposer(2, 4))
        outs[k] = run(core, reqs, params)
        stats[k] = core.stats()
    assert core.scheduler.speculation is not None
    assert not core.scheduler.speculation._indexes  # the n-gram indexes went with their requests
    assert outs[4] == outs[0] == expected_cyclic(reqs, max_tokens)
    s = stats[4]
    assert s["spec_proposals"] > s["spec_proposals_with_drafts"] > 0
    assert 0 < s["spec_accepted_tokens"] <= s["spec_draft_tokens"]
    assert s["spec_acceptance_rate"] > 0.8  # a cycle: drafts right once it repeated
    assert s["steps"] < stats[0]["steps"]
    assert s["spec_accepted_pos_0"] >= s.get("spec_accepted_pos_3", 0)
    assert stats[0]["spec_proposals"] == 0


def test_scripted_radix_drafts_a_rerun_program():
    """The second run of the same prompts finds every answer in the tree: the radix proposer
    fires on every decode row and every draft is accepted; the first run never drafts."""
    reqs = [[50 + i, 60, 61, 62, 63, 64] for i in range(4)]
    params = [SamplingParams(max_tokens=9, ignore_eos=True)] * 4
    core, _ = make_core(overlap=False, num_speculative_tokens=4)
    core.scheduler.use_proposer(RadixProposer(core.cache))
    first = run(core, reqs, params)
    s1 = core.stats()
    assert s1["spec_proposals"] > 0 and s1["spec_proposals_with_drafts"] == 0
    second = run(core, reqs, params)
    assert second == first
    s2 = core.stats()
    fired = s2["spec_proposals_with_drafts"]
    assert fired == s2["spec_proposals"] - s1["spec_proposals"] > 0
    assert s2["spec_acceptance_rate"] == 1.0
    # 9 tokens: the first from the prefill, then drafts of up to 4 (the last cached output
    # token has no KV, so the tree holds 8 of the 9)
    assert s2["steps"] - s1["steps"] < s1["steps"] / 2


def test_scripted_always_wrong_drafts_roll_back():
    """Drafts that are always rejected: outputs unchanged, every row rolls back its blocks."""

    class Wrong(Proposer):
        def propose(self, tokens, max_drafts, salt=None):
            return [1] * max_drafts

    reqs = [[9, 8, 7, 6, 5, 4, 3 + i] for i in range(4)]
    params = [SamplingParams(max_tokens=7, ignore_eos=True)] * 4
    core, _ = make_core(overlap=False, block_size=2, num_kv_blocks=24)
    core.scheduler.use_proposer(Wrong())
    plain, _ = make_core(overlap=False, block_size=2, num_kv_blocks=24)
    assert run(core, reqs, params) == run(plain, reqs, params)
    s = core.stats()
    assert s["spec_draft_tokens"] > 0 and s["spec_accepted_tokens"] == 0
    assert s["spec_mean_acceptance_length"] == 1.0


def test_scripted_stop_inside_an_accepted_run():
    """EOS inside the accepted drafts: the request stops at it; the rest is dropped."""
    from test_step_plan import EOS

    def token_fn(rid, position):
        return EOS if position == 14 else 200 + position % 3

    outs = {}
    for spec in (False, True):
        core, runner = make_core(overlap=False)
        runner.token_fn = token_fn
        if spec:
            core.scheduler.use_proposer(NgramProposer(1, 3))
        outs[spec] = run(core, [[9, 8, 7, 6]], [SamplingParams(max_tokens=20)])
    assert outs[True] == outs[False]
    assert outs[True]["r0"][1] is FinishReason.STOP and outs[True]["r0"][0][-1] == EOS


def test_drafts_stay_within_the_token_budget():
    """Drafts only use what the step's token budget leaves after the decode rows."""
    reqs = [[9, 8, 7, 6, 5, 4, 3 + i] for i in range(5)]
    params = [SamplingParams(max_tokens=20, ignore_eos=True)] * 5
    core, runner = make_core(overlap=False, max_num_batched_tokens=8, num_speculative_tokens=4)
    runner.token_fn = cyclic_token
    core.scheduler.use_proposer(NgramProposer(1, 4))
    plans = []
    execute = runner.execute
    runner.execute = lambda plan: (plans.append(plan), execute(plan))[1]
    assert run(core, reqs, params) == expected_cyclic(reqs, [20] * 5)
    assert all(p.num_tokens <= 8 for p in plans)
    assert any(r.num_draft_tokens for p in plans for r in p.rows)


def test_spec_stats_count_what_they_say():
    from radixrt.speculative import SpecStats

    s = SpecStats()
    assert s.acceptance_rate == s.mean_acceptance_length == s.fire_rate == 0.0
    for drafts, accepted in [(4, 4), (4, 1), (2, 0), (3, 2)]:
        s.record_verify(drafts, accepted)
    assert (s.num_verify_rows, s.num_draft_tokens, s.num_accepted_tokens) == (4, 13, 7)
    assert s.accepted_per_position == [3, 2, 1, 1]  # rows whose draft i was accepted
    assert s.drafted_per_position == [4, 4, 3, 2]  # rows that had a draft i
    assert [s.acceptance_rate_at(i) for i in range(5)] == [3 / 4, 2 / 4, 1 / 3, 1 / 2, 0.0]
    assert s.acceptance_rate == 7 / 13
    assert s.mean_acceptance_length == 1 + 7 / 4  # accepted + the bonus token, per row


class HalfRight(Proposer):
    """The true next two tokens (cyclic_token), then garbage: every row rolls back. The
    prompts are [9, 8, 7, 6, 5, 4, 3 + i] for rid f"r{i}"."""

    def propose(self, tokens, max_drafts, salt=None):
        n = len(tokens)
        rid = f"r{tokens[6] - 3}"
        true = [cyclic_token(rid, n + i) for i in range(max_drafts)]
        return true[:2] + [1] * (max_drafts - 2)


def test_rollback_keeps_exact_block_counts_under_preemption():
    """After every step each running request holds exactly the blocks of its computed KV
    (rejected drafts' blocks are freed in the same step), with preemption mid-draft."""
    reqs = [[9, 8, 7, 6, 5, 4, 3 + i] for i in range(6)]
    params = [SamplingParams(max_tokens=14, ignore_eos=True)] * 6
    core, runner = make_core(overlap=False, block_size=2, num_kv_blocks=30)
    runner.token_fn = cyclic_token
    core.scheduler.use_proposer(HalfRight())
    for i, (p, sp) in enumerate(zip(reqs, params)):
        core.add_request(p, sp, rid=f"r{i}")
    out: dict[str, list[int]] = {}
    while core.has_work:
        for d in core.step():
            out.setdefault(d.rid, []).extend(d.new_token_ids)
        for req in core.scheduler.running:
            assert len(req.block_table) == -(-req.num_computed // 2), req.rid
        core.check_integrity()
    assert out == {r: toks for r, (toks, _) in expected_cyclic(reqs, [14] * 6).items()}
    s = core.stats()
    assert s["preemptions"] > 0 and 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"]


def test_abort_while_a_verify_step_is_in_flight():
    core, runner = make_core(overlap=True, block_size=2)
    runner.token_fn = cyclic_token
    core.scheduler.use_proposer(HalfRight())
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    rids = [core.add_request([9, 8, 7, 6, 5, 4, 3 + i], params, rid=f"r{i}") for i in range(4)]
    for _ in range(6):
        core.step()
    assert core.scheduler.num_inflight_steps == 1
    assert core.stats()["spec_verify_rows"] > 0
    for rid in rids[::2]:
        core.abort(rid)
    core.check_integrity()
    while core.has_work:
        for d in core.step():
            assert d.rid not in rids[::2]
    core.check_integrity()
    assert core.allocator.num_free + core.cache.cached_blocks == core.allocator.num_blocks


def test_cli_flags_reach_the_config():
    import argparse

    from radixrt.cli import _engine_args, engine_options

    p = argparse.ArgumentParser()
    _engine_args(p)
    args = p.parse_args(
        ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--ngram-max-n", "5"]
    )
    cfg = resolve_config("-", **{**engine_options(args), "device": "cpu"})
    assert cfg.speculative == SpeculativeConfig("ngram", 2, 5)
    assert cfg.scheduler.num_speculative_tokens == 3
    with pytest.raises(SystemExit):
        p.parse_args(["--speculative-method", "medusa"])
    args = p.parse_args(["--speculative-method", "draft", "--speculative-draft-model", "/d"])
    cfg = resolve_config("-", **{**engine_options(args), "device": "cpu"})
    assert cfg.speculative.speculative_draft_model == "/d"


# ---- overlap: rows draft where a synchronous loop drafts, and rows that do not draft overlap ----

PATTERN = [100 + 37 * i % 997 for i in range(16)]


def noisy_pattern(rid: str, position: int) -> int:
    """A 16-token pattern with a token never seen before at every 6th position: drafts
    start again a few tokens after each divergence."""
    row = int(rid[1:])
    return 1200 + 4 * position + row if position % 6 == 0 else PATTERN[(position + row) % 16]


def unique_tokens(rid: str, position: int) -> int:
    """No token repeats within a row: the ngram proposer never drafts."""
    return 100 + 4 * position + int(rid[1:])


def decode_steps(overlap: bool, token_fn, num_rows: int, steps: int):
    """`steps` loop steps after the prompts (ngram drafts): (what they generated, drafted
    and accepted, whether every result of those steps was taken only after the next plan was
    made)."""
    out, _, waits = spec_run(NgramProposer(2, 4), token_fn, num_rows, steps, overlap=overlap)
    keys = ("generated_tokens", "spec_verify_rows", "spec_draft_tokens", "spec_accepted_tokens")
    return {k: out[k] for k in keys}, waits == 0


@pytest.mark.parametrize("num_rows", [1, 3])
def test_overlap_drafts_where_a_synchronous_loop_does(num_rows):
    """A row whose sample is in flight drafts once the loop has its result whenever the exact
    context drafts: with overlap on, tokens per step, verify rows and acceptance equal the
    synchronous loop's (a row used to be planned without drafts whenever the context one
    token short proposed nothing, losing the first verify after each divergence)."""
    sync, _ = decode_steps(False, noisy_pattern, num_rows, 30)
    overlapped, _ = decode_steps(True, noisy_pattern, num_rows, 30)
    assert sync["spec_accepted_tokens"] > 0
    assert overlapped == sync  # tokens per step, drafts, acceptance


def test_rows_that_cannot_draft_overlap():
    """Rows that no next token could make draft never make the loop wait for a result."""
    out, overlapped = decode_steps(True, unique_tokens, 4, 20)
    assert out["generated_tokens"] == 4 * 20 and out["spec_verify_rows"] == 0
    assert overlapped


class WrongDrafts(Proposer):
    """Proposes k drafts for every row, never right (`Proposer.may_propose_next` by default:
    the loop takes every row as one that may draft)."""

    def propose(self, tokens, max_drafts, salt=None):
        return [1] * max_drafts


def spec_run(proposer, token_fn, num_rows: int, steps: int, graph_tokens=0, overlap=True, **sched):
    """`decode_steps` with any proposer, scheduler settings and decode graph size (the
    runner's `max_graph_tokens`); also the plans' draft tokens and the steps whose result
    the loop waited for."""
    core, runner = make_core(overlap=overlap, num_kv_blocks=512, num_speculative_tokens=4, **sched)
    core.scheduler.max_graph_tokens = graph_tokens
    core.scheduler.use_proposer(proposer)
    runner.token_fn = token_fn
    drafted = []  # per plan: its draft tokens
    execute = runner.execute

    def recording(plan):
        drafted.append(sum(len(d) for d in plan.drafts.values()))
        return execute(plan)

    runner.execute = recording
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    for i in range(num_rows):
        core.add_request([token_fn(f"r{i}", p) for p in range(48)], params, rid=f"r{i}")
    while any(r.num_output < 2 for r in core.scheduler.requests.values()):
        core.step()
    before, first_plan = core.stats(), len(drafted)
    runner.events.clear()
    for _ in range(steps):
        core.step()
    after, waits = core.stats(), runner.num_waits()
    for rid in list(core.scheduler.requests):
        core.abort(rid)
    while core.has_work:
        core.step()
    core.check_integrity()
    assert not core.scheduler.speculation._estimates  # they went with their requests
    keys = ("generated_tokens", "spec_verify_rows", "spec_proposals_with_drafts",
            "spec_proposals_skipped", "spec_draft_tokens", "spec_accepted_tokens",
            "steps")  # fmt: skip
    return {k: after[k] - before[k] for k in keys}, drafted[first_plan:], waits


def test_rows_whose_drafts_fail_stop_verifying():
    """Drafts that are never accepted: after a few verify steps the rows' expected gain
    falls below speculative_min_gain per row and the steps stop verifying (and overlap);
    STALE_TOKENS later the rows are tried again; with speculative_min_gain = 0 (or without
    overlap) every drafted row verifies, as before the rule."""
    from radixrt.scheduler.speculation import STALE_TOKENS

    steps = STALE_TOKENS + 20
    gated, drafted, waits = spec_run(WrongDrafts(), unique_tokens, 8, steps)
    assert gated["spec_accepted_tokens"] == 0
    # 3 verifies take the prior (2) to 0.25 < 0.3 per row: verify steps at the start (partly
    # before the counted steps), again STALE_TOKENS later; the other steps overlap
    verify_plans = [i for i, n in enumerate(drafted) if n]
    assert verify_plans[0] < 3 and STALE_TOKENS - 8 < verify_plans[-1] < steps
    assert len(verify_plans) <= 6 and gated["spec_verify_rows"] <= 8 * 6
    assert gated["generated_tokens"] >= 8 * (steps - 6) and waits <= 6
    always, _, _ = spec_run(WrongDrafts(), unique_tokens, 8, 120, speculative_min_gain=0.0)
    assert always["spec_proposals_skipped"] == 0
    assert always["spec_verify_rows"] == always["spec_proposals_with_drafts"]
    assert always["spec_verify_rows"] >= 8 * 119  # every step verifies (and waits)


def test_rows_whose_drafts_are_accepted_keep_verifying():
    """A repeating text: drafts accepted, every proposal verified, more than a token a row a
    step, the same with the rule off."""
    gated, _, _ = spec_run(NgramProposer(2, 4), cyclic_token, 8, 30)
    always, _, _ = spec_run(NgramProposer(2, 4), cyclic_token, 8, 30, speculative_min_gain=0.0)
    assert gated["spec_proposals_skipped"] == 0
    assert gated == always
    assert gated["generated_tokens"] > 2 * 8 * 30


def test_drafts_stay_within_the_decode_graphs():
    """With a runner whose largest decode graph takes 11 tokens, no step of 6 rows has more
    than 5 draft tokens (a longer step would run eagerly), nor any step more than 11 tokens;
    rows left out count as skipped."""
    core, runner = make_core(overlap=False, num_kv_blocks=512, num_speculative_tokens=4)
    core.scheduler.max_graph_tokens = 6 + 5
    core.scheduler.use_proposer(NgramProposer(2, 4))
    runner.token_fn = cyclic_token
    drafted = []
    execute = runner.execute
    runner.execute = lambda plan: (drafted.append(plan), execute(plan))[1]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    reqs = [[9, 8, 7, 6, 5, 4, 3 + i] for i in range(6)]
    plain, _ = make_core(overlap=False, num_kv_blocks=512)
    plain.runner.token_fn = cyclic_token
    assert run(core, reqs, [params] * 6) == run(plain, reqs, [params] * 6)
    verify = [p for p in drafted if p.drafts]
    assert max(sum(r.num_tokens for r in p.rows) for p in verify) == 11
    assert max(sum(len(d) for d in p.drafts.values()) for p in verify if len(p.rows) == 6) == 5
    s = core.stats()
    assert s["spec_accepted_tokens"] > 0 and s["spec_proposals_skipped"] > 0
    # graphs as large as the batch: no room for drafts, so the loop never waits for them
    full, _, waits = spec_run(NgramProposer(2, 4), cyclic_token, 8, 30, graph_tokens=8)
    assert full["spec_verify_rows"] == 0 and waits == 0


def test_choose_ranks_rows_by_expected_gain():
    """`choose`: rows with the most expected accepted drafts first, within the spare budget;
    nothing when the total falls short of min_gain per decode row; a stale estimate counts
    as the prior."""
    from radixrt.config import SchedulerConfig
    from radixrt.scheduler.speculation import STALE_TOKENS, SpeculationFeature, _Estimate
    from radixrt.speculative.base import SpecStats

    cfg = SchedulerConfig(num_speculative_tokens=4, speculative_min_gain=0.5)
    spec = SpeculationFeature(NgramProposer(2, 4), cfg, SpecStats(), 1000, Hooks(), overlap=True)
    a, b, c = (request([1, 2, 3]) for _ in range(3))
    spec._estimates[a] = _Estimate(3.5, 0, 1.0, 0)
    spec._estimates[b] = _Estimate(0.25, 0, 1.0, 0)  # c: the prior, 2
    proposals = [(a, [5] * 4), (b, [6] * 4), (c, [7] * 4)]
    chosen = spec.choose(proposals, num_rows=4, spare=6)
    assert chosen == {a: [5] * 4, c: [7] * 2}  # a, then c within the 6 spare tokens
    # b expects 0.25 and c 1 of its 1 draft: 1.25 < 0.5 * 4 rows
    assert spec.choose([(b, [6]), (c, [7])], num_rows=4, spare=8) == {}
    assert spec.stats.num_proposals_skipped == 1 + 2
    b.seq_token_ids += [0] * STALE_TOKENS  # b's estimate is stale now: the prior again
    assert spec.choose([(b, [6]), (c, [7])], num_rows=4, spare=8) == {b: [6], c: [7]}
    spec.overlap = False  # every step waits anyway: all verify
    assert spec.choose([(b, [6]), (c, [7])], num_rows=40, spare=8) == {b: [6], c: [7]}


def alternating(rid: str, position: int) -> int:
    """Every other token the same (it recurs, so `may_propose_next` is true while the next
    is in flight), the others never seen before (so no 2-gram ever repeats: no drafts)."""
    return 7 if position % 2 == 0 else 1000 + 8 * position + int(rid[1:])


def test_rows_that_may_draft_but_do_not_stop_the_waits():
    """Rows whose proposer could draft after the in-flight token (`may_propose_next`) but
    then does not: the loop waits a few times, learns that these rows do not draft and
    overlaps again (until the estimate is stale); without the rule it waits every other step."""
    from radixrt.scheduler.speculation import STALE_TOKENS

    steps = STALE_TOKENS + 30
    gated, _, waits = spec_run(NgramProposer(2, 4), alternating, 8, steps)
    assert gated["spec_proposals_with_drafts"] == 0
    assert gated["generated_tokens"] == 8 * steps
    assert 2 <= waits <= 10
    always, _, waits = spec_run(NgramProposer(2, 4), alternating, 8, steps, speculative_min_gain=0)
    assert waits >= steps // 2 - 1
