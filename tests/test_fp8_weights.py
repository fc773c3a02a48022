"""FP8 (W8A8) linear layers on a CPU: checkpoint schemes and refusals, the layer's scale
arithmetic, checkpoints written by other tools (llm-compressor, the ModelOpt layout), the
tensor-parallel split, the GEMM path (Triton kernels under the interpreter + torch's CPU
scaled mm) against the dequantized path, and accuracy against the unquantized trained tiny
model (teacher-forced top-1 agreement >= 0.95 and mean |delta log-prob| <= 0.04 nats; measured
0.98 / 0.021 per token, 0.976 / 0.024 per tensor, 0.977 / 0.022 for llm-compressor's)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from fp8_checkpoints import write_llmcompressor, write_modelopt

import radixrt.model.llama as llama
from benchmarks.bench_fp8_weights import agreement, heldout_texts, teacher_forced
from radixrt import Engine, SamplingParams
from radixrt.config import ModelConfig
from radixrt.hf_dir import load_tokenizer
from radixrt.kernels.fp8_quant import Fp8Product
from radixrt.model import LlamaForCausalLM
from radixrt.model.fp8_linear import EPILOGUE_MAX_ROWS, Fp8Linear, as_tensor
from radixrt.model.loader import iterate_hf_weight_slices, iterate_hf_weights
from radixrt.quantization import Fp8Scheme, checkpoint_scheme, resolve_scheme
from radixrt.tp_shard import TPShard

MIN_TOP1, MAX_MEAN_DLOGPROB = 0.95, 0.04
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=True)
PROMPTS = [[1, 50, 60, 70, 80, 90, 100], [1, *range(5, 30)]]
TOKEN = Fp8Scheme("channel", "token")
TENSOR_STATIC = Fp8Scheme("tensor", "tensor", static_input_scale=True, checkpoint_format="modelopt")


# ---------------------------------------------------------------- schemes


def test_checkpoint_schemes():
    ct = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "type": "float",
                    "num_bits": 8,
                    "strategy": "channel",
                    "symmetric": True,
                    "dynamic": False,
                },
                "input_activations": {
                    "type": "float",
                    "num_bits": 8,
                    "strategy": "token",
                    "symmetric": True,
                    "dynamic": True,
                },
            }  # fmt: skip
        },
    }
    s = checkpoint_scheme(ct)
    assert (s.weight_scale, s.activation_scale, s.static_input_scale) == ("channel", "token", False)
    assert s.quantizes("model.layers.3.mlp.down_proj") and not s.quantizes("lm_head")
    mo = checkpoint_scheme({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8"}})
    assert (mo.weight_scale, mo.activation_scale, mo.static_input_scale) == (
        "tensor",
        "tensor",
        True,
    )
    assert (
        checkpoint_scheme(
            {"quant_method": "fp8", "activation_scheme": "dynamic"}
        ).static_input_scale
        is False
    )  # noqa: E501
    assert resolve_scheme(None, "fp8", "auto") == TOKEN
    assert resolve_scheme(None, "fp8", "tensor") == Fp8Scheme("tensor", "tensor")
    assert resolve_scheme(None, None, "auto") is None
    assert resolve_scheme(s, None, "auto") is s
    with pytest.raises(ValueError, match="the checkpoint fixes 'token'"):
        resolve_scheme(s, "fp8", "tensor")
    with pytest.raises(ValueError, match="needs quantization='fp8'"):
        resolve_scheme(None, None, "token")


@pytest.mark.parametrize(
    "config, named",
    [
        ({"quant_method": "awq", "bits": 4}, "'awq'"),
        ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes'"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "weight_block_size"),
        ({"quant_method": "compressed-tensors", "format": "int-quantized"}, "'int-quantized'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "g": {
                        "weights": {
                            "type": "float",
                            "num_bits": 8,
                            "strategy": "block",
                            "block_structure": [128, 128],
                        },
                        "input_activations": {
                            "type": "float",
                            "num_bits": 8,
                            "strategy": "group",
                            "group_size": 128,
                            "dynamic": True,
                        },
                    }
                },
            },
            "'block'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "g": {
                        "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
                        "input_activations": None,
                    }
                },
            },
            "weight-only",
        ),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "'NVFP4'"),
    ],  # fmt: skip
)
def test_unsupported_configs_are_refused_by_name(tmp_path, tiny_random_model_dir, config, named):
    with pytest.raises(ValueError, match=named):
        checkpoint_scheme(config)
    # at load: the model dir's config.json carries it
    for name in os.listdir(tiny_random_model_dir):
        src = os.path.join(tiny_random_model_dir, name)
        if os.path.isfile(src):
            os.symlink(src, tmp_path / name) if name != "config.json" else None
    with open(os.path.join(tiny_random_model_dir, "config.json")) as f:
        cfg = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**cfg, "quantization_config": config}, f)
    with pytest.raises(ValueError, match=named):
        Engine(str(tmp_path), device="cpu", dtype="float32")


def test_engine_options_are_validated(tiny_random_model_dir):
    with pytest.raises(ValueError, match="quantization must be one of"):
        Engine(tiny_random_model_dir, device="cpu", quantization="int8")
    with pytest.raises(ValueError, match="fp8_activation_scale must be one of"):
        Engine(tiny_random_model_dir, device="cpu", quantization="fp8", fp8_activation_scale="x")


# ---------------------------------------------------------------- the layer


def _layer(scheme: Fp8Scheme, k: int, n: int, shards=()) -> Fp8Linear:
    return Fp8Linear(k, n, scheme, shards=shards)


def _random_fp8(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)


def test_channel_scales_apply_per_output_row():
    """weight_scale [N, 1] scales output row n (not input column n): a swapped axis fails."""
    gen = torch.Generator().manual_seed(0)
    k, n = 32, 48
    wq = _random_fp8(n, k, gen)
    scale = torch.exp2(torch.arange(n) % 7 - 3.0)  # very different per row
    ckpt = Fp8Scheme("channel", "token", checkpoint_format="compressed-tensors")
    layer = _layer(ckpt, k, n)
    layer.load("weight", wq, 0)
    layer.load("weight_scale", scale[:, None].to(torch.bfloat16), 0)
    layer.finish_loading(dequantize=True)
    assert torch.equal(layer.weight, wq.float() * scale[:, None])
    x = torch.randn(5, k, generator=gen)
    xq = torch.stack([_emulate_token(r) for r in x])
    torch.testing.assert_close(layer(x), xq @ (wq.float() * scale[:, None]).t())
    # the GEMM path's operands (fp8 kept): scale_b [1, N] by output column
    _needs_interpreter()
    torch.set_default_dtype(torch.bfloat16)  # row-wise scaled mm outputs bf16 only
    try:
        gemm = _layer(ckpt, k, n)
    finally:
        torch.set_default_dtype(torch.float32)
    gemm.load("weight", wq, 0)
    gemm.load("weight_scale", scale[:, None], 0)
    gemm.finish_loading(dequantize=False)
    assert gemm._scale_b.shape == (1, n) and torch.equal(gemm._scale_b[0], scale)
    torch.testing.assert_close(gemm(x).float(), layer(x), rtol=2e-2, atol=2e-2)


EPILOGUE_SCHEMES = {
    "channel-token": TOKEN,
    "tensor-token": Fp8Scheme("tensor", "token", checkpoint_format="compressed-tensors"),
    "channel-static": Fp8Scheme(
        "channel", "tensor", static_input_scale=True, checkpoint_format="compressed-tensors"
    ),
}


def _gemm_layer(scheme: Fp8Scheme, k: int, n: int, dtype: torch.dtype, gen) -> Fp8Linear:
    torch.set_default_dtype(dtype)
    try:
        layer = _layer(scheme, k, n)
    finally:
        torch.set_default_dtype(torch.float32)
    w = torch.rand(n, k, generator=gen) * 0.04 - 0.02
    w = w * torch.exp2(torch.arange(n) % 5 - 2.0)[:, None]  # rows of different ranges
    if scheme.from_checkpoint:  # fp8 weight + scale, as a checkpoint holds them
        per_channel = scheme.weight_scale == "channel"
        amax = w.abs().amax(1) if per_channel else w.abs().amax().reshape(1)
        scale = amax / 448
        layer.load(
            "weight", (w / (scale[:, None] if per_channel else scale)).to(torch.float8_e4m3fn), 0
        )
        layer.load("weight_scale", scale, 0)
        if scheme.static_input_scale:
            layer.load("input_scale", torch.tensor(0.02), 0)
    else:
        layer.load("weight", w.to(dtype), 0)
    layer.finish_loading(dequantize=False)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", list(EPILOGUE_SCHEMES))
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 64, 300])
def test_epilogue_path_matches_the_rowwise_gemm(dtype, scheme, rows):
    """At M <= EPILOGUE_MAX_ROWS, row-wise scales run as the tensor-wise GEMM + an epilogue:
    the same values as the row-wise GEMM up to bf16 rounding (float32 up to the summation
    order); at M = 1 with per-tensor weight scales no epilogue is left; above the threshold
    the row-wise GEMM runs."""
    _needs_interpreter()
    gen = torch.Generator().manual_seed(rows)
    k, n = 256, 96
    layer = _gemm_layer(EPILOGUE_SCHEMES[scheme], k, n, dtype, gen)
    x = torch.randn(rows, k, generator=gen) * torch.exp2(torch.arange(rows) % 4 - 1.0)[:, None]
    x = x.to(dtype)
    assert layer.epilogue_max_rows == EPILOGUE_MAX_ROWS
    layer.epilogue_max_rows = 0
    want = layer(x).float()
    layer.epilogue_max_rows = EPILOGUE_MAX_ROWS
    product = layer.product(x)
    unscaled = rows <= EPILOGUE_MAX_ROWS and not (rows == 1 and scheme == "tensor-token")
    assert isinstance(product, Fp8Product) == unscaled
    forward = layer(x)
    got = as_tensor(product)
    assert got.dtype == forward.dtype == dtype
    got = got.float()
    # bf16: one rounding more (and the interpreter truncates): 3 ulps of the row's size
    ulps = 3 * 2**-8 if dtype == torch.bfloat16 else 1e-5
    size = want.abs().amax(dim=1, keepdim=True)
    assert ((got - want).abs() <= ulps * size).all(), (got - want).abs().max()
    assert torch.equal(forward.float(), got)  # forward applies the epilogue itself


def _emulate_token(row: torch.Tensor) -> torch.Tensor:
    """Per-token fp8 quantize/dequantize of one row, written out independently."""
    s = row.abs().max() / 448.0
    return (row / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


def test_tensor_scales_of_merged_shards_are_requantized_to_the_largest():
    """q/k/v with their own per-tensor scales become one weight with the largest scale; each
    shard still dequantizes to (nearly) its own values, and the input scale is the largest."""
    gen = torch.Generator().manual_seed(1)
    k, sizes, scales = 32, (32, 16, 16), (0.01, 0.04, 0.002)
    shards, offset = [], 0
    for size in sizes:
        shards.append((offset, size))
        offset += size
    layer = _layer(TENSOR_STATIC, k, offset, tuple(shards))
    originals = []
    for i, (size, s) in enumerate(zip(sizes, scales)):
        wq = _random_fp8(size, k, gen)
        originals.append(wq.float() * s)
        layer.load("weight", wq, i)
        layer.load("weight_scale", torch.tensor(s), i)
        layer.load("input_scale", torch.tensor([0.1, 0.3, 0.2][i]), i)
    layer.finish_loading(dequantize=False)
    assert layer.weight_scale.tolist() == [pytest.approx(0.04)]
    assert layer.input_scale.tolist() == [pytest.approx(0.3)]
    merged = layer.weight.float() * layer.weight_scale
    for (off, size), want in zip(shards, originals):
        got = merged[off : off + size]
        # requantized to the coarser grid: within half an fp8 step of the larger scale
        assert ((got - want).abs() <= 0.5 * 0.04 * 32 + 1e-6).all()
        assert (got - want).abs().mean() < 0.05 * want.abs().mean()


def test_quantize_at_load_per_channel_and_per_tensor():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(48, 32, generator=gen) * torch.linspace(0.01, 1, 48)[:, None]
    for scheme in (TOKEN, Fp8Scheme("tensor", "tensor")):
        layer = _layer(scheme, 32, 48)
        layer.load("weight", w, 0)
        layer.finish_loading(dequantize=True)
        amax = w.abs().amax(dim=1) if scheme.weight_scale == "channel" else w.abs().max()
        rel = (layer.weight - w).abs().amax(dim=1) / (amax.expand(48) if amax.dim() == 0 else amax)
        assert (rel <= 2**-4).all()  # e4m3 relative step at most 2^-3: half of it
        assert rel.max() > 0  # really quantized


def test_bad_checkpoint_tensors():
    ckpt = Fp8Scheme("channel", "token", checkpoint_format="compressed-tensors")
    layer = _layer(ckpt, 32, 48)
    with pytest.raises(ValueError, match="per-channel scales must be"):
        layer.load("weight_scale", torch.ones(32, 1), 0)
    with pytest.raises(ValueError, match="expected float8_e4m3fn"):
        layer.load("weight", torch.zeros(48, 32), 0)
    with pytest.raises(ValueError, match="input_scale in a checkpoint with dynamic"):
        layer.load("input_scale", torch.ones(1), 0)
    with pytest.raises(ValueError, match="multiples of 16"):
        bad = _layer(Fp8Scheme("tensor", "tensor"), 24, 48)
        bad.load("weight", torch.zeros(48, 24), 0)
        bad.finish_loading(dequantize=False)


# ---------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def texts(tiny_model_dir) -> list[list[int]]:
    return heldout_texts(load_tokenizer(tiny_model_dir), max_tokens=120)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, texts):
    engine = Engine(tiny_model_dir, device="cpu", dtype="float32", block_size=4)
    yield teacher_forced(engine, texts)
    engine.shutdown()


@pytest.fixture(scope="module")
def llmcompressor_dir(tiny_model_dir, tmp_path_factory) -> str:
    out = write_llmcompressor(tiny_model_dir, str(tmp_path_factory.mktemp("ct") / "fp8"))
    if out is None:
        pytest.skip("llmcompressor is not installed (pip install llmcompressor)")
    return out


@pytest.fixture(scope="module")
def modelopt_dirs(tiny_model_dir, texts, tmp_path_factory) -> dict[str, str]:
    """The ModelOpt layout with its config in hf_quant_config.json ("legacy") and in
    config.json ("config")."""
    base = tmp_path_factory.mktemp("modelopt")
    return {
        kind: write_modelopt(tiny_model_dir, str(base / kind), texts[:4], legacy=kind == "legacy")
        for kind in ("legacy", "config")
    }


@pytest.fixture(params=["legacy", "config"])
def modelopt_dir(request, modelopt_dirs) -> str:
    return modelopt_dirs[request.param]


def _score(path: str, texts, **options):
    engine = Engine(path, device="cpu", dtype="float32", block_size=4, **options)
    try:
        return teacher_forced(engine, texts), engine.core.runner.model
    finally:
        engine.shutdown()


def _assert_accurate(reference, got) -> None:
    a = agreement(reference, got)
    assert a.top1_agreement >= MIN_TOP1, a
    assert a.mean_abs_dlogprob <= MAX_MEAN_DLOGPROB, a


@pytest.mark.parametrize("mode", ["token", "tensor"])
def test_quantized_at_load_is_accurate(tiny_model_dir, texts, reference, mode):
    got, model = _score(tiny_model_dir, texts, quantization="fp8", fp8_activation_scale=mode)
    assert model.fp8 == resolve_scheme(None, "fp8", mode)
    assert isinstance(model.layers[0].mlp.down_proj, Fp8Linear)
    assert not isinstance(model.lm_head, Fp8Linear)  # lm_head and embeddings stay
    _assert_accurate(reference, got)


def test_llmcompressor_checkpoint(llmcompressor_dir, tiny_model_dir, texts, reference):
    """The reference writer's FP8_DYNAMIC checkpoint: our weights are its fp8 values times
    its per-row scales (q/k/v and gate/up merged), and the model is accurate."""
    assert ModelConfig.from_pretrained(llmcompressor_dir).checkpoint_fp8.weight_scale == "channel"
    got, model = _score(llmcompressor_dir, texts)
    ckpt = dict(iterate_hf_weights(llmcompressor_dir))
    p = "model.layers.1.self_attn."
    want = torch.cat([ckpt[p + f"{x}_proj.weight"].float()
                      * ckpt[p + f"{x}_proj.weight_scale"].float() for x in "qkv"])  # fmt: skip
    assert torch.equal(model.layers[1].self_attn.qkv_proj.weight, want)
    assert model.lm_head.weight.dtype == torch.float32  # ignored by the recipe
    _assert_accurate(reference, got)


def test_modelopt_checkpoint(modelopt_dir, texts, reference):
    scheme = ModelConfig.from_pretrained(modelopt_dir).checkpoint_fp8
    assert scheme.checkpoint_format == "modelopt" and scheme.static_input_scale
    got, model = _score(modelopt_dir, texts, kv_cache_dtype="fp8_e4m3")
    ckpt = dict(iterate_hf_weights(modelopt_dir))
    p = "model.layers.0.self_attn."
    qkv = model.layers[0].self_attn.qkv_proj
    scales = [ckpt[p + f"{x}_proj.weight_scale"].item() for x in "qkv"]
    assert len(set(scales)) == 3  # the merge has work to do
    assert qkv.weight_scale.item() == pytest.approx(max(scales))
    assert qkv.input_scale.item() == pytest.approx(
        max(ckpt[p + f"{x}_proj.input_scale"].item() for x in "qkv")
    )
    start = 0
    for x in "qkv":
        want = ckpt[p + f"{x}_proj.weight"].float() * ckpt[p + f"{x}_proj.weight_scale"]
        rows = qkv.weight[start : start + want.shape[0]]
        start += want.shape[0]
        assert ((rows - want).abs() <= 0.5 * 32 * max(scales) + 1e-6).all()
    _assert_accurate(reference, got)


# ---------------------------------------------------------------- the GEMM path on CPU


def _needs_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "the GEMM path on CPU tensors needs TRITON_INTERPRET=1 (set by conftest without "
            "CUDA); on a GPU machine tests/test_gpu_fp8_weights.py covers it"
        )


@pytest.fixture
def gemm_path(monkeypatch):
    """Models keep fp8 weights on a CPU: the CUDA path's code (Triton kernels under the
    interpreter, fused into the norms, and torch._scaled_mm, which torch also runs on CPU)."""
    _needs_interpreter()
    real = llama.LlamaForCausalLM.finish_loading
    monkeypatch.setattr(
        llama.LlamaForCausalLM, "finish_loading", lambda self, dequantize: real(self, False)
    )


def _greedy(path: str, **options):
    engine = Engine(path, device="cpu", dtype="float32", block_size=4, **options)
    try:
        outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        engine.check_integrity()
        return outs, engine.core.runner.model
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "source", ["token", "tensor", "modelopt"], ids=["at-load-token", "at-load-tensor", "modelopt"]
)
def test_gemm_path_matches_dequantized_path(request, tiny_model_dir, monkeypatch, source):
    if source == "modelopt":
        path, options = request.getfixturevalue("modelopt_dirs")["legacy"], {}
    else:
        path, options = tiny_model_dir, dict(quantization="fp8", fp8_activation_scale=source)
    _needs_interpreter()
    want, _ = _greedy(path, **options)
    request.getfixturevalue("gemm_path")
    got, model = _greedy(path, **options)
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and not qkv.dequantized
    # per-token and static scales quantize inside the norms and silu-and-mul
    assert model.layers[0].fused_fp8 == (source != "tensor")
    # dynamic per-tensor scales count the rows the model says are real (graph padding)
    if source == "tensor":
        assert qkv.num_rows is model.fp8_num_rows and model.fp8_num_rows is not None
    else:
        assert qkv.num_rows is None and model.fp8_num_rows is None
    # the same quantization; sums in another order can flip an fp8 rounding here and there
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   rtol=0, atol=0.02)  # fmt: skip


# ---------------------------------------------------------------- tensor parallelism


@pytest.mark.parametrize("source", ["llmcompressor", "modelopt"])
def test_tensor_parallel_ranks_hold_their_slices(request, source):
    """Each rank's dequantized fp8 weights are exactly its slice of one rank's: channel
    scales split with the rows of column-parallel layers and whole for row-parallel ones."""
    if source == "modelopt":
        path = request.getfixturevalue("modelopt_dirs")["legacy"]
    else:
        path = request.getfixturevalue("llmcompressor_dir")
    cfg = ModelConfig.from_pretrained(path)
    whole = LlamaForCausalLM(cfg, 64, fp8=cfg.checkpoint_fp8)
    whole.load_weights(iterate_hf_weights(path))
    whole.finish_loading(dequantize=True)
    for rank in range(2):
        shard = TPShard.of(cfg, rank, 2)
        part = LlamaForCausalLM(cfg, 64, shard, group=object(), fp8=cfg.checkpoint_fp8)
        part.load_weights(iterate_hf_weight_slices(path))
        part.finish_loading(dequantize=True)
        for i in range(cfg.num_layers):
            w, p = whole.layers[i], part.layers[i]
            q, kv, inter = shard.q_size, shard.kv_size, shard.intermediate_size
            full_qkv = w.self_attn.qkv_proj.weight
            kv0 = cfg.q_size + shard.kv_head_start * cfg.head_dim
            want_qkv = torch.cat([
                full_qkv[rank * q : (rank + 1) * q],
                full_qkv[kv0 : kv0 + kv],
                full_qkv[cfg.kv_size + kv0 : cfg.kv_size + kv0 + kv],
            ])  # fmt: skip
            if source == "modelopt":  # merged scales differ per rank: compare dequantized
                torch.testing.assert_close(p.self_attn.qkv_proj.weight, want_qkv,
                                           rtol=0.07, atol=1e-3)  # fmt: skip
            else:
                assert torch.equal(p.self_attn.qkv_proj.weight, want_qkv)
            gu = w.mlp.gate_up_proj.weight
            mid = cfg.intermediate_size
            want_gu = torch.cat([gu[rank * inter : (rank + 1) * inter],
                                 gu[mid + rank * inter : mid + (rank + 1) * inter]])  # fmt: skip
            torch.testing.assert_close(p.mlp.gate_up_proj.weight, want_gu, rtol=0.07, atol=1e-3)
            if source == "llmcompressor":
                assert torch.equal(p.mlp.gate_up_proj.weight, want_gu)
            o_cols, down_cols = (
                slice(rank * q, (rank + 1) * q),
                slice(rank * inter, (rank + 1) * inter),
            )
            assert torch.equal(p.self_attn.o_proj.weight, w.self_attn.o_proj.weight[:, o_cols])
            assert torch.equal(p.mlp.down_proj.weight, w.mlp.down_proj.weight[:, down_cols])


def test_tensor_parallel_engine_on_an_fp8_checkpoint(llmcompressor_dir):
    """Two gloo ranks on the llm-compressor checkpoint against one rank. Row-parallel inputs
    (o_proj, down_proj) are quantized per rank slice, with per-token scales of their own, so
    log-probs differ by about fp8 noise (up to 0.16 nats between the fp8 and the unquantized
    model here), not by float32 rounding. Teacher-forced on one rank's greedy continuation:
    log-probs agree within that noise, and the next greedy token after every prefix agrees
    wherever one rank's top two are more than twice it apart (a freshly trained tiny model
    has closer near-ties, where either choice is right)."""
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=True,
                            top_logprobs=2)  # fmt: skip
    forced = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True)
    one = Engine(llmcompressor_dir, device="cpu", dtype="float32", block_size=4)
    try:
        want = one.generate(prompt_token_ids=PROMPTS, sampling_params=greedy)
        seqs = [p + w.token_ids for p, w in zip(PROMPTS, want)]
        prefixes = [p + w.token_ids[:k] for p, w in zip(PROMPTS, want) for k in range(10)]
        margins = [first[1] - second[1] for w in want for first, second in w.top_logprobs]
        want_next = [t for w in want for t in w.token_ids]
        want_lp = one.generate(prompt_token_ids=seqs, sampling_params=forced)
        one.check_integrity()
    finally:
        one.shutdown()
    engine = Engine(llmcompressor_dir, device="cpu", dtype="float32", block_size=4,
                    tensor_parallel_size=2)  # fmt: skip
    try:
        got = engine.generate(prompt_token_ids=prefixes, sampling_params=forced)
        got_lp = engine.generate(prompt_token_ids=seqs, sampling_params=forced)
        engine.check_integrity()
    finally:
        engine.shutdown()
    for a, b in zip(got_lp, want_lp):
        diff = (torch.tensor(a.prompt_logprobs) - torch.tensor(b.prompt_logprobs)).abs()
        assert diff.max() < 0.2 and diff.mean() < 0.05
    clear = [i for i, m in enumerate(margins) if m > 0.4]
    assert len(clear) >= 10  # not vacuous
    assert [got[i].token_ids[0] for i in clear] == [want_next[i] for i in clear]


def test_dummy_weights_quantized_at_load(tiny_random_model_dir):
    outs, model = _greedy(tiny_random_model_dir, load_format="dummy", quantization="fp8")
    assert isinstance(model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
