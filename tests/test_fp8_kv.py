"""fp8 KV cache (kv_cache_dtype="fp8_e4m3") on CPU: config, pool quantization, the Triton store
kernel (interpreted), copy-on-write blocks, both torch backends, checkpoint kv scales, and the
tiny model end to end (log-prob difference vs the float32 pool, greedy agreement).

Measured on the trained tiny model (float32 weights, 8 text prompts, 24 greedy tokens each,
scales 1.0; torch and torch-reference alike): mean |log-prob difference| per token 0.0083
nats, max 0.103, greedy token agreement 88.5% (7 of 8 outputs identical). Asserted in
test_fp8_engine_close_to_fp32_pool: mean <= 0.03, max <= 0.3, agreement >= 75%.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixrt.config import CacheConfig, resolve_config
from radixrt.kv.pool import FP8_DTYPE, KVPool, kv_storage_dtype, num_blocks_for_memory
from radixrt.kv.scales import FP8_E4M3_MAX, KVScales

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `benchmarks` is a top-level folder, not part of the package
    sys.path.insert(0, ROOT)

from benchmarks.bench_fp8 import compare, greedy, teacher_forced  # noqa: E402

PROMPTS = [
    "Once upon a time there was a little",
    "The cat sat on the",
    "Q: What color is the sky?\nA:",
    "Tom and Lily went to the park. They",
    "The sun was shining and the birds",
    "User: Hello! Who are you?\nAssistant:",
    "One day a small dog found a",
    "Q: What do bees make?\nA:",
]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


# ---------------------------------------------------------------- config and sizing


@pytest.mark.parametrize("bad", ["fp8", "bfloat16", "FP8_E4M3", "", None])
def test_bad_kv_cache_dtype_is_value_error_naming_the_field(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype.*'auto', 'fp8_e4m3'"):
        CacheConfig(kv_cache_dtype=bad)


def test_kv_cache_dtype_option_and_cli():
    from radixrt.cli import _engine_args, engine_options

    cfg = resolve_config("m", "cpu", "float32", detect_devices=False, kv_cache_dtype="fp8_e4m3")
    assert cfg.cache.kv_fp8 and not CacheConfig().kv_fp8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_config("m", "cpu", "float32", detect_devices=False, kv_cache_dtype="int8")
    import argparse

    p = argparse.ArgumentParser()
    _engine_args(p)
    assert "kv_cache_dtype" not in engine_options(p.parse_args([]))  # the engine default: auto
    opts = engine_options(p.parse_args(["--kv-cache-dtype", "fp8_e4m3"]))
    assert opts["kv_cache_dtype"] == "fp8_e4m3"
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("fp8_e4m3", torch.bfloat16) == FP8_DTYPE


def test_fp8_pool_holds_twice_the_tokens_of_bf16_in_the_same_memory():
    shape = (32, 16, 8, 128)  # Llama-3-8B: layers, block size, kv heads, head dim
    bf16 = KVPool.bytes_per_block(*shape, torch.bfloat16)
    fp8 = KVPool.bytes_per_block(*shape, FP8_DTYPE)
    assert bf16 == 2 * fp8 == 2 * 32 * 2 * 16 * 8 * 128
    free, total = 120 * 2**30, 141 * 2**30
    n_bf16 = num_blocks_for_memory(free, total, 0.85, bf16)
    n_fp8 = num_blocks_for_memory(free, total, 0.85, fp8)
    assert n_bf16 > 0 and n_fp8 in (2 * n_bf16, 2 * n_bf16 + 1)


def test_kv_scales_validation():
    with pytest.raises(ValueError, match="scales must be finite and > 0"):
        KVScales((1.0, 0.0), (1.0, 1.0), "x")
    with pytest.raises(ValueError, match="2 k scales but 1 v"):
        KVScales((1.0, 1.0), (1.0,), "x")
    with pytest.raises(ValueError, match="fp8 pool"):
        KVPool(2, 2, 4, 1, 8, torch.float32, "cpu", scales=KVScales.ones(2))
    with pytest.raises(ValueError, match="cover 1 layers"):
        KVPool(2, 2, 4, 1, 8, FP8_DTYPE, "cpu", scales=KVScales.ones(1))


# ---------------------------------------------------------------- pool and kernels


def _fp8_pool(scales: KVScales | None = None, num_blocks: int = 6) -> KVPool:
    return KVPool(2, num_blocks, 4, 2, 8, FP8_DTYPE, "cpu", scales=scales)


def test_store_quantizes_with_the_layer_scales_and_clamps():
    gen = torch.Generator().manual_seed(0)
    pool = _fp8_pool(KVScales((1.0, 2.0), (1.0, 0.25), "test"))
    assert pool.is_fp8 and pool.kv.element_size() == 1 and pool.kv_cache_dtype == "fp8_e4m3"
    slots = torch.tensor([3, 0, 17, 9])
    k = torch.randn(4, 2, 8, generator=gen) * 3
    v = torch.randn(4, 2, 8, generator=gen)
    k[0, 0, 0], v[1, 1, 1], k[2, 0, 3] = 1e4, -1e4, -901.0  # beyond 448 * scale
    pool.store(1, slots, k, v)
    flat_k = pool.k_cache(1).reshape(-1, 2, 8)[slots]
    flat_v = pool.v_cache(1).reshape(-1, 2, 8)[slots]
    expected_k = (k / 2.0).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    expected_v = (v / 0.25).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    assert torch.equal(_bytes(flat_k), _bytes(expected_k))
    assert torch.equal(_bytes(flat_v), _bytes(expected_v))
    assert not torch.isnan(pool.kv.float()).any(), "an unclamped value became NaN"
    assert flat_k[0, 0, 0].item() == 448.0 and flat_v[1, 1, 1].item() == -448.0
    assert not pool.kv[0].float().any(), "layer 0 was written"
    # dequantized: within e4m3's half-ulp (2^-4 relative) where not clamped
    dk, dv = pool.dequantize(1, flat_k, flat_v, torch.float32)
    ok = (k / 2.0).abs().clamp(min=2**-6) < FP8_E4M3_MAX
    rel = ((dk - k).abs() / k.abs().clamp(min=2**-5))[ok]
    assert rel.max() <= 2**-4 + 1e-6
    assert torch.allclose(dv[0], v[0], rtol=2**-4, atol=2**-9)


def _assert_fp8_equal_but_interpreter_carry(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Byte-equal, except under Triton's interpreter (3.9, CPU), whose float32 -> fp8 cast is
    not round-to-nearest-even: it rounds ties away from even (136 -> 144, not 128) and loses
    the carry when rounding up crosses a power of two (127.3 -> 64, not 128). There a value
    may be one e4m3 step off, or half a power of two. GPUs convert in hardware
    (cvt.rn.satfinite): exact."""
    got, expected = got.cpu(), expected.cpu()
    differ = _bytes(got) != _bytes(expected)
    if torch.cuda.is_available() or not differ.any():
        assert not differ.any()
        return
    e, g = expected.float()[differ], got.float()[differ]
    mantissa, exponent = torch.frexp(e.abs())
    carry_lost = (mantissa == 0.5) & (g == e / 2)
    step = torch.ldexp(torch.ones_like(e), exponent - 4)  # e4m3: 3 mantissa bits
    one_step = (g - e).abs() <= torch.maximum(step, torch.full_like(e, 2.0**-9))
    assert (carry_lost | one_step).all(), list(zip(e.tolist(), g.tolist()))[:5]
    assert differ.float().mean() < 0.1


