"""Shared-prefix (cascade) decode attention of the SDPA backend against the exact reference.

Decode rows whose block tables start with the same blocks (as the radix cache shares them):
families of rows on a common prompt, nested families (a tree of prefixes), a first block shared
by every row (a chat template), rows shorter than their family's prefix, extend rows in the
same step; block sizes 1/4/16, GQA ratios 1/3/4, float32 and bfloat16, an fp8 pool.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixrt.attention.forward_batch import ForwardBatch, reference_batch
from radixrt.attention.sdpa_backend import SdpaAttentionBackend
from radixrt.attention.sdpa_prefix import merge_partial, plan_shared_prefixes
from radixrt.attention.torch_backend import TorchAttentionBackend
from radixrt.kv.pool import KVPool

HEAD_DIM = 16


def make_batch(
    decode: list[tuple[list[int], int]],
    extend: list[tuple[list[int], int, int]],
    bs: int,
    seed: int,
) -> tuple[ForwardBatch, int]:
    """Decode rows [(shared leading blocks, own context tokens after them)] then extend rows
    [(shared leading blocks, own cached tokens after them, new tokens)]; own blocks are fresh
    pool blocks. Returns (batch, pool blocks)."""
    gen = torch.Generator().manual_seed(seed)
    next_block = 1 + max((b for shared, _ in decode for b in shared), default=0)
    tables, cached, new = [], [], []
    for shared, own in decode:
        ctx = len(shared) * bs + own  # the decode token is the last of `own`
        nb = -(-ctx // bs)
        tables.append(shared + list(range(next_block, next_block + nb - len(shared))))
        next_block += nb - len(shared)
        cached.append(ctx - 1)
        new.append(1)
    for shared, own, n in extend:
        c = len(shared) * bs + own
        nb = -(-(c + n) // bs)
        tables.append(shared + list(range(next_block, next_block + nb - len(shared))))
        next_block += nb - len(shared)
        cached.append(c)
        new.append(n)
    num_blocks = next_block + 2
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)  # scatter over the pool
    width = max(len(t) for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for r, t in enumerate(tables):
        table[r, : len(t)] = perm[torch.tensor(t, dtype=torch.int64)]
    cached_t = torch.tensor(cached, dtype=torch.int32)
    new_t = torch.tensor(new, dtype=torch.int32)
    batch = reference_batch(table, cached_t, new_t, len(decode), bs)
    return batch, num_blocks


def tree_rows(bs: int) -> list[tuple[list[int], int]]:
    """Every row on block 0 (a template); families A (blocks 1..12) and B (20..29), A's rows
    split further after block 8; a row shorter than its family's prefix; a lone row."""
    a, b = [0] + list(range(1, 13)), [0] + list(range(20, 30))
    return [
        (a, 5),
        (a[:9] + [40, 41], bs),
        (b, 1),
        (a, bs + 3),
        ([0], 7),
        (b[:4], 2),
        (b, 2 * bs),
        (a[:9] + [40, 41], 3),
        (a[:9], bs - 1 if bs > 1 else 1),
    ]


