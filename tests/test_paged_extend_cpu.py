"""The native CPU extend kernel (kernels/csrc/paged_extend.c) against its float64 oracle.

Random pools with blocks scattered, block sizes 1/4/16, GQA groups 1-8, head dims on the
vector path (multiples of 8) and off it (12), rows mixing fresh prompts and extends over
prefixes (up to 1100 cached keys, up to 300 new), single-query rows, rows not in token order
with strided q and out (views of larger buffers), log-sum-exps, 1/2/3 threads on OpenMP and
on per-call threads, the portable build; bad arguments raise instead of reading out of bounds.
"""

from __future__ import annotations

import pytest
import torch

from radixrt.kernels.paged_extend_cpu import (
    PagedExtendKernel,
    load_paged_extend,
    paged_extend_reference,
)

MIXED = [(0, 37), (100, 1), (0, 1), (45, 70), (3, 16), (200, 9)]  # (cached keys, new tokens)
LONG = [(1100, 300), (0, 300), (517, 129), (0, 1), (64, 64)]


@pytest.fixture(scope="module")
def extend_kernel(native_kernel):
    """The native extend kernel (`native_kernel`: skips only where no C compiler exists;
    where one does, a kernel that does not build fails the test)."""
    from radixrt.kernels.paged_extend_cpu import load_paged_extend

    kernel = load_paged_extend()
    assert kernel is not None, "a C compiler exists but the native kernel did not build"
    return kernel


def _variant(*defines: str) -> PagedExtendKernel:
    """A build with `defines` (callers take the `extend_kernel` fixture: a compiler exists)."""
    kernel = load_paged_extend(tuple(defines))
    assert kernel is not None
    return kernel