def test_store_kv_triton_fp8_matches_reference_and_pool():
    """The Triton store kernel (interpreted on CPU) writes the bytes the torch reference and
    KVPool.store write, scales and clamping included."""
    from radixrt.kernels import HAS_TRITON, store_kv, store_kv_reference

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("CPU run without TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(1)
    pool = KVPool(2, 5, 4, 3, 24, FP8_DTYPE, "cpu", scales=KVScales((1.0, 0.5), (3.0, 1.0), "t"))
    slots = torch.randperm(20, generator=gen)[:11]
    k = torch.randn(11, 3, 24, generator=gen) * 200  # some beyond 448 * scale
    v = torch.randn(11, 3, 24, generator=gen) * 200
    expected = pool.kv[1].clone()
    store_kv_reference(expected, slots, k, v, 0.5, 1.0)
    pool.store(1, slots, k, v)
    assert torch.equal(_bytes(pool.kv[1]), _bytes(expected))
    kv = torch.zeros_like(pool.kv[1]).to(dev)
    store_kv(kv, slots.to(dev), k.to(dev), v.to(dev), 0.5, 1.0)
    _assert_fp8_equal_but_interpreter_carry(kv, expected)
    bf16 = k.to(dev, torch.bfloat16)  # a bf16 model's K: cast in the kernel, then quantized
    kv.zero_()
    store_kv(kv, slots.to(dev), bf16, bf16, 2.0, 2.0)
    ref = torch.zeros_like(pool.kv[1])
    store_kv_reference(ref, slots, bf16.cpu(), bf16.cpu(), 2.0, 2.0)
    _assert_fp8_equal_but_interpreter_carry(kv, ref)


def test_copy_block_on_fp8_pool_copies_the_stored_bytes():
    gen = torch.Generator().manual_seed(2)
    pool = _fp8_pool(KVScales((0.5, 2.0), (1.0, 1.5), "t"))
    slots = torch.arange(24)
    pool.store(0, slots, torch.randn(24, 2, 8, generator=gen), torch.randn(24, 2, 8, generator=gen))
    pool.store(1, slots, torch.randn(24, 2, 8, generator=gen), torch.randn(24, 2, 8, generator=gen))
    before = _bytes(pool.kv).clone()
    pool.copy_prefix(1, 4, 3)
    after = _bytes(pool.kv)
    assert torch.equal(after[:, :, 4, :3], before[:, :, 1, :3])
    assert torch.equal(after[:, :, 4, 3:], before[:, :, 4, 3:])
    after[:, :, 4] = before[:, :, 4]
    assert torch.equal(after, before), "a block other than the destination changed"


# ---------------------------------------------------------------- attention backends


@pytest.mark.parametrize("kind", ["decode", "extend", "mixed"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_torch_backends_on_fp8_pool_equal_fp32_pool_of_dequantized_values(kind, block_size):
    """Both torch backends attending over an fp8 pool (scales != 1) give what the exact
    reference gives over a float32 pool holding the dequantized values."""
    from test_cpu_attention import make_batch, random_rows

    from radixrt.attention.sdpa_backend import SdpaAttentionBackend
    from radixrt.attention.torch_backend import TorchAttentionBackend

    heads, kv_heads, d, layers = 4, 2, 16, 2
    gen = torch.Generator().manual_seed(block_size * 10 + len(kind))
    rows, num_decode = random_rows(kind, gen)
    batch, num_blocks = make_batch(rows, num_decode, block_size, gen)
    scales = KVScales((0.05, 0.02), (0.03, 0.1), "t")
    pools = {
        name: KVPool(layers, num_blocks, block_size, kv_heads, d, FP8_DTYPE, "cpu", scales)
        for name in ("sdpa", "ref")
    }
    exact = KVPool(layers, num_blocks, block_size, kv_heads, d, torch.float32, "cpu")
    cached = torch.randn(exact.kv.shape, generator=gen) * 2  # [L, 2, blocks, B, H, D]
    for layer in range(layers):
        for i, s in enumerate((scales.k[layer], scales.v[layer])):
            q8 = (cached[layer, i] / s).clamp(-448, 448).to(FP8_DTYPE)
            for p in pools.values():
                p.kv[layer, i] = q8
            exact.kv[layer, i] = q8.float() * s
    backends = {
        "sdpa": SdpaAttentionBackend(heads, kv_heads, d),
        "ref": TorchAttentionBackend(heads, kv_heads, d),
    }
    oracle = TorchAttentionBackend(heads, kv_heads, d)
    for b in (*backends.values(), oracle):
        b.prepare(batch)
    for layer in range(layers):
        q = torch.randn(batch.num_tokens, heads, d, generator=gen)
        k = torch.randn(batch.num_tokens, kv_heads, d, generator=gen) * 2
        v = torch.randn(batch.num_tokens, kv_heads, d, generator=gen) * 2
        kq, vq = pools["ref"].quantize(layer, k, v)
        kd, vd = pools["ref"].dequantize(layer, kq, vq, torch.float32)
        expected = oracle.forward(layer, q, kd, vd, exact)
        for name, backend in backends.items():
            out = backend.forward(layer, q, k, v, pools[name])
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=name)
    assert torch.equal(_bytes(pools["sdpa"].kv), _bytes(pools["ref"].kv))


def test_fp8_on_a_backend_without_an_fp8_path_fails_at_construction(monkeypatch):
    import radixrt.attention as attention
    from radixrt.attention.flashinfer_backend import check_fp8_kv_capability
    from radixrt.config import ModelConfig

    class NoFp8:  # a backend without an fp8 KV path
        supports_fp8_kv = False

    monkeypatch.setattr(attention, "_create", lambda *a: NoFp8())
    cfg = ModelConfig("LlamaForCausalLM", 64, 64, 64, 1, 4, 2, 16)
    dev = torch.device("cpu")
    with pytest.raises(ValueError, match="has no fp8 KV path.*kv_cache_dtype='auto'"):
        attention.create_attention_backend("torch", cfg, dev, torch.float32, FP8_DTYPE)
    assert isinstance(attention.create_attention_backend("torch", cfg, dev, torch.float32), NoFp8)
    with pytest.raises(ValueError, match="compute capability >= 8.9.*A100.*8.0"):
        check_fp8_kv_capability((8, 0), "A100")
    check_fp8_kv_capability((8, 9), "L4")
    check_fp8_kv_capability((9, 0), "H200")


def test_decode_attention_kernel_choice():
    """ "auto" picks XQA for an fp8 cache on Hopper only; explicit choices are checked where
    they cannot be honoured (another backend, XQA's block sizes, pre-Hopper GPUs)."""
    import radixrt.attention as attention
    from radixrt.attention.flashinfer_backend import pick_decode_kernel
    from radixrt.config import ModelConfig

    bf16 = torch.bfloat16
    assert pick_decode_kernel("auto", FP8_DTYPE, (9, 0)) == "xqa"
    assert pick_decode_kernel("auto", bf16, (9, 0)) == "fa2"
    assert pick_decode_kernel("auto", FP8_DTYPE, (8, 9)) == "fa2"
    assert pick_decode_kernel("auto", FP8_DTYPE, (10, 0)) == "fa2"  # not measured there
    assert pick_decode_kernel("fa2", FP8_DTYPE, (9, 0)) == "fa2"
    assert pick_decode_kernel("xqa", bf16, (9, 0)) == "xqa"
    with pytest.raises(ValueError, match="compute capability >= 9.0"):
        pick_decode_kernel("xqa", FP8_DTYPE, (8, 9))
    with pytest.raises(ValueError, match="decode_kernel must be one of"):
        pick_decode_kernel("fa3", FP8_DTYPE, (9, 0))
    base = dict(detect_devices=False, kv_cache_dtype="fp8_e4m3")
    assert resolve_config("m", "cpu", "float32", **base).decode_attention_kernel == "auto"
    with pytest.raises(ValueError, match="decode_attention_kernel must be one of"):
        resolve_config("m", "cpu", "float32", decode_attention_kernel="fa3", **base)
    with pytest.raises(ValueError, match="picks a flashinfer kernel; attention_backend is 'torch'"):
        resolve_config("m", "cpu", "float32", decode_attention_kernel="fa2", **base)
    with pytest.raises(ValueError, match="block sizes 16, 32, 64 or 128, got block_size=8"):
        resolve_config(
            "m", "cuda", "bfloat16", attention_backend="flashinfer",
            decode_attention_kernel="xqa", block_size=8, **base,
        )  # fmt: skip
    cfg = ModelConfig("LlamaForCausalLM", 64, 64, 64, 1, 4, 2, 16)
    with pytest.raises(ValueError, match="'xqa' is a flashinfer kernel; backend 'torch'"):
        attention.create_attention_backend(
            "torch", cfg, torch.device("cpu"), torch.float32, decode_kernel="xqa"
        )


def test_flashinfer_on_cpu_with_fp8_is_a_clear_error(tiny_model_dir):
    from radixrt import Engine

    with pytest.raises(ValueError, match="flashinfer attention backend needs a CUDA device"):
        Engine(tiny_model_dir, device="cpu", attention_backend="flashinfer",
               kv_cache_dtype="fp8_e4m3")  # fmt: skip


# ---------------------------------------------------------------- engine on the tiny model


def _ids(engine, prompts: list[str]) -> list[list[int]]:
    return [engine.tokenizer.encode(p) for p in prompts]


@pytest.mark.parametrize("backend", ["torch", "torch-reference"])
def test_fp8_engine_close_to_fp32_pool(make_engine, backend):
    """Per-token log-prob difference of the fp8 pool vs the float32 pool, teacher-forced on
    the float32 engine's greedy tokens, and greedy agreement. Measured (both backends alike):
    mean |dlogp| 0.0083, max 0.103, token agreement 88.5%, 7/8 outputs identical."""
    opts = dict(attention_backend=backend, num_kv_blocks=256)
    ref = make_engine(**opts)
    fp8 = make_engine(kv_cache_dtype="fp8_e4m3", **opts)
    assert fp8.core.runner.pool.is_fp8 and not ref.core.runner.pool.is_fp8
    assert fp8.stats()["kv_fp8"] == 1.0 and fp8.stats()["kv_tokens_total"] == 256 * 16
    prompts = _ids(ref, PROMPTS)
    reference = greedy(ref, prompts, 24)
    outputs = greedy(fp8, prompts, 24)
    forced = teacher_forced(fp8, prompts, [ids for ids, _ in reference])
    q = compare(reference, [ids for ids, _ in outputs], forced)
    print(f"\n{backend}: {q}")
    assert q.num_tokens == 24 * len(PROMPTS)
    assert q.mean_abs_logprob_diff <= 0.03, q
    assert q.max_abs_logprob_diff <= 0.3, q
    assert q.token_agreement >= 0.75, q
    # the float32 engine scoring its own tokens reproduces its log-probs (the harness is exact)
    self_forced = teacher_forced(ref, prompts, [ids for ids, _ in reference])
    assert (
        compare(reference, [ids for ids, _ in reference], self_forced).max_abs_logprob_diff < 1e-4
    )


def test_fp8_engine_prefix_cache_copy_on_write_matches_no_cache(make_engine):
    """Radix reuse on an fp8 pool (whole shared blocks and copy-on-write partial blocks, i.e.
    CopyBlock ops on fp8 storage) gives the same greedy tokens as recomputing everything."""
    from radixrt import SamplingParams

    shared = "Once upon a time there was a little girl named Lily. She liked to"
    prompts = [shared + tail for tail in (" play", " run in the park", " eat", " sing a song")]
    sp = SamplingParams(max_tokens=12, temperature=0)
    none = make_engine(kv_cache_dtype="fp8_e4m3", prefix_cache="none", num_kv_blocks=128)
    radix = make_engine(kv_cache_dtype="fp8_e4m3", prefix_cache="radix", num_kv_blocks=128)
    expected = [o.token_ids for o in none.generate(prompts, sp)]
    got = []
    for p in prompts:  # one at a time: each later prompt matches the tree mid-block
        got += [o.token_ids for o in radix.generate([p], sp)]
    radix.check_integrity()
    stats = radix.stats()
    assert stats["cached_tokens"] > 0 and stats["cow_copies"] > 0, stats
    assert got == expected


def _checkpoint_with_scales(src: str, dst: str, scales: dict[str, float]) -> str:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name != "model.safetensors":
            shutil.copy(os.path.join(src, name), dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors.update({k: torch.tensor(v, dtype=torch.float32) for k, v in scales.items()})
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def test_checkpoint_kv_scales_are_read_for_fp8_and_skipped_by_the_loader(
    tiny_model_dir, tmp_path, make_engine
):
    from radixrt import SamplingParams
    from radixrt.model.kv_scales import is_kv_scale_name, load_kv_scales

    k = [0.02, 0.03, 0.04, 0.05]
    v = [0.01, 0.02, 0.015, 0.025]
    names = {f"model.layers.{i}.self_attn.k_scale": k[i] for i in range(4)}
    names |= {f"model.layers.{i}.self_attn.v_scale": v[i] for i in range(4)}
    model = _checkpoint_with_scales(tiny_model_dir, str(tmp_path / "scaled"), names)
    scales = load_kv_scales(model, 4)
    assert scales is not None and scales.source == model
    assert scales.k == pytest.approx(k) and scales.v == pytest.approx(v)
    assert load_kv_scales(tiny_model_dir, 4) is None
    assert is_kv_scale_name("model.layers.3.self_attn.kv_scale")
    assert is_kv_scale_name("model.layers.0.self_attn.k_proj.output_scale")
    assert not is_kv_scale_name("model.layers.0.self_attn.k_proj.weight")

    sp = SamplingParams(max_tokens=16, temperature=0)
    fp8 = make_engine(model, kv_cache_dtype="fp8_e4m3", num_kv_blocks=64)
    assert fp8.core.runner.pool.scales == scales
    auto = make_engine(model, num_kv_blocks=64)  # the loader skips the scale tensors
    assert not auto.core.runner.pool.is_fp8
    plain = make_engine(num_kv_blocks=64)
    a, b, c = (e.generate(PROMPTS[:4], sp) for e in (fp8, auto, plain))
    assert [o.token_ids for o in b] == [o.token_ids for o in c]
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
    assert same >= 2, "fp8 with the checkpoint's scales strays far from float32"


def test_checkpoint_kv_scale_forms(tmp_path, tiny_model_dir):
    from radixrt.model.kv_scales import load_kv_scales

    src = tiny_model_dir
    one = _checkpoint_with_scales(
        src, str(tmp_path / "one"), {"model.layers.1.self_attn.kv_scale": 0.5}
    )
    s = load_kv_scales(one, 4)
    assert s.k == (1.0, 0.5, 1.0, 1.0) and s.v == (1.0, 0.5, 1.0, 1.0)
    proj = _checkpoint_with_scales(
        src, str(tmp_path / "proj"), {"model.layers.2.self_attn.v_proj.output_scale": 0.25}
    )
    assert load_kv_scales(proj, 4).v == (1.0, 1.0, 0.25, 1.0)
    bad = str(tmp_path / "bad")
    _checkpoint_with_scales(src, bad, {})
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.ones(2)  # per head: unsupported
    save_file(tensors, os.path.join(bad, "model.safetensors"))
    with pytest.raises(ValueError, match="only per-tensor"):
        load_kv_scales(bad, 4)
