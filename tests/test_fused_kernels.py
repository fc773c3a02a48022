"""The fused decode kernels (residual add + RMSNorm, RoPE + KV store, SiLU-and-mul) against
their torch references: on CPU under Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py before triton loads) and on CUDA (gpu marker)."""

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from radixrt.kernels import (
    HAS_TRITON,
    rmsnorm,
    rmsnorm_reference,
    rope_reference,
    rope_store_kv,
    rope_store_kv_reference,
    silu_mul,
    silu_mul_reference,
)
from radixrt.model.layers import RotaryEmbedding, _rotate

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    kernel = importlib.import_module("radixrt.kernels._silu_mul_triton").silu_mul_kernel
    return isinstance(kernel, InterpretedFunction)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    if request.param == "cpu" and not _interpreted():
        if torch.cuda.is_available():
            pytest.skip("CPU tensors need TRITON_INTERPRET=1; the cuda case runs instead")
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set")
    return torch.device(request.param)


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to one rounding of the output dtype (2 eps relative at a binade edge): the
    interpreter truncates float32 -> bf16 casts, and a GPU may contract a * b - c * d into
    an fma before rounding."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:
        eps = torch.finfo(got.dtype).eps
        torch.testing.assert_close(got.float(), expected.float(), rtol=2 * eps, atol=eps * 1e-2)


# ---------------------------------------------------------------- silu_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_tokens", "inter"), [(0, 64), (1, 96), (5, 1100)])
def test_silu_mul_matches_reference(device, dtype, num_tokens, inter):
    x = torch.randn(num_tokens, 2 * inter, device=device).mul(3).to(dtype)
    before = x.clone()
    out = silu_mul(x)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype
    _close(out, silu_mul_reference(x))
    assert torch.equal(x, before)  # not mutated


def test_silu_mul_strided_rows(device):
    base = torch.randn(4, 300, device=device, dtype=torch.bfloat16)
    x = base[:, :256]  # rows 300 apart
    _close(silu_mul(x), silu_mul_reference(x))


def test_silu_mul_reference_is_torch_formula():
    x = torch.randn(3, 40, dtype=torch.float64)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul_reference(x), torch.nn.functional.silu(gate) * up)


def test_silu_mul_rejects_bad_shapes():
    with pytest.raises(ValueError, match="2 \\* I"):
        silu_mul(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="2 \\* I"):
        silu_mul(torch.zeros(4))


# ---------------------------------------------------------------- residual add + RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_add_rmsnorm_matches_reference_and_model_norm(device, dtype, num_tokens):
    """The kernel the fused path uses for every decoder norm, against the reference and
    against the model's RMSNorm module on CPU (new residual bitwise, output within a rounding)."""
    from radixrt.model.layers import RMSNorm

    hidden = 96
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    residual = torch.randn(num_tokens, hidden, device=device).to(dtype)
    weight = (torch.rand(hidden, device=device) + 0.5).to(dtype)
    out, new_residual = rmsnorm(x, weight, 1e-5, residual)
    ref_out, ref_residual = rmsnorm_reference(x, weight, 1e-5, residual)
    _close(new_residual, ref_residual)
    _close(out, ref_out)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data.copy_(weight.cpu())
    mod_out, mod_residual = norm(x.cpu(), residual.cpu())
    _close(new_residual.cpu(), mod_residual)
    # the module rounds the normalised row to x's dtype before the weight multiplies it
    torch.testing.assert_close(out.cpu().float(), mod_out.float(), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- rope + store_kv


def _rope_case(device, dtype, num_tokens, hq, hkv, head_dim, pool_dim, kv_dtype, block_size=4):
    gen = torch.Generator().manual_seed(num_tokens * 7 + hq)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * head_dim, generator=gen).to(dtype).to(device)
    q, k, v = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    # strided views of a merged projection, as in the model
    q, k, v = q.view(-1, hq, head_dim), k.view(-1, hkv, head_dim), v.view(-1, hkv, head_dim)
    rope = RotaryEmbedding(head_dim, 512, 10000.0, LLAMA3_SCALING)
    cos_sin = rope.cos_sin.to(device)
    positions = torch.randint(0, 512, (num_tokens,), generator=gen).to(device)
    num_blocks = 8
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    kv = torch.full((2, num_blocks, block_size, hkv, pool_dim), 7.0, device=device).to(kv_dtype)
    return qkv, q, k, v, positions, cos_sin, kv, slots


CASES = [  # (num_tokens, Hq, Hkv, head_dim, pool head dim)
    (1, 4, 2, 16, 16),
    (6, 8, 2, 32, 64),  # padded pool, as FlashInfer's for small test heads
    (3, 6, 6, 80, 128),  # head dim not a power of two
    (0, 4, 2, 16, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "hq", "hkv", "head_dim", "pool_dim"), CASES)
