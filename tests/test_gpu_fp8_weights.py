"""FP8 (W8A8) linear layers on CUDA (compute capability >= 8.9): the cuBLASLt GEMM against
the dequantized math, odd row counts, CUDA graphs, accuracy of the trained tiny model, the
llm-compressor checkpoint, and the load-time memory peak."""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import write_llmcompressor

from benchmarks.bench_fp8_weights import agreement, heldout_texts, teacher_forced
from radixrt import Engine, SamplingParams
from radixrt.hf_dir import load_tokenizer
from radixrt.model import weight_bytes
from radixrt.model.fp8_linear import EPILOGUE_MAX_ROWS, Fp8Linear
from radixrt.quantization import resolve_scheme

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=True)
PROMPTS = [[1, 50, 60, 70, 80, 90, 100], [1, *range(5, 30)], [1, 7, 9]]


@pytest.fixture(autouse=True)
def _needs_fp8_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU of compute capability >= 8.9")


def _layer(mode: str, k: int, n: int, w: torch.Tensor, dequantize: bool) -> Fp8Linear:
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            layer = Fp8Linear(k, n, resolve_scheme(None, "fp8", mode))
    finally:
        torch.set_default_dtype(torch.float32)
    layer.load("weight", w, 0)
    layer.finish_loading(dequantize=dequantize)
    return layer


@pytest.mark.parametrize("mode", ["token", "tensor"])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 64, 300])
def test_gemm_matches_dequantized_math(mode, rows):
    """_scaled_mm (row-wise or tensor-wise) vs the same quantized operands dequantized and
    multiplied in float32; any row count (not only multiples of 16)."""
    k, n = 4096, 1024
    gen = torch.Generator(device="cuda").manual_seed(rows)
    w = torch.empty(n, k, device="cuda").uniform_(-0.02, 0.02, generator=gen).bfloat16()
    x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
    fp8 = _layer(mode, k, n, w, dequantize=False)
    emulated = _layer(mode, k, n, w, dequantize=True)  # the CPU path's math, on the GPU
    got = fp8(x).float()
    want = emulated(x).float()
    assert got.dtype == torch.float32 and fp8(x).dtype == torch.bfloat16
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    exact = x.float() @ w.float().t()
    assert ((got - exact).norm() / exact.norm()).item() < 0.06  # fp8 error, measured ~0.035


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 64, 256, 300])
def test_epilogue_path_matches_the_rowwise_gemm(rows):
    """Per-token activation and per-channel weight scales at M <= EPILOGUE_MAX_ROWS: the
    tensor-wise GEMM + epilogue (`scale_product`, or fused into the next kernel) equals the
    row-wise GEMM up to one more bf16 rounding (2 ulps of a row's size)."""
    k, n = 4096, 1024
    gen = torch.Generator(device="cuda").manual_seed(rows)
    w = torch.empty(n, k, device="cuda").uniform_(-0.02, 0.02, generator=gen).bfloat16()
    x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
    layer = _layer("token", k, n, w, dequantize=False)
    assert layer.epilogue_max_rows == EPILOGUE_MAX_ROWS
    got = layer(x).float()
    layer.epilogue_max_rows = 0
    want = layer(x).float()
    size = want.abs().amax(dim=1, keepdim=True)
    assert ((got - want).abs() <= 2 * 2**-8 * size).all(), (got - want).abs().max()
    if rows > EPILOGUE_MAX_ROWS:
        assert torch.equal(got, want)


def _greedy(path: str, **options):
    engine = Engine(path, device="cuda", num_kv_blocks=2048, **options)
    try:
        outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        engine.check_integrity()
        return outs, engine.core.runner.model
    finally:
        engine.shutdown()


