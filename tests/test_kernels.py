"""Triton kernels vs their torch references, on CPU (TRITON_INTERPRET=1) and on CUDA.

Triton (3.9) reads TRITON_INTERPRET when `@triton.jit` runs: when radixrt.kernels'
`_*_triton` modules are first imported (on a launcher's first call) and when
triton.language is first imported (tl.sum etc. are jit functions too). So this module
sets it, when CUDA is unavailable, at collection time, before any test launches a kernel.
If something in the same pytest process imported triton earlier without it, the CPU cases
fail (on a CUDA machine: skip) saying so; export TRITON_INTERPRET=1 or set it in
tests/conftest.py. Importing radixrt.kernels alone does not import triton.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib
import itertools
import subprocess
import sys

import pytest

from radixrt.kernels import (
    HAS_TRITON,
    build_block_table,
    build_block_table_reference,
    build_kv_metadata,
    build_kv_metadata_reference,
    build_token_metadata,
    build_token_metadata_reference,
    rmsnorm,
    rmsnorm_reference,
    store_kv,
    store_kv_reference,
)
from radixrt.kv.pool import KVPool

BLOCK_SIZES = [1, 4, 16]


def _kernels_interpreted() -> bool:
    """Whether our kernels and Triton's own jit library (tl.sum, ...) were defined with
    TRITON_INTERPRET=1: both are fixed when their module is first imported."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    ours = importlib.import_module("radixrt.kernels._store_kv_triton").store_kv_kernel
    return isinstance(ours, InterpretedFunction) and isinstance(tl.sum, InterpretedFunction)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    """The device the kernels run on: CPU through Triton's interpreter, or CUDA."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("CUDA is not available")
    elif not _kernels_interpreted():
        if torch.cuda.is_available():  # kernels compiled for the GPU; the cuda case runs
            pytest.skip("CPU tensors need TRITON_INTERPRET=1; the cuda case runs instead")
        pytest.fail(  # a CPU-only run that would otherwise test nothing
            "triton.language or radixrt.kernels was imported before TRITON_INTERPRET=1 was "
            "set, so kernels compile for a GPU; export TRITON_INTERPRET=1 (or set it in "
            "tests/conftest.py)"
        )
    return torch.device(request.param)


def _assert_equal_but_interpreter_bf16_rounding(got: torch.Tensor, expected: torch.Tensor):
    """Exact, except that Triton's interpreter truncates float32 -> bfloat16 casts (GPUs and
    torch round to nearest even), so there results may be one bf16 ulp toward zero."""
    if _kernels_interpreted() and got.dtype == torch.bfloat16:
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=0)
        assert (got.float().abs() <= expected.float().abs()).all()
    else:
        assert torch.equal(got, expected)


def _int32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


# ---------------------------------------------------------------- store_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_tokens", [0, 1, 13])
def test_store_kv_matches_reference(device, dtype, block_size, num_tokens):
    gen = torch.Generator().manual_seed(block_size * 100 + num_tokens)
    num_blocks, heads, head_dim = 6, 3, 24  # head_dim not a power of two: masked lanes
    kv = torch.randn(2, num_blocks, block_size, heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    k = torch.randn(len(slots), heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(slots), heads, head_dim, generator=gen).to(dtype)
    expected = kv.clone()
    store_kv_reference(expected, slots, k, v)
    kv, slots, k, v = (t.to(device) for t in (kv, slots, k, v))
    store_kv(kv, slots, k, v)
    assert torch.equal(kv.cpu(), expected)


def test_store_kv_strided_inputs_into_pool_layer(device):
    """k/v as views into a fused qkv projection, written into one layer of a KVPool."""
    gen = torch.Generator().manual_seed(0)
    heads, head_dim, num_tokens = 2, 16, 9
    pool = KVPool(3, 5, 4, heads, head_dim, torch.float32, device)
    expected = KVPool(3, 5, 4, heads, head_dim, torch.float32, "cpu")
    qkv = torch.randn(num_tokens, 3 * heads * head_dim, generator=gen)
    k = qkv[:, heads * head_dim : 2 * heads * head_dim].view(num_tokens, heads, head_dim)
    v = qkv[:, 2 * heads * head_dim :].view(num_tokens, heads, head_dim)
    slots = torch.randperm(20, generator=gen)[:num_tokens]
    expected.store(1, slots, k, v)
    store_kv(pool.kv[1], slots.to(device), k.to(device), v.to(device))
    assert not pool.kv[0].any() and not pool.kv[2].any()
    assert torch.equal(pool.kv.cpu(), expected.kv)


def test_store_kv_casts_to_pool_dtype(device):
    gen = torch.Generator().manual_seed(1)
    kv = torch.zeros(2, 4, 4, 2, 8, dtype=torch.bfloat16)
    slots = torch.tensor([3, 0, 15, 9])
    k, v = torch.randn(2, 4, 2, 8, generator=gen)
    expected = kv.clone()
    store_kv_reference(expected, slots, k, v)
    kv = kv.to(device)
    store_kv(kv, slots.to(device), k.to(device), v.to(device))
    _assert_equal_but_interpreter_bf16_rounding(kv.cpu(), expected)


def test_store_kv_rejects_bad_shapes():
    kv = torch.zeros(2, 4, 4, 2, 8)
    k = torch.zeros(3, 2, 8)
    with pytest.raises(ValueError, match="slots must be"):
        store_kv(kv, torch.zeros(3, dtype=torch.int32), k, k)
    with pytest.raises(ValueError, match="v must be"):
        store_kv(kv, torch.zeros(3, dtype=torch.int64), k, torch.zeros(3, 2, 4))
    with pytest.raises(ValueError, match="kv_layer must be"):
        store_kv(kv[0], torch.zeros(3, dtype=torch.int64), k, k)


# ---------------------------------------------------------------- block tables


def _random_table(gen, num_rows, max_blocks, pool_blocks=1000) -> torch.Tensor:
    """A padded table of distinct block ids; the padding is garbage (-7) as it may be."""
    ids = torch.randperm(pool_blocks, generator=gen)[: num_rows * max_blocks]
    return ids.view(num_rows, max_blocks).to(torch.int32)


def _seq_lens(gen, num_rows, max_blocks, block_size) -> list[int]:
    """Mixed lengths; row 0 is exactly full blocks, row 1 a single token where present."""
    lens = torch.randint(1, max_blocks * block_size + 1, (num_rows,), generator=gen).tolist()
    if num_rows > 0:
        lens[0] = block_size * (1 + lens[0] % max_blocks)
    if num_rows > 1:
        lens[1] = 1
    return lens


def _assert_kv_metadata_equal(got, expected):
    for name, a, b in zip(got._fields, got, expected):
        assert a.dtype == torch.int32, name
        assert torch.equal(a.cpu(), b.cpu()), name


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_rows", [0, 1, 3, 8])
@pytest.mark.parametrize("pass_nnz", [False, True])
def test_build_kv_metadata_matches_reference(device, block_size, num_rows, pass_nnz):
    gen = torch.Generator().manual_seed(num_rows * 10 + block_size)
    max_blocks = 7
    table = _random_table(gen, num_rows, max_blocks)
    lens = _seq_lens(gen, num_rows, max_blocks, block_size)
    nnz = sum(-(-n // block_size) for n in lens) if pass_nnz else None
    expected = build_kv_metadata_reference(table, _int32(lens, "cpu"), block_size, nnz)
    got = build_kv_metadata(table.to(device), _int32(lens, device), block_size, nnz)
    _assert_kv_metadata_equal(got, expected)
    assert got.kv_indices.device.type == device.type


def test_build_kv_metadata_long_rows_and_strided_table(device):
    """Rows longer than one loop chunk (256 blocks); a table that is a slice of a buffer."""
    gen = torch.Generator().manual_seed(2)
    buffer = _random_table(gen, 6, 700, pool_blocks=6 * 700)
    table = buffer[1:4, 50:650]  # row stride 700, col stride 1
    transposed = buffer.t().contiguous().t()[:3, :600]  # col stride 6
    lens = [600, 257, 256]
    for t in (table, transposed):
        expected = build_kv_metadata_reference(t, _int32(lens, "cpu"), 1)
        got = build_kv_metadata(t.to(device), _int32(lens, device), 1)
        _assert_kv_metadata_equal(got, expected)


@pytest.mark.parametrize("indptr_dtype", [torch.int32, torch.int64])
def test_build_block_table_inverts_kv_metadata(device, indptr_dtype):
    """Rows of 0..600 blocks (past one loop chunk) into a wider, pre-filled table: each row's
    used entries come back in order, the rest of the table is untouched, and a width below a
    row's length cuts the row there."""
    gen = torch.Generator().manual_seed(5)
    lens = [600, 1, 257, 16, 0, 33]
    table = _random_table(gen, len(lens), 600, pool_blocks=6 * 600)
    indptr = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=indptr_dtype)
    indices = torch.cat([table[r, :n] for r, n in enumerate(lens)])
    for width in (640, 300):
        out = torch.full((8, width), -1, dtype=torch.int32)
        expected = build_block_table_reference(indptr, indices, out.clone(), len(lens))
        got = build_block_table(indptr.to(device), indices.to(device), out.to(device), len(lens))
        assert got.shape == (len(lens), width)
        assert torch.equal(got.cpu(), expected)
        for r, n in enumerate(lens):
            assert torch.equal(got[r, : min(n, width)].cpu(), table[r, : min(n, width)])
            assert (got[r, min(n, width) :] == -1).all()