def _case(gen, rows, block_size, kv_heads, group, head_dim):
    """Pool, block tables and strided q for `rows` [(cached, new)]; the rows' tokens are laid
    out in a shuffled order with a gap token between rows. Returns the kernel's inputs
    (q, kc, vc, indices, block_start, kv_len, q_start, q_len) and the number of tokens."""
    n = len(rows)
    heads = kv_heads * group
    kv_len = torch.tensor([c + m for c, m in rows], dtype=torch.int32)
    q_len = torch.tensor([m for _, m in rows], dtype=torch.int32)
    nblk = (kv_len + block_size - 1) // block_size
    num_blocks = int(nblk.sum()) + 5
    kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    vc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    indices = torch.randperm(num_blocks, generator=gen)[: int(nblk.sum())].to(torch.int32)
    block_start = torch.zeros(n, dtype=torch.int64)
    block_start[1:] = torch.cumsum(nblk, 0)[:-1]
    q_start = torch.zeros(n, dtype=torch.int64)
    pos = 1
    for r in torch.randperm(n, generator=gen).tolist():  # tokens not in row order
        q_start[r] = pos
        pos += rows[r][1] + 1
    qkv = torch.randn(pos, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2
    q = qkv[:, : heads * head_dim].view(pos, heads, head_dim)  # strided token rows
    return (q, kc, vc, indices, block_start, kv_len, q_start, q_len), pos


def _check(kernel, args, tokens, scale, num_threads=1, atol=2e-5):
    heads, head_dim = args[0].shape[1:]
    big = torch.full((tokens, 3, heads, head_dim), float("nan"))
    out = big[:, 1]  # strided output rows
    lse = torch.full((tokens, heads), float("nan"))
    kernel(*args, scale, out, lse, num_threads=num_threads)
    ref_out, ref_lse = paged_extend_reference(*args, scale)
    written = ~torch.isnan(ref_lse[:, 0])
    assert torch.isnan(out[~written]).all() and torch.isnan(big[:, 0]).all()  # others untouched
    assert torch.isnan(big[:, 2]).all()
    torch.testing.assert_close(out[written].double(), ref_out[written], atol=atol, rtol=1e-5)
    torch.testing.assert_close(lse[written].double(), ref_lse[written], atol=atol, rtol=1e-6)
    return out.clone(), lse


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("kv_heads,group", [(1, 1), (2, 2), (2, 3), (1, 4), (1, 8)])
@pytest.mark.parametrize("head_dim", [12, 32, 64, 128])
def test_kernel_matches_reference(extend_kernel, block_size, kv_heads, group, head_dim):
    gen = torch.Generator().manual_seed(block_size * 1000 + kv_heads * 100 + group + head_dim)
    args, tokens = _case(gen, MIXED, block_size, kv_heads, group, head_dim)
    _check(extend_kernel, args, tokens, head_dim**-0.5)


@pytest.mark.parametrize("head_dim", [12, 64])
def test_long_rows_and_threads(extend_kernel, head_dim):
    """Long prefixes and prompts (several work items per row): 1, 2 and 3 threads give the
    oracle's results and the same bits as one thread."""
    gen = torch.Generator().manual_seed(head_dim)
    args, tokens = _case(gen, LONG, 16, 2, 3, head_dim)
    one, one_lse = _check(extend_kernel, args, tokens, head_dim**-0.5)
    for threads in (2, 3):
        out, lse = _check(extend_kernel, args, tokens, head_dim**-0.5, num_threads=threads)
        assert torch.equal(out.nan_to_num(), one.nan_to_num())
        assert torch.equal(lse.nan_to_num(), one_lse.nan_to_num())


@pytest.mark.parametrize("threading", ["openmp", "pthreads"])
def test_threads_match_one_thread(extend_kernel, threading):
    """2, 3 and 64 threads (more threads than work items too) give one thread's bits, on
    OpenMP and on per-call threads (a build without OpenMP)."""
    kernel = extend_kernel if threading == "openmp" else _variant("RADIXRT_NO_OPENMP")
    gen = torch.Generator().manual_seed(11)
    args, tokens = _case(gen, MIXED + [(300, 150)], 4, 2, 4, 32)
    one, _ = _check(kernel, args, tokens, 0.2)
    for threads in (2, 3, 64):
        out, _ = _check(kernel, args, tokens, 0.2, num_threads=threads)
        assert torch.equal(out.nan_to_num(), one.nan_to_num())


@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("variant", ["RADIXRT_PORTABLE", "RADIXRT_NO_AVX512"])
def test_other_builds_match_reference(extend_kernel, head_dim, variant):
    """The portable C path (what CPUs without AVX2 run) on head dims the vector path takes, and
    the register tiles for 16 vector registers (AVX2 without AVX-512VL's 32)."""
    kernel = _variant(variant)
    gen = torch.Generator().manual_seed(head_dim + 1)
    args, tokens = _case(gen, MIXED + [(150, 80)], 4, 2, 3, head_dim)
    _check(kernel, args, tokens, head_dim**-0.5)
    _check(kernel, args, tokens, head_dim**-0.5, num_threads=2)


def test_fresh_rows_only(extend_kernel):
    """Fresh prompts only (kv_len == q_len), the prefill step's shape: tiny Llama's heads."""
    gen = torch.Generator().manual_seed(3)
    args, tokens = _case(gen, [(0, 128)] * 4 + [(0, 5), (0, 77)], 16, 2, 3, 32)
    _check(extend_kernel, args, tokens, 32**-0.5, num_threads=2)


@pytest.mark.parametrize("head_dim", [12, 32])
def test_extreme_scores_stay_finite(extend_kernel, head_dim):
    """Logits around 1e4 (scores spread over thousands of nats): no inf or nan."""
    gen = torch.Generator().manual_seed(6)
    args, tokens = _case(gen, [(20, 30), (0, 17), (5, 1)], 4, 2, 2, head_dim)
    q = args[0] * (1e4 / head_dim**0.5)
    args = (q,) + args[1:]
    heads = q.shape[1]
    out, lse = torch.empty(tokens, heads, head_dim), torch.empty(tokens, heads)
    extend_kernel(*args, 1.0, out, lse)
    ref_out, ref_lse = paged_extend_reference(*args, 1.0)
    written = ~torch.isnan(ref_lse[:, 0])
    assert torch.isfinite(out[written]).all() and torch.isfinite(lse[written]).all()
    torch.testing.assert_close(out[written].double(), ref_out[written], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(lse[written].double(), ref_lse[written], atol=1e-1, rtol=1e-5)


def _bad(args, field, value):
    args = list(args)
    i = ["q", "kc", "vc", "indices", "block_start", "kv_len", "q_start", "q_len"].index(field)
    args[i] = args[i].clone()
    args[i].view(-1)[value[0]] = value[1]
    return args


@pytest.mark.parametrize(
    "field,value",
    [
        ("q_len", (1, 0)),  # no queries
        ("kv_len", (0, 5)),  # fewer keys than queries (row 0 has 37)
        ("q_start", (2, -1)),  # token before the start
        ("q_start", (3, 10**6)),  # token past the end
        ("indices", (4, 10**6)),  # block out of the pool
        ("indices", (0, -3)),
        ("block_start", (5, 10**6)),  # block table past the indices
    ],
)
def test_bad_arguments_raise(extend_kernel, field, value):
    gen = torch.Generator().manual_seed(7)
    args, tokens = _case(gen, MIXED, 4, 1, 2, 16)
    args = _bad(args, field, value)
    out = torch.empty(tokens, 2, 16)
    with pytest.raises(RuntimeError, match="bad arguments"):
        extend_kernel(*args, 0.25, out)


def test_no_rows_is_a_no_op(extend_kernel):
    gen = torch.Generator().manual_seed(8)
    args, tokens = _case(gen, [(0, 3)], 4, 1, 2, 16)
    empty64, empty32 = torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int32)
    out = torch.zeros(tokens, 2, 16)
    extend_kernel(*args[:4], empty64, empty32, empty64, empty32, 0.25, out)
    assert not out.any()


@pytest.mark.parametrize("group", [24, 64])
def test_wide_groups(extend_kernel, group):
    """Groups as wide as the kernel takes (a tile is then one query's heads)."""
    gen = torch.Generator().manual_seed(group)
    args, tokens = _case(gen, [(10, 20), (0, 3)], 4, 1, group, 16)
    _check(extend_kernel, args, tokens, 0.25)


def test_too_wide_group_raises(extend_kernel):
    gen = torch.Generator().manual_seed(9)
    args, tokens = _case(gen, [(0, 3)], 4, 1, 65, 8)
    with pytest.raises(RuntimeError, match="bad arguments"):
        extend_kernel(*args, 0.25, torch.empty(tokens, 65, 8))
