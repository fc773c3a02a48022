"""The native CPU decode kernel (kernels/csrc/paged_decode.c) against its float64 oracle.

Random pools with blocks scattered, block sizes 1/4/16, GQA groups 1-8, head dims on the
vector path (multiples of 8) and off it (12), strided query rows (a view of a fused qkv
projection), log-sum-exps, one and two threads; bad arguments raise instead of reading
out of bounds; the library is cached per source and CPU.
"""

from __future__ import annotations

import pytest
import torch

from radixrt.kernels.paged_decode_cpu import paged_decode_reference


def _case(gen, n, block_size, kv_heads, group, head_dim, max_len=300):
    heads = kv_heads * group
    lens = torch.randint(1, max_len + 1, (n,), generator=gen, dtype=torch.int32)
    nblk = (lens + block_size - 1) // block_size
    num_blocks = int(nblk.sum()) + 5
    kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    vc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    indices = torch.randperm(num_blocks, generator=gen)[: int(nblk.sum())].to(torch.int32)
    start = torch.zeros(n, dtype=torch.int64)
    start[1:] = torch.cumsum(nblk, 0)[:-1]
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3
    q = qkv[:, : heads * head_dim].view(n, heads, head_dim)  # strided rows
    return q, kc, vc, indices, start, lens


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("kv_heads,group", [(1, 1), (2, 3), (2, 4), (4, 2), (1, 8)])
@pytest.mark.parametrize("head_dim", [12, 32, 64])
def test_kernel_matches_reference(native_kernel, block_size, kv_heads, group, head_dim):
    gen = torch.Generator().manual_seed(block_size * 100 + kv_heads * 10 + group + head_dim)
    q, kc, vc, idx, start, lens = _case(gen, 9, block_size, kv_heads, group, head_dim)
    out = torch.full((9, kv_heads * group, head_dim), float("nan"))
    lse = torch.full((9, kv_heads * group), float("nan"))
    scale = head_dim**-0.5
    native_kernel(q, kc, vc, idx, start, lens, scale, out, lse)
    ref_out, ref_lse = paged_decode_reference(q, kc, vc, idx, start, lens, scale)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("head_dim", [32, 64])
def test_portable_path_matches_reference(native_kernel, head_dim):
    """The portable C path (what CPUs without AVX2 run) on head dims the vector path takes."""
    from radixrt.kernels.paged_decode_cpu import load_paged_decode

    kernel = load_paged_decode(("RADIXRT_PORTABLE",))
    assert kernel is not None
    gen = torch.Generator().manual_seed(head_dim)
    q, kc, vc, idx, start, lens = _case(gen, 6, 4, 2, 3, head_dim)
    out, lse = torch.empty(6, 6, head_dim), torch.empty(6, 6)
    kernel(q, kc, vc, idx, start, lens, 0.3, out, lse)
    ref_out, ref_lse = paged_decode_reference(q, kc, vc, idx, start, lens, 0.3)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("threading", ["openmp", "pthreads"])
def test_strided_output_and_threads(native_kernel, threading):
    """Results written through a strided view (rows of a larger buffer) and with 2, 5 and 64
    threads (more threads than work items too) equal the one-thread results, on OpenMP and
    on per-call threads (a build without OpenMP)."""
    from radixrt.kernels.paged_decode_cpu import load_paged_decode

    kernel = native_kernel
    if threading == "pthreads":
        kernel = load_paged_decode(("RADIXRT_NO_OPENMP",))
    gen = torch.Generator().manual_seed(5)
    q, kc, vc, idx, start, lens = _case(gen, 3, 16, 2, 3, 32)
    one = torch.empty(3, 6, 32)
    kernel(q, kc, vc, idx, start, lens, 0.2, one)
    for threads in (2, 5, 64):
        big = torch.zeros(3, 2, 6, 32)
        kernel(q, kc, vc, idx, start, lens, 0.2, big[:, 1], num_threads=threads)
        assert torch.equal(big[:, 1], one) and not big[:, 0].any()