def test_build_block_table_rejects_bad_shapes():
    indptr, indices = torch.tensor([0, 2], dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="unit column stride"):
        build_block_table(indptr, indices, torch.zeros(4, 3, dtype=torch.int32).t(), 1)
    with pytest.raises(ValueError, match="num_rows = 3"):
        build_block_table(indptr, indices, torch.zeros(4, 3, dtype=torch.int32), 3)
    with pytest.raises(ValueError, match="kv_indices int32"):
        build_block_table(indptr, indices.long(), torch.zeros(4, 3, dtype=torch.int32), 1)


def test_build_kv_metadata_reference_rejects_bad_lengths():
    table = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="not in 1..12"):
        build_kv_metadata_reference(table, _int32([0, 4], "cpu"), 4)
    with pytest.raises(ValueError, match="not in 1..12"):
        build_kv_metadata_reference(table, _int32([13, 4], "cpu"), 4)
    with pytest.raises(ValueError, match="seq_lens must be"):
        build_kv_metadata(table, _int32([4], "cpu"), 4)


def _token_batch(gen, num_rows, max_blocks, block_size):
    """Decode rows, extends on a cached prefix, fresh prefills and empty rows, mixed."""
    cap = max_blocks * block_size
    start_pos, num_new = [], []
    for row in range(num_rows):
        kind = row % 4
        if kind == 0:  # decode
            start = int(torch.randint(0, cap, (1,), generator=gen))
            count = 1
        elif kind == 1:  # extend on a cached prefix, possibly mid-block
            start = int(torch.randint(0, cap, (1,), generator=gen))
            count = int(torch.randint(1, cap - start + 1, (1,), generator=gen))
        elif kind == 2:  # fresh prefill, sometimes exactly full blocks
            start = 0
            count = cap if row % 8 == 2 else int(torch.randint(1, cap + 1, (1,), generator=gen))
        else:  # nothing new (e.g. a row whose chunk is elsewhere)
            start, count = int(torch.randint(0, cap + 1, (1,), generator=gen)), 0
        start_pos.append(start)
        num_new.append(count)
    qo_indptr = [0]
    for count in num_new:
        qo_indptr.append(qo_indptr[-1] + count)
    return start_pos, num_new, qo_indptr


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_rows", [0, 1, 4, 9])
def test_build_token_metadata_matches_reference(device, block_size, num_rows):
    gen = torch.Generator().manual_seed(num_rows * 10 + block_size)
    max_blocks = 6
    table = _random_table(gen, num_rows, max_blocks)
    start_pos, num_new, qo_indptr = _token_batch(gen, num_rows, max_blocks, block_size)
    args = (start_pos, num_new, qo_indptr)
    num_tokens = qo_indptr[-1]
    expected = build_token_metadata_reference(
        table, *(_int32(a, "cpu") for a in args), num_tokens, block_size
    )
    got = build_token_metadata(
        table.to(device), *(_int32(a, device) for a in args), num_tokens, block_size
    )
    for name, a, b in zip(got._fields, got, expected):
        assert a.dtype == torch.int64 and a.shape == (num_tokens,), name
        assert torch.equal(a.cpu(), b), name


