"""The SDPA backend (attention_backend="torch") against the exact reference ("torch-reference").

Random mixed batches on CPU: decode rows over cached contexts, extend rows from scratch or on a
cached prefix (single-token chunks included), an empty decode or extend part; blocks scattered
over the pool; block sizes 1/4/16, GQA ratios 1/2/4 and 3/7 (decode queries padded to 4/8),
float32 and bfloat16. Small plan limits
force query chunking and many groups; the plan's memory bounds are checked on a large batch.
"""

from __future__ import annotations

import pytest
import torch

from radixrt.attention.forward_batch import ForwardBatch, reference_batch
from radixrt.attention.sdpa_backend import SdpaAttentionBackend
from radixrt.attention.sdpa_plan import DEFAULT_LIMITS, PlanLimits, plan_attention
from radixrt.attention.torch_backend import TorchAttentionBackend
from radixrt.kv.pool import KVPool

HEAD_DIM, NUM_LAYERS = 16, 2


def make_batch(
    rows: list[tuple[int, int]], num_decode: int, block_size: int, gen: torch.Generator
) -> tuple[ForwardBatch, int]:
    """CPU ForwardBatch for rows [(num_cached, num_new)], decode rows first; each row's blocks
    are drawn at random from the pool. Returns (batch, pool blocks needed)."""
    cached = torch.tensor([c for c, _ in rows], dtype=torch.int32)
    new = torch.tensor([n for _, n in rows], dtype=torch.int32)
    seq_lens = cached + new
    nblocks = (seq_lens + block_size - 1) // block_size
    num_blocks = int(nblocks.sum()) + 3
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(rows), int(nblocks.max()), dtype=torch.int32)
    used = 0
    for r, nb in enumerate(nblocks.tolist()):
        table[r, :nb] = perm[used : used + nb]
        used += nb
    batch = reference_batch(table, cached, new, num_decode, block_size)
    return batch, num_blocks


def random_rows(kind: str, gen: torch.Generator) -> tuple[list[tuple[int, int]], int]:
    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    num_decode = randint(1, 9) if kind in ("decode", "mixed") else 0
    num_extend = randint(1, 5) if kind in ("extend", "mixed") else 0
    rows = [(randint(1, 300), 1) for _ in range(num_decode)]
    # extend rows: from scratch, on a cached prefix, and one-token chunks
    rows += [(randint(0, 1) * randint(1, 200), randint(1, 120)) for _ in range(num_extend)]
    if kind in ("extend", "mixed"):
        rows += [(randint(1, 50), 1), (0, 1)]
    return rows, num_decode


