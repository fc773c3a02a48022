"""The segmented LoRA kernels (radixrt.kernels.lora) against their torch references and the
torch (masked) LoRA path, on mixed batches: 4 adapters of ranks 8 and 16 and base rows, as
prefill segments and decode rows; on CPU through Triton's interpreter and on CUDA."""

from __future__ import annotations

import pytest
import torch
from lora_adapters import write_random_adapter

from radixrt.config import ModelConfig
from radixrt.kernels import HAS_TRITON
from radixrt.kernels.lora import (
    build_lora_segments,
    lora_expand_add,
    lora_expand_add_reference,
    lora_shrink,
    lora_shrink_reference,
)
from radixrt.lora.batch import LayerLora, MaskedLoraBatch, SegmentedLoraBatch
from radixrt.lora.slots import MERGED, LoraSlots
from radixrt.sampling import LoraRef

NUM_SLOTS = 5  # slot 4 stays empty
# rows of a step: (slot or None for the base, new tokens): prefill segments, then decode rows
ROWS = [(0, 37), (None, 9), (3, 5), (1, 80), (2, 16), (None, 1), (0, 1), (3, 1), (2, 1), (0, 1)]
DECODE_ROWS = [(s, 1) for s in (1, None, 0, 3, 0, 2, None, 1, 3)]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    return torch.device(request.param)


def _token_slot(rows) -> torch.Tensor:
    return torch.tensor([-1 if s is None else s for s, n in rows for _ in range(n)])


def _layer(gen, fan_in, outs, rank, dtype, device) -> LayerLora:
    """Random slot weights of one merged projection with parts of `outs` features."""
    P = len(outs)
    a = torch.randn(fan_in, NUM_SLOTS * P * rank, generator=gen) / fan_in**0.5
    b = [torch.randn(NUM_SLOTS * rank, n, generator=gen) / rank**0.5 for n in outs]
    starts = torch.tensor([0, *outs]).cumsum(0).tolist()
    return LayerLora(
        a.to(device, dtype),
        [w.to(device, dtype) for w in b],
        [(starts[i], starts[i + 1]) for i in range(P)],
    )


def test_segments_group_adapted_tokens_by_slot():
    token_slot = _token_slot(ROWS)
    seg = build_lora_segments(token_slot, torch.device("cpu"))
    assert seg.block_m == 64  # an 80-token prefill segment
    adapted = torch.nonzero(token_slot >= 0).flatten()
    assert sorted(seg.token_index.tolist()) == adapted.tolist()
    covered = []
    for start, end, slot in zip(seg.tile_start, seg.tile_end, seg.tile_slot):
        assert 0 < end - start <= seg.block_m
        tokens = seg.token_index[start:end].long()
        assert (token_slot[tokens] == slot).all()
        covered.extend(range(int(start), int(end)))
    assert covered == list(range(len(adapted)))
    decode = build_lora_segments(_token_slot(DECODE_ROWS), torch.device("cpu"))
    assert decode.block_m == 16 and decode.tile_slot.tolist() == [0, 1, 2, 3]
    none = build_lora_segments(torch.full((4,), -1), torch.device("cpu"))
    assert none.num_tokens == 0 and none.tile_start.numel() == 0