def test_build_token_metadata_long_rows_and_empty_batch(device):
    gen = torch.Generator().manual_seed(3)
    buffer = _random_table(gen, 4, 200, pool_blocks=800)
    table = buffer[:3, :150]  # row stride 200
    block_size = 4
    start_pos, num_new = [0, 37, 5], [600, 300 - 37, 0]  # 600 tokens: three chunks of 256
    qo_indptr = [0, 600, 863, 863]
    args = (start_pos, num_new, qo_indptr)
    expected = build_token_metadata_reference(table, *(_int32(a, "cpu") for a in args), 863, 4)
    got = build_token_metadata(
        table.to(device), *(_int32(a, device) for a in args), 863, block_size
    )
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, expected))

    empty = build_token_metadata(
        table.to(device), *(_int32(a, device) for a in ([1, 2, 3], [0] * 3, [0] * 4)), 0, 4
    )
    assert empty.positions.shape == (0,) and empty.slot_mapping.shape == (0,)


@pytest.mark.gpu
def test_block_table_kernels_compile_once_for_every_batch_shape():
    """The table width, index count and token count change every step; a step whose counts
    are 1, a multiple of 16 or neither must not compile another variant mid-serving."""
    mod = importlib.import_module("radixrt.kernels._block_table_triton")
    kernels = (mod.kv_indices_kernel, mod.token_metadata_kernel)
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(5)

    def step(num_rows: int, width: int) -> None:
        table = _random_table(gen, num_rows, width, pool_blocks=4096).to(dev)
        seq_lens = torch.randint(1, width * 16 + 1, (num_rows,), generator=gen)
        build_kv_metadata(table, _int32(seq_lens.tolist(), dev), 16, None)
        start = [int(torch.randint(0, n, (1,), generator=gen)) for n in seq_lens.tolist()]
        new = [n - s for n, s in zip(seq_lens.tolist(), start)]
        qo = [0]
        for n in new:
            qo.append(qo[-1] + n)
        args = (_int32(a, dev) for a in (start, new, qo))
        build_token_metadata(table, *args, qo[-1], 16)

    step(3, 5)
    compiled = [len(k.device_caches[dev.index][0]) for k in kernels]
    for num_rows, width in [(1, 1), (1, 16), (16, 32), (5, 17), (2, 1), (33, 48)]:
        step(num_rows, width)
    assert [len(k.device_caches[dev.index][0]) for k in kernels] == compiled