def run_both(
    rows: list[tuple[int, int]],
    num_decode: int,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    limits: PlanLimits = DEFAULT_LIMITS,
    native: int | None = None,
    native_extend: bool = False,
) -> None:
    """Every layer: the SDPA backend's output equals the reference's on the same pool
    (`native`: decode rows and extend rows of at most that many (query, key) pairs through
    the native decode kernel; with `native_extend` every extend row through the extend
    kernel instead)."""
    batch, num_blocks = make_batch(rows, num_decode, block_size, gen)
    pool = KVPool(NUM_LAYERS, num_blocks, block_size, num_kv_heads, HEAD_DIM, dtype, "cpu")
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen))  # stale cached context
    ref = TorchAttentionBackend(num_heads, num_kv_heads, HEAD_DIM)
    fast = SdpaAttentionBackend(
        num_heads,
        num_kv_heads,
        HEAD_DIM,
        limits,
        native_decode=native is not None,
        native_max_extend_pairs=native or 0,
        native_extend=native_extend,
    )
    ref.prepare(batch)
    fast.prepare(batch)
    t = batch.num_tokens
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for layer in range(NUM_LAYERS):
        q = torch.randn(t, num_heads, HEAD_DIM, generator=gen).to(dtype)
        k = torch.randn(t, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(t, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        expected = ref.forward(layer, q, k, v, pool)
        out = fast.forward(layer, q, k, v, pool)
        assert out.shape == q.shape and out.dtype == dtype
        torch.testing.assert_close(out, expected, **tol)


@pytest.mark.parametrize("kind", ["decode", "extend", "mixed"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2), (6, 2), (14, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_matches_reference(kind, block_size, heads, dtype):
    seed = ["decode", "extend", "mixed"].index(kind) * 100 + block_size * 10 + heads[1]
    gen = torch.Generator().manual_seed(seed)
    rows, num_decode = random_rows(kind, gen)
    run_both(rows, num_decode, block_size, *heads, dtype, gen)


@pytest.mark.parametrize("kind", ["decode", "mixed", "extend"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 2), (14, 2)])
@pytest.mark.parametrize("max_extend", [0, 2000, 10**6, "extend kernel"])
def test_native_rows_match_reference(kind, block_size, heads, max_extend, native_kernel):
    """Decode rows (and extend rows of <= max_extend (query, key) pairs: none, some, all)
    through the native decode kernel, the other rows through the groups; or every extend row
    through the extend kernel."""
    ext = max_extend == "extend kernel"
    max_extend = 0 if ext else max_extend
    seed = 7 + ["decode", "mixed", "extend"].index(kind) * 100 + block_size * 10 + heads[0]
    gen = torch.Generator().manual_seed(seed + max_extend + ext)
    rows, num_decode = random_rows(kind, gen)
    run_both(
        rows, num_decode, block_size, *heads, torch.float32, gen, native=max_extend,
        native_extend=ext,
    )  # fmt: skip


def test_native_plan_splits_rows(native_kernel):
    gen = torch.Generator().manual_seed(3)
    rows = [(100, 1), (5, 1), (0, 40), (64, 9)]  # tokens 0, 1 | 2..41 | 42..50
    # pairs of the extend rows: 40 * 41 / 2 = 820 (> 700), 9 * 64 + 9 * 10 / 2 = 621
    batch, _ = make_batch(rows, 2, 4, gen)
    fast = SdpaAttentionBackend(
        8, 2, HEAD_DIM, native_decode=True, native_max_extend_pairs=700, native_extend=False
    )
    fast.prepare(batch)
    plan = fast.native_plan
    assert plan.rows.tolist() == [True, True, False, True]
    assert plan.token_index.tolist() == [0, 1, *range(42, 51)]
    assert plan.kv_len.tolist() == [101, 6, *range(65, 74)]  # causal within the extend row
    covered = torch.cat([g.out_index for g in fast.groups])
    assert sorted(covered[covered < batch.num_tokens].tolist()) == list(range(2, 42))
    assert [g.causal for g in fast.groups] == [True]  # the fresh row (0 cached, 40 new)
    fast = SdpaAttentionBackend(
        8, 2, HEAD_DIM, native_decode=True, native_max_extend_pairs=0, native_extend=False
    )
    fast.prepare(batch)
    assert fast.native_plan.token_index is None and fast.native_plan.num_queries == 2
    # with the extend kernel: decode rows through the decode kernel, every extend row through
    # the extend kernel, no groups
    fast = SdpaAttentionBackend(8, 2, HEAD_DIM, native_decode=True)
    fast.prepare(batch)
    plan = fast.native_plan
    assert plan.rows.all() and not fast.groups and not fast.prefix_groups
    assert plan.num_queries == 2 and plan.token_index is None
    assert plan.kv_len.tolist() == [101, 6]
    ext = plan.extend
    assert ext.q_start.tolist() == [2, 42] and ext.q_len.tolist() == [40, 9]
    assert ext.kv_len.tolist() == [40, 73] and ext.num_pairs == 820 + 621


@pytest.mark.parametrize("seed", range(4))
def test_sdpa_matches_reference_small_limits(seed):
    """Tiny chunks and budgets: many groups, rows cut into many query chunks."""
    gen = torch.Generator().manual_seed(seed)
    rows, num_decode = random_rows("mixed", gen)
    limits = DEFAULT_LIMITS._replace(
        q_chunk=7, max_group_kv_elements=2000, max_group_score_elements=20000
    )
    run_both(rows, num_decode, 4, 8, 2, torch.float32, gen, limits)


def test_plan_covers_every_token_once():
    gen = torch.Generator().manual_seed(0)
    rows = [(100, 1), (5, 1), (300, 1), (0, 40), (64, 1), (17, 300)]
    batch, _ = make_batch(rows, 3, 4, gen)
    limits = DEFAULT_LIMITS._replace(
        q_chunk=16, max_group_kv_elements=1 << 20, max_group_score_elements=1 << 20
    )
    groups = plan_attention(batch, 8, 2 * HEAD_DIM, limits)
    out = torch.cat([g.out_index for g in groups])
    real = out[out < batch.num_tokens]
    assert sorted(real.tolist()) == list(range(batch.num_tokens))
    assert all(g.q_len <= 16 for g in groups)
    decode_groups = [g for g in groups if g.q_len == 1 and g.out_index.max() < 3]
    assert sum(g.num_pieces for g in decode_groups) == 3  # decode rows grouped apart
    for g in groups:  # token_range: the queries are those tokens, in order, unpadded
        if g.token_range is not None:
            first, stop = g.token_range
            assert g.q_index.tolist() == list(range(first, stop))
            assert g.out_index.tolist() == list(range(first, stop))


def test_equal_fresh_rows_are_one_in_place_causal_group():
    """A batch of fresh prompts of one length (a benchmark's prefill): one causal group whose
    queries are the step's tokens in order (no gather of q, no scatter of results)."""
    gen = torch.Generator().manual_seed(2)
    rows = [(0, 24)] * 5
    batch, _ = make_batch(rows, 0, 4, gen)
    groups = plan_attention(batch, 8, 2 * HEAD_DIM, DEFAULT_LIMITS)
    assert len(groups) == 1 and groups[0].token_range == (0, 120) and groups[0].causal
    run_both(rows, 0, 4, 8, 2, torch.float32, gen)
    run_both(rows + [(30, 1)], 0, 4, 8, 2, torch.float32, gen)  # + a row that is not in it


def test_decode_only_step_is_one_in_order_group():
    """Decode rows of different lengths (the plan sorts by length to pack): one group, rows
    in order, so the backend reads q in place and returns the SDPA result as it is."""
    gen = torch.Generator().manual_seed(1)
    rows = [(300, 1), (5, 1), (120, 1), (64, 1), (250, 1)]
    batch, _ = make_batch(rows, 5, 16, gen)
    groups = plan_attention(batch, 8, 2 * HEAD_DIM, DEFAULT_LIMITS)
    assert len(groups) == 1 and groups[0].token_range == (0, 5)
    run_both(rows, 5, 16, 8, 2, torch.float32, gen)


def test_plan_memory_is_bounded():
    """One 4k-token prefill plus 200 decode rows at 4k context (Llama-8B heads): each group's
    gathered KV and scores stay within the limits, the masks stay under 64 MiB."""
    rows = [(4096, 1)] * 200 + [(0, 4096)]
    gen = torch.Generator().manual_seed(0)
    batch, _ = make_batch(rows, 200, 16, gen)
    num_heads, kv_elements = 32, 8 * 128
    groups = plan_attention(batch, num_heads, kv_elements, DEFAULT_LIMITS)
    for g in groups:
        n = g.num_pieces
        if n > 1:
            assert n * g.kv_len * kv_elements <= DEFAULT_LIMITS.max_group_kv_elements
            assert n * num_heads * g.q_len * g.kv_len <= DEFAULT_LIMITS.max_group_score_elements
    # bool masks (the plan) + float32 biases (made by forward): 5 bytes a mask element
    assert 5 * sum(g.mask.numel() for g in groups) < 64 << 20
    # 3 decode rows of 4112 padded keys per 2^24-element group; query chunks of <= 256
    assert sum(g.q_len == 1 for g in groups) == -(-200 // 3)
    assert all(g.q_len <= DEFAULT_LIMITS.q_chunk for g in groups) and len(groups) < 90


def test_engine_default_is_sdpa_and_matches_reference(make_engine):
    """On CPU "torch" (the default) builds the SDPA backend; greedy tokens equal the
    reference backend's on prompts sharing a prefix (cached-prefix extend rows + decode)."""
    from radixrt import SamplingParams

    fast = make_engine()
    ref = make_engine(attention_backend="torch-reference")
    assert isinstance(fast.core.runner.backend, SdpaAttentionBackend)
    assert isinstance(ref.core.runner.backend, TorchAttentionBackend)
    base = "The quick brown fox jumps over the lazy dog. " * 3
    prompts = [base + tail for tail in ("Then", "And so", "A", "Once upon a time")]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for engine in (fast, ref):  # warm the prefix cache: later prompts extend a cached prefix
        engine.generate(prompts[:1], sampling_params=params)
    outs = [e.generate(prompts, sampling_params=params) for e in (fast, ref)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert fast.stats()["cache_hit_rate"] > 0
