"""The native CPU ops (radixrt.kernels.cpu_ops) against the torch formulas they replace, and
the model layers' native paths against their torch paths."""

from __future__ import annotations

import pytest
import torch

from radixrt.kernels.cpu_ops import CpuOps, load_cpu_ops
from radixrt.model.layers import RMSNorm, RotaryEmbedding, _rotate


@pytest.fixture(scope="module")
def ops(native_kernel) -> CpuOps:  # native_kernel: skips only without a C compiler
    got = load_cpu_ops()
    assert got is not None, "a C compiler exists but cpu_ops did not build"
    return got


def _formula(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm in float32."""
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows", [1, 5, 300, 4096])
@pytest.mark.parametrize("hidden", [64, 192, 37])
def test_rmsnorm_matches_formula(ops: CpuOps, rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows + hidden)
    weight = torch.rand(hidden, generator=gen) + 0.5
    base = torch.randn(rows, hidden + 3, generator=gen) * 3
    x = base[:, 1 : hidden + 1]  # strided rows
    res = torch.randn(rows, hidden, generator=gen)
    want = _formula(x, weight, 1e-5)
    torch.testing.assert_close(ops.rmsnorm(x, weight, 1e-5), want, rtol=2e-6, atol=1e-6)
    xs, rs = x.clone(), res.clone()
    ops.add_rmsnorm_(xs, rs, weight, 1e-5)
    assert torch.equal(rs, x + res)  # the residual sum is exact: one rounded add
    torch.testing.assert_close(xs, _formula(x + res, weight, 1e-5), rtol=2e-6, atol=1e-6)


def test_rmsnorm_threads_agree(ops: CpuOps) -> None:
    x = torch.randn(4096, 192)  # above PARALLEL_MIN_ELEMENTS: split over threads
    weight = torch.rand(192) + 0.5
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.rmsnorm(x, weight, 1e-6)
        torch.set_num_threads(2)
        assert torch.equal(ops.rmsnorm(x, weight, 1e-6), one)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("head_dim", [32, 64, 12])
def test_rope_is_the_torch_formula_bitwise(ops: CpuOps, head_dim: int) -> None:
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None)
    t, hq, hkv = 37, 6, 2
    positions = torch.randint(0, 512, (t,))
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim)
    heads = qkv.view(t, hq + 2 * hkv, head_dim)
    cos = rope.rope_table[positions, :head_dim].unsqueeze(1)
    sin = rope.rope_table[positions, head_dim:].unsqueeze(1)
    want = _rotate(heads[:, : hq + hkv], cos, sin)
    v_before = heads[:, hq + hkv :].clone()
    ops.rope_(heads, hq + hkv, positions, rope.rope_table)
    assert torch.equal(heads[:, : hq + hkv], want)
    assert torch.equal(heads[:, hq + hkv :], v_before)  # heads past num_rotated untouched


def test_rope_position_out_of_range_writes_nothing(ops: CpuOps) -> None:
    rope = RotaryEmbedding(32, 64, 10000.0, None)
    heads = torch.randn(4, 3, 32)
    before = heads.clone()
    with pytest.raises(RuntimeError, match="out of range"):
        ops.rope_(heads, 3, torch.tensor([0, 5, 64, 1]), rope.rope_table)
    assert torch.equal(heads, before)


@pytest.mark.parametrize("tokens", [3, 300])
def test_store_kv_is_index_copy(ops: CpuOps, tokens: int) -> None:
    hkv, d, num_slots = 2, 32, 1024
    qkv = torch.randn(tokens, (6 + 2 * hkv) * d)
    heads = qkv.view(tokens, -1, d)
    k, v = heads[:, 6 : 6 + hkv], heads[:, 6 + hkv :]  # strided views, as the model's
    slots = torch.randperm(num_slots)[:tokens]
    pools = [torch.randn(num_slots, hkv, d) for _ in range(2)]
    pools += [p.clone() for p in pools]
    ops.store_kv(k, v, slots, pools[0], pools[1])
    pools[2].index_copy_(0, slots, k)
    pools[3].index_copy_(0, slots, v)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    bad = slots.clone()
    bad[-1] = num_slots
    before = pools[0].clone()
    with pytest.raises(RuntimeError, match="out of range"):
        ops.store_kv(k, v, bad, pools[0], pools[1])
    assert torch.equal(pools[0], before)


def test_bad_arguments_raise_value_error(ops: CpuOps) -> None:
    w = torch.ones(8)
    with pytest.raises(ValueError, match="float32"):
        ops.rmsnorm(torch.ones(2, 8, dtype=torch.float64), w, 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        ops.rmsnorm(torch.ones(8, 2).t(), w, 1e-5)
    with pytest.raises(ValueError, match="weight"):
        ops.rmsnorm(torch.ones(2, 8), torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match="rows"):
        ops.add_rmsnorm_(torch.ones(2, 8), torch.ones(3, 8), w, 1e-5)
    with pytest.raises(ValueError, match="positions"):
        ops.rope_(torch.ones(2, 1, 8), 1, torch.zeros(2, dtype=torch.int32), torch.ones(4, 16))
    with pytest.raises(ValueError, match="num_rotated"):
        ops.rope_(torch.ones(2, 1, 8), 2, torch.zeros(2, dtype=torch.int64), torch.ones(4, 16))
    with pytest.raises(ValueError, match="slots"):
        kv = torch.ones(2, 1, 8)
        ops.store_kv(kv, kv, torch.zeros(3, dtype=torch.int64), torch.ones(4, 1, 8), kv)


# ---- the layers: native path (inference mode) against the torch path (no_grad) ----


@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_layer_native_path(ops: CpuOps, with_residual: bool) -> None:
    norm = RMSNorm(192, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        x, res = torch.randn(33, 192), torch.randn(33, 192)
        want = norm(x, res) if with_residual else norm(x)  # torch path: not inference mode
    xs, rs = x.clone(), res.clone()
    with torch.inference_mode():
        got = norm(xs, rs) if with_residual else norm(xs)
    if with_residual:  # in place, as FlashInfer's fused_add_rmsnorm
        assert got[0] is xs and got[1] is rs and torch.equal(rs, want[1])
        torch.testing.assert_close(xs, want[0], rtol=2e-6, atol=1e-6)
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        assert torch.equal(xs, x)


def test_rope_layer_native_path_in_place(ops: CpuOps) -> None:
    rope = RotaryEmbedding(32, 512, 10000.0, None)
    positions = torch.randint(0, 512, (37,))
    qkv = torch.randn(37, 6 * 32 + 2 * 2 * 32)
    q, k = qkv[:, : 6 * 32].view(37, 6, 32), qkv[:, 6 * 32 : 8 * 32].view(37, 2, 32)
    with torch.no_grad():
        want_q, want_k = rope(rope.prepare(positions, q), q, k)
    with torch.inference_mode():
        inputs = rope.prepare(positions, q)
        assert inputs.table is not None and inputs.cos is None  # no cos/sin gather
        got_q, got_k = rope(inputs, q, k)
        assert got_q is q and got_k is k  # rotated in place
        assert torch.equal(q, want_q) and torch.equal(k, want_k)
    qc, kc = torch.randn(5, 6, 32), torch.randn(5, 2, 32)  # separate buffers
    with torch.no_grad():
        want_q, want_k = rope(rope.prepare(positions[:5], qc), qc, kc)
    with torch.inference_mode():
        got_q, got_k = rope(rope.prepare(positions[:5], qc), qc.clone(), kc.clone())
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("rows", [1, 32, 4096])
def test_silu_mul_matches_torch(ops: CpuOps, rows: int) -> None:
    inter = 517  # not a multiple of 8: the scalar tail too
    x = torch.randn(rows, 2 * inter) * 6
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    gate, up = x[:, :inter], x[:, inter:]  # strided halves of one gate_up output
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(ops.silu_mul(gate, up), want, rtol=1e-6, atol=1e-6)
    g = gate.contiguous()
    assert ops.silu_mul(g, up, g) is g  # in place
    torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-6)


def test_mlp_activation_layers_native_path(ops: CpuOps) -> None:
    from radixrt.model.layers import silu_and_mul, silu_mul_

    x = torch.randn(9, 64)
    with torch.no_grad():
        want = silu_and_mul(x)
    with torch.inference_mode():
        torch.testing.assert_close(silu_and_mul(x), want, rtol=1e-6, atol=1e-6)
        gate = x[:, :32].contiguous()
        assert silu_mul_(gate, x[:, 32:]) is gate
        torch.testing.assert_close(gate, want, rtol=1e-6, atol=1e-6)