def run_both(
    batch,
    num_blocks,
    num_heads,
    num_kv_heads,
    dtype,
    seed,
    expect_groups=True,
    native=None,
    native_extend=False,
):
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(2, num_blocks, batch.block_size, num_kv_heads, HEAD_DIM, dtype, "cpu")
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen))
    ref = TorchAttentionBackend(num_heads, num_kv_heads, HEAD_DIM)
    fast = SdpaAttentionBackend(
        num_heads,
        num_kv_heads,
        HEAD_DIM,
        prefix_min_saved_keys=0,
        native_decode=native is not None,
        native_max_extend_pairs=native or 0,
        native_extend=native_extend,
    )
    ref.prepare(batch)
    fast.prepare(batch)
    assert bool(fast.prefix_groups) == expect_groups
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    t = batch.num_tokens
    for layer in range(2):
        q = torch.randn(t, num_heads, HEAD_DIM, generator=gen).to(dtype)
        k = torch.randn(t, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(t, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        expected = ref.forward(layer, q, k, v, pool)
        out = fast.forward(layer, q, k, v, pool)
        assert out.shape == q.shape and out.dtype == dtype
        torch.testing.assert_close(out, expected, **tol)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_extend", [False, True])
def test_shared_prefix_matches_reference(block_size, heads, dtype, with_extend):
    a, b = [0] + list(range(1, 13)), [0] + list(range(20, 30))
    # from scratch, on fresh blocks, on A's prefix (+ own cached tokens), on B's, on A's part
    extend = [([], 0, 9), ([], 3 * block_size, 5), (a, 2, 7), (b, 0, 1), (a[:10], block_size, 3)]
    extend = extend if with_extend else []
    batch, num_blocks = make_batch(tree_rows(block_size), extend, block_size, seed=block_size)
    run_both(batch, num_blocks, *heads, dtype, seed=heads[0])


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_shared_prefix_with_native_rows(block_size, native_kernel):
    """Decode rows and the smallest extends through the native kernel; the larger extend rows
    on A's prefix still form a prefix group."""
    a, b = [0] + list(range(1, 13)), [0] + list(range(20, 30))
    extend = [([], 0, 9), (a, 2, 7), (b, 0, 1), (a[:10], block_size, 3), (a, 0, 2)]
    batch, num_blocks = make_batch(tree_rows(block_size), extend, block_size, seed=block_size)
    run_both(batch, num_blocks, 8, 2, torch.float32, seed=5, native=12)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_shared_prefix_rows_through_the_extend_kernel(block_size, native_kernel):
    """With the extend kernel every row is native: no prefix groups, the same outputs."""
    a, b = [0] + list(range(1, 13)), [0] + list(range(20, 30))
    extend = [([], 0, 9), (a, 2, 7), (b, 0, 1), (a[:10], block_size, 3), (a, 0, 2)]
    batch, num_blocks = make_batch(tree_rows(block_size), extend, block_size, seed=block_size)
    run_both(
        batch, num_blocks, 8, 2, torch.float32, seed=6, expect_groups=False, native=0,
        native_extend=True,
    )  # fmt: skip


def test_fp8_pool_with_shared_prefix():
    batch, num_blocks = make_batch(tree_rows(4), [([], 0, 6), (list(range(1, 13)), 1, 4)], 4, 3)
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(1, num_blocks, 4, 2, HEAD_DIM, torch.float8_e4m3fn, "cpu")
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(torch.float8_e4m3fn))
    ref = TorchAttentionBackend(8, 2, HEAD_DIM)
    fast = SdpaAttentionBackend(8, 2, HEAD_DIM, prefix_min_saved_keys=0)
    ref.prepare(batch)
    fast.prepare(batch)
    assert fast.prefix_groups
    t = batch.num_tokens
    q, k, v = (torch.randn(t, h, HEAD_DIM, generator=gen) for h in (8, 2, 2))
    expected = ref.forward(0, q, k, v, pool)
    torch.testing.assert_close(fast.forward(0, q, k, v, pool), expected, atol=2e-5, rtol=2e-5)


def test_prefix_plan_groups_families_not_the_template():
    """Rows on two long prompts that share only a template block form two groups (one per
    prompt, nested rows inside A's), not one group over the template block."""
    bs = 4
    batch, _ = make_batch(tree_rows(bs), [], bs, seed=0)
    plan = plan_shared_prefixes(batch, min_saved_keys=0)
    groups = {tuple(g.tokens.tolist()): g.blocks.shape[0] for g in plan.groups}
    # A: rows 0, 3 share 13 blocks; with 1, 7 (and 8: 9 blocks before its last) 9 blocks
    # B: rows 2, 6 share 11 blocks (row 5 only 4 with them); rows 4 has only the template
    assert sum(len(r) for r in groups) <= 9
    assert all(n >= 2 for n in groups.values())
    assert any(set(r) >= {0, 3} for r in groups) and any(set(r) >= {2, 6} for r in groups)
    assert not any(set(r) & {0, 3} and set(r) & {2, 6} for r in groups)
    for g in plan.groups:  # a group's blocks are every member's leading blocks
        rows = g.tokens.tolist()  # decode only: a row's token is its row
        kvp = batch.kv_indptr_cpu.tolist()
        for r in rows:
            lead = batch.kv_indices[kvp[r] : kvp[r] + g.blocks.shape[0]]
            assert torch.equal(lead.long(), g.blocks) and plan.skip_blocks[r] == len(g.blocks)
            assert kvp[r + 1] - kvp[r] > len(g.blocks)  # the row's last block stays its own
    assert not np.any(plan.skip_blocks[[i for i in range(9) if all(i not in r for r in groups)]])


def test_extend_rows_join_prefix_groups():
    """Extend rows on a cached shared prefix (a new turn of a chat whose history is cached)
    join the decode rows' group: every new token of theirs is a query of the prefix call. A
    row sharing only half the prefix stays out (3 rows x 12 blocks save more than 4 x 6)."""
    bs = 4
    a = list(range(1, 13))
    decode = [(a, 3), (a, 5)]
    extend = [(a, 1, 6), (a[:6], 0, 3)]  # 6 new tokens on A + 1; 3 new on half of A
    batch, num_blocks = make_batch(decode, extend, bs, seed=5)
    plan = plan_shared_prefixes(batch, min_saved_keys=0)
    assert len(plan.groups) == 1 and plan.groups[0].num_rows == 3
    assert plan.groups[0].tokens.tolist() == list(range(8))  # 2 decode + 6 extend tokens
    assert plan.skip_blocks.tolist() == [12, 12, 12, 0]
    run_both(batch, num_blocks, 6, 2, torch.float32, seed=5)


def test_min_saved_keys_drops_small_groups():
    """3 rows x 13 shared blocks of 4 keys save 2 x 52 = 104 key reads: kept at 104, not 105."""
    a = list(range(1, 14))
    batch, _ = make_batch([(a, 3), (a, 5), (a, 1)], [], 4, seed=2)
    assert len(plan_shared_prefixes(batch, min_saved_keys=104).groups) == 1
    assert not plan_shared_prefixes(batch, min_saved_keys=105).groups
    assert not plan_shared_prefixes(batch).skip_blocks.any()  # the default: far more


def test_many_rows_plan_without_recursion():
    """2000 decode rows: families of 2-50 rows on 4 prompts, nested; the plan is linear in
    rows (no recursion limit) and every group's blocks lead each member's table."""
    rng = np.random.default_rng(0)
    prompts = [[0] + list(range(100 * p + 1, 100 * p + 41)) for p in range(4)]
    decode = []
    for _ in range(2000):
        pr = prompts[int(rng.integers(4))]
        decode.append((pr[: int(rng.integers(2, len(pr) + 1))], int(rng.integers(1, 9))))
    batch, _ = make_batch(decode, [], 4, seed=9)
    plan = plan_shared_prefixes(batch, min_saved_keys=0)
    assert len(plan.groups) >= 4 and sum(g.num_rows for g in plan.groups) <= 2000
    kvp = batch.kv_indptr_cpu.tolist()
    for g in plan.groups:
        p = g.blocks.shape[0]
        for r in g.tokens.tolist():
            assert torch.equal(batch.kv_indices[kvp[r] : kvp[r] + p].long(), g.blocks)


def test_no_sharing_no_groups():
    batch, num_blocks = make_batch([([], 20), ([], 3), ([], 40)], [([], 0, 5)], 4, seed=1)
    assert not plan_shared_prefixes(batch, min_saved_keys=0).groups
    run_both(batch, num_blocks, 8, 2, torch.float32, seed=1, expect_groups=False)


def test_merge_partial_is_attention_over_the_union():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 8, generator=gen)
    k1, k2 = torch.randn(3, 4, 10, 8, generator=gen), torch.randn(3, 4, 7, 8, generator=gen)
    v1, v2 = torch.randn(3, 4, 10, 8, generator=gen), torch.randn(3, 4, 7, 8, generator=gen)

    def part(k, v):
        s = torch.einsum("mhd,mhkd->mhk", q, k)
        return torch.einsum("mhk,mhkd->mhd", s.softmax(-1), v), s.logsumexp(-1)

    (o1, l1), (o2, l2) = part(k1, v1), part(k2, v2)
    want, _ = part(torch.cat([k1, k2], 2), torch.cat([v1, v2], 2))
    torch.testing.assert_close(merge_partial(o1, l1, o2, l2), want, atol=1e-6, rtol=1e-5)