def test_build_token_metadata_reference_rejects_inconsistent_rows():
    table = torch.zeros(2, 2, dtype=torch.int32)
    ok = dict(block_tables=table, num_tokens=3, block_size=4)
    with pytest.raises(ValueError, match="disagree on row 1"):
        build_token_metadata_reference(
            start_pos=_int32([0, 0], "cpu"),
            num_new=_int32([1, 1], "cpu"),
            qo_indptr=_int32([0, 1, 3], "cpu"),
            **ok,
        )
    with pytest.raises(ValueError, match="reaches past"):
        build_token_metadata_reference(
            start_pos=_int32([0, 7], "cpu"),
            num_new=_int32([1, 2], "cpu"),
            qo_indptr=_int32([0, 1, 3], "cpu"),
            **ok,
        )
    with pytest.raises(ValueError, match="qo_indptr must be"):
        build_token_metadata(
            start_pos=_int32([0, 0], "cpu"),
            num_new=_int32([1, 2], "cpu"),
            qo_indptr=_int32([0, 3], "cpu"),
            **ok,
        )


# ---------------------------------------------------------------- rmsnorm


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-3)]
)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("num_tokens, hidden", [(0, 64), (1, 64), (7, 200)])
def test_rmsnorm_matches_reference(device, dtype, tol, with_residual, num_tokens, hidden):
    gen = torch.Generator().manual_seed(num_tokens * 7 + hidden)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype) if with_residual else None
    expected = rmsnorm_reference(x, weight, 1e-6, residual)
    x_dev = x.to(device)
    residual_dev = residual.to(device) if with_residual else None
    got = rmsnorm(x_dev, weight.to(device), 1e-6, residual_dev)
    assert got.out.dtype == dtype and got.out.shape == x.shape
    torch.testing.assert_close(got.out.cpu(), expected.out, rtol=tol, atol=tol)
    torch.testing.assert_close(got.new_residual.cpu(), expected.new_residual, rtol=tol, atol=tol)
    if with_residual:  # inputs are left alone
        assert torch.equal(x_dev.cpu(), x) and torch.equal(residual_dev.cpu(), residual)
    else:
        assert got.new_residual is x_dev