def test_rope_store_kv_matches_reference(device, dtype, num_tokens, hq, hkv, head_dim, pool_dim):
    case = _rope_case(device, dtype, num_tokens, hq, hkv, head_dim, pool_dim, dtype)
    qkv, q, k, v, positions, cos_sin, kv, slots = case
    qkv_ref = qkv.clone()
    q_ref, k_ref, v_ref = (
        t.view(num_tokens, h, head_dim)
        for t, h in zip(
            qkv_ref.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1),
            (hq, hkv, hkv),
            strict=True,
        )
    )
    kv_ref = kv.clone()
    k_before = k.clone()
    rope_store_kv(q, k, v, positions, cos_sin, kv, slots)
    rope_store_kv_reference(q_ref, k_ref, v_ref, positions, cos_sin, kv_ref, slots)
    _close(q, q_ref)
    _close(kv, kv_ref)
    assert torch.equal(k, k_before)  # k is read, not rotated in place
    if num_tokens and pool_dim > head_dim:  # padding columns of written slots are zero
        flat = kv.view(2, -1, hkv, pool_dim)[:, slots]
        assert (flat[..., head_dim:] == 0).all()
    untouched = torch.ones(kv.shape[1] * kv.shape[2], dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert (kv.view(2, -1, hkv, pool_dim)[:, untouched.to(device)].float() == 7.0).all()


def test_rope_reference_matches_model_rotation():
    """The reference rotation is the model's torch RoPE (HF rotate_half) with llama3 scaling."""
    rope = RotaryEmbedding(32, 256, 500000.0, LLAMA3_SCALING)
    x = torch.randn(5, 3, 32, dtype=torch.float64)
    positions = torch.tensor([0, 1, 63, 100, 255])
    cos, sin = rope.cos_sin[positions].double().unsqueeze(1).chunk(2, dim=-1)
    want = _rotate(x, torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1))
    got = rope_reference(x, positions, rope.cos_sin.double())
    torch.testing.assert_close(got, want)


def test_rope_store_kv_fp8_pool(device):
    """fp8 pool: rotated k rounded to bf16, then scaled and cast, as store_kv does."""
    if device.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 casts need compute capability >= 8.9")
    qkv, q, k, v, positions, cos_sin, kv, slots = _rope_case(
        device, torch.bfloat16, 5, 4, 2, 32, 32, torch.float8_e4m3fn
    )
    kv_ref = kv.clone()
    q_ref, k_ref, v_ref = q.clone(), k.clone(), v.clone()
    rope_store_kv(q, k, v, positions, cos_sin, kv, slots, k_scale=0.5, v_scale=2.0)
    rope_store_kv_reference(q_ref, k_ref, v_ref, positions, cos_sin, kv_ref, slots, 0.5, 2.0)
    got, want = kv.cpu().float(), kv_ref.cpu().float()
    differ = got != want
    assert differ.float().mean() < 0.05
    # One e4m3 step (rotated bf16 k may round differently after an fma), or under the
    # interpreter a lost carry (its fp8 cast halves a value that rounds up to a power of 2;
    # see tests/test_fp8_kv.py).
    e, g = want[differ], got[differ]
    mantissa, exponent = torch.frexp(e.abs())
    step = torch.ldexp(torch.ones_like(e), exponent - 4)
    one_step = (g - e).abs() <= torch.maximum(step, torch.full_like(e, 2.0**-9))
    carry_lost = (mantissa == 0.5) & (g == e / 2) & (device.type == "cpu")
    assert (one_step | carry_lost).all(), list(zip(e.tolist(), g.tolist()))[:5]


def test_rope_store_kv_rejects_bad_args():
    q = torch.zeros(2, 4, 16)
    k = v = torch.zeros(2, 2, 16)
    pos = slots = torch.zeros(2, dtype=torch.int64)
    cos_sin = torch.zeros(8, 16)
    kv = torch.zeros(2, 4, 4, 2, 16)
    with pytest.raises(ValueError, match="cos_sin"):
        rope_store_kv(q, k, v, pos, cos_sin[:, :8], kv, slots)
    with pytest.raises(ValueError, match="positions"):
        rope_store_kv(q, k, v, pos.int(), cos_sin, kv, slots)
    with pytest.raises(ValueError, match="kv_layer"):
        rope_store_kv(q, k, v, pos, cos_sin, kv[..., :8], slots)
    with pytest.raises(ValueError, match="q must be"):
        rope_store_kv(q, k[:1], v, pos, cos_sin, kv, slots)
