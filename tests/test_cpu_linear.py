"""CPU fast paths of the model layers against the plain torch formulas they replace."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from radixrt.model.layers import RotaryEmbedding
from radixrt.model.linear import (
    EXACT_ROWS,
    PACKED_MIN_ROWS,
    Linear,
    can_prepack,
    padded_rows,
    prepack_linears,
)

needs_onednn = pytest.mark.skipif(
    not can_prepack(torch.empty(1)), reason="oneDNN (mkldnn) is not built into this torch"
)


def _linear(inp: int, out: int, bias: bool, **kw) -> Linear:
    torch.manual_seed(0)
    lin = Linear(inp, out, bias=bias, **kw)
    with torch.no_grad():
        lin.weight.uniform_(-0.1, 0.1)
        if bias:
            lin.bias.uniform_(-0.1, 0.1)
    return lin


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, PACKED_MIN_ROWS - 1, PACKED_MIN_ROWS, 128, 130, 300])
@pytest.mark.parametrize("shape", [(192, 320, False), (512, 192, False), (64, 48, True)])
def test_packed_linear_matches_f_linear(rows: int, shape: tuple[int, int, bool]) -> None:
    inp, out, bias = shape
    lin = _linear(inp, out, bias)
    x = torch.randn(rows, inp)
    with torch.inference_mode():
        plain = F.linear(x, lin.weight, lin.bias)
        assert lin.prepack() and lin.is_packed
        fast = lin(x)
    assert fast.shape == plain.shape and fast.is_contiguous()
    # a different summation order only: float32 rounding, relative to the output's scale
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5 * plain.abs().max().item())
    if rows < PACKED_MIN_ROWS:
        assert torch.equal(fast, plain)  # few rows: F.linear itself


@needs_onednn
def test_row_parts_and_stale_weight() -> None:
    lin = _linear(96, 64, True, row_parts=((0, 32), (32, 64)))
    x = torch.randn(PACKED_MIN_ROWS * 2, 96)
    assert prepack_linears(torch.nn.Sequential(lin)) == 1
    with torch.inference_mode():
        for start, stop in lin.row_parts:
            part = lin.forward_rows(x, start, stop)
            want = F.linear(x, lin.weight[start:stop], lin.bias[start:stop])
            assert part.is_contiguous()
            torch.testing.assert_close(part, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # a changed weight: the packed copies are stale, F.linear is used
    assert not lin.is_packed
    with torch.inference_mode():
        assert torch.equal(lin.forward_rows(x, 0, 32), F.linear(x, lin.weight[:32], lin.bias[:32]))
    with pytest.raises(ValueError, match="row_parts"):
        Linear(8, 8, row_parts=((4, 12),))


def test_not_packed_off_float32() -> None:
    lin = Linear(16, 16).to(torch.bfloat16)
    assert not lin.prepack() and not lin.is_packed
    x = torch.randn(PACKED_MIN_ROWS, 16, dtype=torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


def _hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF Llama: x * cos + rotate_half(x) * sin, cos/sin [T, 1, d] (halves repeated)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_hf_formula_bitwise(dtype: torch.dtype) -> None:
    rope = RotaryEmbedding(32, 512, 10000.0, None)
    positions = torch.randint(0, 512, (37,))
    q = torch.randn(37, 6, 32, dtype=dtype)
    k = torch.randn(37, 2, 32, dtype=dtype)
    inputs = rope.prepare(positions, q)
    rq, rk = rope(inputs, q, k)
    cos, sin = rope.cos_sin[positions].chunk(2, dim=-1)
    cos = torch.cat([cos, cos], dim=-1).unsqueeze(1).to(dtype)
    sin = torch.cat([sin, sin], dim=-1).unsqueeze(1).to(dtype)
    assert torch.equal(rq, _hf_rope(q, cos, sin)) and torch.equal(rk, _hf_rope(k, cos, sin))
    # strided views of a merged qkv output, as the attention layer passes them
    qkv = torch.randn(37, 6 * 32 + 2 * 2 * 32, dtype=dtype)
    qv = qkv[:, : 6 * 32].view(37, 6, 32)
    kv = qkv[:, 6 * 32 : 8 * 32].view(37, 2, 32)
    rq, rk = rope(inputs, qv, kv)
    assert torch.equal(rq, _hf_rope(qv, cos, sin)) and torch.equal(rk, _hf_rope(kv, cos, sin))


@pytest.mark.parametrize("rows", [3, PACKED_MIN_ROWS * 2])
def test_mlp_split_gate_up_matches_fused(rows: int) -> None:
    from radixrt.config import ModelConfig
    from radixrt.model.layers import silu_and_mul
    from radixrt.model.llama import MLP
    from radixrt.tp_shard import TPShard

    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=96,
        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    mlp = MLP(cfg, TPShard.of(cfg, 0, 1), None)
    with torch.no_grad():
        for p in mlp.parameters():
            p.uniform_(-0.2, 0.2)
    prepack_linears(mlp)
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        fused = F.linear(silu_and_mul(F.linear(x, mlp.gate_up_proj.weight)), mlp.down_proj.weight)
        torch.testing.assert_close(mlp(x), fused, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("shape", "with_residual"),  # a residual comes with 2-D hidden states only
    [
        ((5, 192), False),
        ((300, 64), False),
        ((7, 4, 32), False),
        ((5, 192), True),
        ((300, 64), True),
    ],
)
def test_rmsnorm_float32_equals_hf_formula_bitwise(shape, with_residual) -> None:
    """The torch float32 path (torch.rms_norm) against HF LlamaRMSNorm's formula."""
    from radixrt.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(len(shape))
    norm = RMSNorm(shape[-1], 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=gen)
    x, res = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    with torch.no_grad():
        got = norm(x, res) if with_residual else norm(x)
        h = x + res if with_residual else x
        want = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))
    if with_residual:
        assert torch.equal(got[0], want) and torch.equal(got[1], h)
    else:
        assert torch.equal(got, want)


def test_padded_rows_bound_the_shapes() -> None:
    sizes = {padded_rows(r) for r in range(1, 8192)}
    # exact below 64, then 8 per doubling up to 8,192 (8,191 rounds up to it)
    assert len(sizes) == (EXACT_ROWS - 1) + 7 * 8 + 1
    for r in range(1, 8193):
        p = padded_rows(r)
        assert r <= p and (r < EXACT_ROWS or (p - r) * 8 < r), (r, p)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@needs_onednn
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RSS from /proc")
def test_many_row_counts_keep_rss_bounded() -> None:
    """oneDNN caches a primitive per input shape (~0.7 MB each here): 1,000 distinct row counts
    through the packed path without row padding grew RSS ~690 MB; padded, ~30 MB."""
    lin = _linear(128, 256, True)
    assert lin.prepack()
    x = torch.randn(1100, 128)
    with torch.inference_mode():
        lin(x[:EXACT_ROWS])  # oneDNN's own start-up
        before = _rss_mb()
        for rows in range(EXACT_ROWS, EXACT_ROWS + 1000):
            lin(x[:rows])
    assert _rss_mb() - before < 200