def test_rmsnorm_strided_rows_and_float32_weight(device):
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(5, 300, generator=gen).to(torch.bfloat16)
    x, residual = wide[:, :96], wide[:, 100:196]  # row stride 300
    weight = torch.randn(96, generator=gen)  # float32 weight, bf16 activations
    expected = rmsnorm_reference(x, weight, 1e-5, residual)
    got = rmsnorm(x.to(device), weight.to(device), 1e-5, residual.to(device))
    torch.testing.assert_close(got.out.cpu(), expected.out, rtol=1e-2, atol=1e-2)
    _assert_equal_but_interpreter_bf16_rounding(got.new_residual.cpu(), expected.new_residual)


def test_rmsnorm_rejects_bad_shapes():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="weight must be"):
        rmsnorm(x, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        rmsnorm(x, torch.ones(8), 1e-6, torch.zeros(2, 8, dtype=torch.bfloat16))


# ---------------------------------------------------------------- without triton


def _run_python(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_import_does_not_import_triton():
    _run_python(
        "import sys, radixrt.kernels as K\n"
        "assert 'triton' not in sys.modules, 'radixrt.kernels imported triton'\n"
        "assert K.HAS_TRITON\n"
    )


def test_import_without_triton_fails_only_when_a_kernel_runs():
    _run_python("""
import sys
sys.modules["triton"] = None  # makes `import triton` fail, as when it is not installed
import torch
import radixrt.kernels as K
assert not K.HAS_TRITON
kv = torch.zeros(2, 2, 2, 1, 4)
slots = torch.tensor([1])
k = torch.ones(1, 1, 4)
K.store_kv_reference(kv, slots, k, k)
assert kv[0, 0, 1].eq(1).all()
try:
    K.store_kv(kv, slots, k, k)
except ImportError as e:
    assert "needs Triton" in str(e), e
else:
    raise AssertionError("store_kv ran without triton")
""")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_rows", [0, 1, 4, 9])
@pytest.mark.parametrize("decode", [False, True])
def test_host_metadata_matches_reference(block_size, num_rows, decode):
    """The numpy version (the runner's off CUDA) equals the references, dtypes included: rows
    with 0..many new tokens, or (decode) one token each, the rows' tables picked by slot."""
    from radixrt.kernels.block_table_host import build_host_metadata

    gen = torch.Generator().manual_seed(num_rows * 10 + block_size + 2)
    max_blocks = 6
    table = _random_table(gen, num_rows, max_blocks)
    start_pos, num_new, qo_indptr = _token_batch(gen, num_rows, max_blocks, block_size)
    if decode:
        start_pos = [min(s, max_blocks * block_size - 1) for s in start_pos]
        num_new, qo_indptr = [1] * num_rows, list(range(num_rows + 1))
    # a row always has KV after the step (an empty row here: a cached token)
    start_pos = [max(s, 1 - n) for s, n in zip(start_pos, num_new)]
    args = tuple(_int32(a, "cpu") for a in (start_pos, num_new, qo_indptr))
    expected = build_token_metadata_reference(table, *args, qo_indptr[-1], block_size)
    seq_lens = args[0] + args[1]
    expected_kv = build_kv_metadata_reference(table, seq_lens, block_size)
    # the runner's tables hold more slots than rows: rows read theirs by slot
    slots = torch.randperm(num_rows + 3, generator=gen)[:num_rows]
    all_tables = torch.zeros(num_rows + 3, max_blocks + 2, dtype=torch.int32)
    all_tables[slots, :max_blocks] = table
    got = build_host_metadata(
        all_tables.numpy(),
        slots.numpy(),
        *(a.numpy() for a in args),
        block_size,
        num_decode=num_rows if decode else 0,
    )
    for name, b in zip(expected._fields, expected):
        a = torch.from_numpy(getattr(got, name))
        assert a.dtype == torch.int64 and torch.equal(a, b), name
    kv = [torch.from_numpy(getattr(got, f)) for f in expected_kv._fields]
    _assert_kv_metadata_equal(type(expected_kv)(*kv), expected_kv)
    assert torch.equal(torch.from_numpy(got.seq_lens), seq_lens)  # int32 both