@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("rows", [ROWS, DECODE_ROWS], ids=["prefill+decode", "decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernels_match_reference_and_masked_path(device, rank, rows, dtype):
    if device.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter gets tl.dot of bfloat16 wrong; the cuda case runs it")
    gen = torch.Generator().manual_seed(rank)
    fan_in, outs = 64, [64, 32, 32]
    layer = _layer(gen, fan_in, outs, rank, dtype, device)
    token_slot = _token_slot(rows)
    T = len(token_slot)
    x = torch.randn(T, fan_in, generator=gen).to(device, dtype)
    base_out = torch.randn(T, sum(outs), generator=gen).to(device, dtype)
    seg = build_lora_segments(token_slot, device)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}

    shrunk = lora_shrink(x, layer.a, seg, 3 * rank)
    torch.testing.assert_close(shrunk, lora_shrink_reference(x, layer.a, seg, 3 * rank), **tol)
    out, ref = base_out.clone(), base_out.clone()
    for p, (start, stop) in enumerate(layer.out_ranges):
        part = shrunk[:, p * rank : (p + 1) * rank]
        lora_expand_add(out[:, start:stop], part, layer.b[p], seg, rank)
        lora_expand_add_reference(ref[:, start:stop], part, layer.b[p], seg, rank)
    torch.testing.assert_close(out, ref, **tol)
    base_rows = token_slot.to(device) < 0
    assert torch.equal(out[base_rows], base_out[base_rows])  # base rows are not touched
    assert not torch.allclose(out[~base_rows], base_out[~base_rows])

    # the same delta as the torch path (one GEMM over the used slots, masked)
    mask = torch.zeros(T, NUM_SLOTS, dtype=dtype)
    mask[~base_rows.cpu(), token_slot[token_slot >= 0]] = 1
    masked = MaskedLoraBatch([{"qkv_proj": layer}], mask.to(device), NUM_SLOTS, rank)
    segmented = SegmentedLoraBatch([{"qkv_proj": layer}], seg, rank)
    want = masked.apply(base_out.clone(), x, 0, "qkv_proj")
    got = segmented.apply(base_out.clone(), x, 0, "qkv_proj")
    torch.testing.assert_close(got, want, **tol)


def test_kernels_refuse_mismatched_shapes():
    seg = build_lora_segments(_token_slot(DECODE_ROWS), torch.device("cpu"))
    x = torch.zeros(len(DECODE_ROWS), 64)
    with pytest.raises(ValueError, match="a must be"):
        lora_shrink(x, torch.zeros(32, 5 * 8), seg, 8)
    with pytest.raises(ValueError, match="shrunk must be"):
        lora_expand_add(torch.zeros(9, 16), torch.zeros(3, 8), torch.zeros(40, 16), seg, 8)


def _slot_pools(model_dir, tmp_path, devices_and_modes):
    """LoraSlots over the model for each (device, segmented), the same 4 adapters (ranks 8
    and 16) resident, and the refs of a mixed step's rows."""
    cfg = ModelConfig.from_pretrained(model_dir)
    refs = []
    for i, r in enumerate((8, 16, 16, 8)):
        path = write_random_adapter(model_dir, str(tmp_path / f"a{i}"), r=r, seed=i)
        from radixrt.lora.adapter import digest

        refs.append(LoraRef(f"a{i}", digest(path), path))
    pools = [
        LoraSlots(cfg, 4, 16, 4, torch.device(dev), torch.float32, segmented=mode)
        for dev, mode in devices_and_modes
    ]
    row_refs = [None if s is None else refs[s] for s, _ in ROWS]
    return cfg, pools, row_refs


def _compare_pools(cfg, pools, row_refs):
    import numpy as np

    num_new = np.array([n for _, n in ROWS])
    batches = [pool.batch(pool.token_slots(row_refs, num_new)) for pool in pools]
    gen = torch.Generator().manual_seed(0)
    T = int(num_new.sum())
    for layer in range(cfg.num_layers):
        for module in MERGED:
            w = pools[0].layers[layer][module]
            x = torch.randn(T, w.a.shape[0], generator=gen)
            out = torch.randn(T, w.out_ranges[-1][1], generator=gen)
            results = [
                b.apply(out.to(p.device), x.to(p.device), layer, module).cpu()
                for b, p in zip(batches, pools)
            ]
            for got in results[1:]:
                torch.testing.assert_close(got, results[0], atol=1e-4, rtol=1e-4)


def test_slot_pool_segmented_equals_masked_on_cpu(tiny_model_dir, tmp_path):
    """The pool's two implementations give one delta for every layer and projection."""
    assert (
        LoraSlots(
            ModelConfig.from_pretrained(tiny_model_dir), 1, 8, 1, torch.device("cpu"), torch.float32
        )._make_batch.__name__
        == "_masked_batch"
    )  # CPU keeps torch ops by default
    cfg, pools, row_refs = _slot_pools(tiny_model_dir, tmp_path, [("cpu", False), ("cpu", True)])
    _compare_pools(cfg, pools, row_refs)


@pytest.mark.gpu
def test_slot_pool_on_cuda_uses_the_kernels(tiny_model_dir, tmp_path):
    cfg, pools, row_refs = _slot_pools(tiny_model_dir, tmp_path, [("cpu", None), ("cuda", None)])
    assert pools[1]._make_batch.__name__ == "_segmented_batch"
    _compare_pools(cfg, pools, row_refs)


def _mixed_batch_outputs(make_engine, model_dir, tmp_path, configs, max_tokens):
    """Greedy outputs of a mixed batch (4 adapters of ranks 8 and 16, and the base) on an
    engine per config: (engine options, whether its LoRA delta must be the segmented one)."""
    from radixrt import SamplingParams

    names = {}
    for i, r in enumerate((8, 16, 16, 8)):
        names[f"a{i}"] = write_random_adapter(model_dir, str(tmp_path / f"a{i}"), r=r, seed=i)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=True)
    prompts = ["The quick brown fox", "Once upon a time, in a small village by the sea"]
    loras = [None, *names] * 2
    prompts = [p for p in prompts for _ in range(5)]
    outs = []
    for options, segmented in configs:
        engine = make_engine(max_loras=4, max_lora_rank=16, **options)
        slots = engine.core.runner.lora
        if segmented and not options.get("device", "cpu").startswith("cuda"):
            slots._make_batch = slots._segmented_batch  # the kernels, interpreted on CPU
        assert (slots._make_batch.__name__ == "_segmented_batch") == segmented
        for name, path in names.items():
            engine.load_lora(name, path)
        outs.append(engine.generate(prompts, params, lora=loras))
    return outs


def _assert_same_outputs(want, got, tol):
    for a, b in zip(want, got):
        assert b.token_ids == a.token_ids
        assert max(abs(x - y) for x, y in zip(b.logprobs, a.logprobs)) < tol


def test_engine_segmented_path_equals_torch_ops_on_cpu(make_engine, tiny_model_dir, tmp_path):
    """The runner's LoRA delta through the kernels (interpreted) gives the torch path's
    outputs for a mixed batch."""
    torch_ops, kernels = _mixed_batch_outputs(
        make_engine, tiny_model_dir, tmp_path, [({}, False), ({}, True)], max_tokens=4
    )
    _assert_same_outputs(torch_ops, kernels, 1e-4)


@pytest.mark.gpu
def test_cuda_engine_mixed_batch_equals_cpu(make_engine, tiny_model_dir, tmp_path):
    """A mixed batch on CUDA (the kernels) gives the CPU engine's greedy tokens and
    log-probs (within 1e-3), float32 on both."""
    cuda = dict(device="cuda", attention_backend="torch", enable_cuda_graph=False)
    cpu_out, cuda_out = _mixed_batch_outputs(
        make_engine, tiny_model_dir, tmp_path, [({}, False), (cuda, True)], max_tokens=12
    )
    _assert_same_outputs(cpu_out, cuda_out, 1e-3)