@pytest.mark.parametrize("mode", ["token", "tensor"])
def test_cuda_graphs_match_eager(tiny_model_dir, mode):
    options = dict(quantization="fp8", fp8_activation_scale=mode)
    graph, model = _greedy(tiny_model_dir, enable_cuda_graph=True, **options)
    eager, _ = _greedy(tiny_model_dir, enable_cuda_graph=False, **options)
    assert model.layers[0].fused_fp8 == (mode == "token")
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn
    # token: decode graphs run the tensor-wise GEMM + epilogue; tensor: the per-tensor
    # absmax counts only a graph's real rows (its padding rows feed token 0 at position 0)
    assert qkv.epilogue_max_rows == (EPILOGUE_MAX_ROWS if mode == "token" else 0)
    assert (qkv.num_rows is model.fp8_num_rows is not None) == (mode == "tensor")
    for a, b in zip(graph, eager):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=2e-2
        )


@pytest.fixture(scope="module")
def texts(tiny_model_dir):
    return heldout_texts(load_tokenizer(tiny_model_dir), max_tokens=120)


@pytest.fixture(scope="module")
def bf16_reference(tiny_model_dir, texts):
    engine = Engine(tiny_model_dir, device="cuda", num_kv_blocks=4096, block_size=4)
    yield teacher_forced(engine, texts)
    engine.shutdown()


def _score(path, texts, **options):
    engine = Engine(path, device="cuda", num_kv_blocks=4096, block_size=4, **options)
    try:
        return teacher_forced(engine, texts)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("mode", ["token", "tensor"])
def test_accuracy_against_bf16(tiny_model_dir, texts, bf16_reference, mode):
    """The same thresholds as on CPU (top-1 >= 0.95, mean |delta log-prob| <= 0.04), against
    the bf16 model on the GPU."""
    a = agreement(bf16_reference, _score(tiny_model_dir, texts, quantization="fp8",
                                         fp8_activation_scale=mode))  # fmt: skip
    print(mode, a)
    assert a.top1_agreement >= 0.95 and a.mean_abs_dlogprob <= 0.04, a


def test_llmcompressor_checkpoint_on_gpu(tiny_model_dir, texts, bf16_reference, tmp_path):
    path = write_llmcompressor(tiny_model_dir, str(tmp_path / "fp8"))
    if path is None:
        pytest.skip("llmcompressor is not installed")
    a = agreement(bf16_reference, _score(path, texts))
    print("llmcompressor", a)
    assert a.top1_agreement >= 0.95 and a.mean_abs_dlogprob <= 0.04, a


def test_quantizing_at_load_peaks_below_bf16_plus_one_layer(tmp_path):
    """Dummy Llama-3-8B-shaped layers (4 of them): the peak while quantizing at load stays
    under the bf16 weights plus one layer, and the fp8 weights are ~half."""
    import json

    from radixrt.model.presets import PRESETS, write_dummy_model_dir

    path = write_dummy_model_dir(str(tmp_path / "m"))
    with open(tmp_path / "m" / "config.json") as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 4
    with open(tmp_path / "m" / "config.json", "w") as f:
        json.dump(cfg, f)
    p = PRESETS["llama-3-8b"]
    h, i = p["hidden_size"], p["intermediate_size"]
    kv = p["num_key_value_heads"] * p["head_dim"]
    layer_bf16 = 2 * (h * (h + 2 * kv) + h * h + 3 * h * i)
    bf16_total = 4 * layer_bf16 + 2 * 2 * p["vocab_size"] * h
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    engine = Engine(path, device="cuda", load_format="dummy", quantization="fp8",
                    num_kv_blocks=64, max_model_len=1024, enable_cuda_graph=False)  # fmt: skip
    try:
        model = engine.core.runner.model
        peak = torch.cuda.max_memory_allocated() - base
        assert peak <= bf16_total + layer_bf16, (peak, bf16_total, layer_bf16)
        assert weight_bytes(model) < 0.5 * 4 * layer_bf16 + 2 * 2 * p["vocab_size"] * h + 2**24
    finally:
        engine.shutdown()