def test_extreme_scores_stay_finite(native_kernel):
    """Scores spread over hundreds of nats: the softmax's max subtraction keeps it finite."""
    gen = torch.Generator().manual_seed(6)
    q, kc, vc, idx, start, lens = _case(gen, 4, 4, 2, 2, 32)
    q = q * 100
    out, lse = torch.empty(4, 4, 32), torch.empty(4, 4)
    native_kernel(q, kc, vc, idx, start, lens, 1.0, out, lse)
    ref_out, ref_lse = paged_decode_reference(q, kc, vc, idx, start, lens, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-6)


def test_bad_lengths_raise(native_kernel):
    gen = torch.Generator().manual_seed(7)
    q, kc, vc, idx, start, lens = _case(gen, 2, 4, 1, 1, 16)
    lens[1] = 0
    with pytest.raises(RuntimeError, match="bad arguments"):
        native_kernel(q, kc, vc, idx, start, lens, 0.25, torch.empty(2, 1, 16))


def test_blocks_outside_the_table_or_pool_raise(native_kernel):
    """A block table that points past kv_indices or outside the pool is refused (no read)."""
    gen = torch.Generator().manual_seed(8)
    q, kc, vc, idx, start, lens = _case(gen, 3, 4, 2, 1, 16)
    out = torch.empty(3, 2, 16)
    native_kernel(q, kc, vc, idx, start, lens, 0.25, out)  # as made: fine
    bad = idx.clone()
    bad[-1] = kc.shape[0]  # a block id past the pool
    with pytest.raises(RuntimeError, match="bad arguments"):
        native_kernel(q, kc, vc, bad, start, lens, 0.25, out)
    with pytest.raises(RuntimeError, match="bad arguments"):
        native_kernel(q, kc, vc, idx[:-1].contiguous(), start, lens, 0.25, out)  # too short


def test_library_is_cached_per_source(native_kernel, tmp_path, monkeypatch):
    """A fresh cache dir gets one library; loading again reuses it (no rebuild)."""
    from radixrt.kernels import native

    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    native.load_library.cache_clear()
    try:
        assert native.load_library("paged_decode") is not None
        built = list(tmp_path.glob("paged_decode-*.so"))
        assert len(built) == 1 and not list(tmp_path.glob("*.tmp*"))
        mtime = built[0].stat().st_mtime_ns
        native.load_library.cache_clear()
        assert native.load_library("paged_decode") is not None
        assert built[0].stat().st_mtime_ns == mtime
    finally:
        native.load_library.cache_clear()


def test_prebuild_compiles_in_parallel_then_loads_reuse(native_kernel, tmp_path, monkeypatch):
    from radixrt.kernels import native

    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    native.load_library.cache_clear()
    try:
        native.prebuild(native.CPU_LIBRARIES)
        built = {p.name.split("-")[0]: p for p in tmp_path.glob("*.so")}
        assert set(built) == set(native.CPU_LIBRARIES)
        mtimes = {name: p.stat().st_mtime_ns for name, p in built.items()}
        for name in native.CPU_LIBRARIES:
            assert native.load_library(name) is not None
        assert {name: p.stat().st_mtime_ns for name, p in built.items()} == mtimes
        native.prebuild(native.CPU_LIBRARIES)  # all cached: nothing rebuilt
        assert len(list(tmp_path.glob("*.so"))) == len(built)
    finally:
        native.load_library.cache_clear()


def test_disabled_by_environment(monkeypatch):
    from radixrt.kernels import native

    monkeypatch.setenv(native.DISABLE_ENV, "0")
    native.load_library.cache_clear()
    try:
        assert native.load_library("paged_decode") is None
    finally:
        native.load_library.cache_clear()


def test_unwritable_cache_falls_back(native_kernel, tmp_path, monkeypatch, caplog):
    """A cache dir that cannot be created: None and a warning (the torch path runs), no
    exception into the step."""
    from radixrt.kernels import native

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(native.CACHE_ENV, str(blocker / "native"))  # under a regular file
    native.load_library.cache_clear()
    try:
        assert native.load_library("paged_decode") is None
        assert "unavailable" in caplog.text
    finally:
        native.load_library.cache_clear()
