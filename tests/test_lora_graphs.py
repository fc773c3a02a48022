"""Decode CUDA graphs with LoRA adapters. The graphs' padded static segments
(radixrt.kernels.lora.StaticLoraSegments) through the segmented kernels give the per-step
segments' delta, the torch reference's and the masked torch path's, on CPU through Triton's
interpreter: mixes of adapters and base rows, repeated slots, a slot of two tiles, buckets
larger than the step. The runner's graph path with adapters runs on CPU through a stand-in
that feeds the graphs' inputs to an eager forward (tests/eager_decode_graphs.py); on CUDA an
engine serving several adapters replays LoRA graphs and matches its eager steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lora_adapters import write_random_adapter

from radixrt import SamplingParams
from radixrt.kernels import HAS_TRITON
from radixrt.kernels.lora import (
    DECODE_BLOCK_M,
    StaticLoraSegments,
    build_lora_segments,
    lora_expand_add_reference,
    lora_shrink,
    lora_shrink_reference,
    max_lora_tiles,
)
from radixrt.lora.batch import LayerLora, MaskedLoraBatch, SegmentedLoraBatch

NUM_SLOTS = 4
# decode steps: each token's slot (None: a base row) and the graph bucket it pads to
STEPS = [
    ([1, None, 0, 3, 0, 2, None, 1, 3], 16),  # repeated slots, base rows, 7 padding rows
    ([2] * 21 + [None, 0] * 5, 40),  # slot 2 holds 21 tokens: two tiles
    ([None, None, None, 3], 4),  # one adapted row, no padding
    ([0], 1),
]
ADAPTER_RANKS = (8, 16, 16, 8)


def _token_slot(slots) -> np.ndarray:
    return np.array([-1 if s is None else s for s in slots], dtype=np.int64)


def _covered(seg) -> list[tuple[int, int, int]]:
    """(start, end, slot) of every non-empty tile of `seg`."""
    tiles = zip(seg.tile_start.tolist(), seg.tile_end.tolist(), seg.tile_slot.tolist())
    return [(s, e, slot) for s, e, slot in tiles if e > s]


def test_max_lora_tiles_bounds_every_step():
    rng = np.random.default_rng(0)
    for _ in range(300):
        bucket = int(rng.integers(1, 80))
        slots = int(rng.integers(1, 9))
        token_slot = rng.integers(-1, slots, size=int(rng.integers(1, bucket + 1)))
        seg = build_lora_segments(torch.from_numpy(token_slot), torch.device("cpu"))
        tiles_at_16 = sum(-(-c // DECODE_BLOCK_M) for c in np.bincount(token_slot[token_slot >= 0]))
        assert seg.tile_start.numel() <= tiles_at_16 <= max_lora_tiles(bucket, slots)
    # the bound is reached: 17 + 3 tokens of two slots take 3 tiles
    assert max_lora_tiles(20, 2) == 3 and max_lora_tiles(3, 8) == 3 and max_lora_tiles(1, 1) == 1


def test_fill_writes_the_step_and_empty_padding_tiles():
    static = StaticLoraSegments(64, NUM_SLOTS, torch.device("cpu"))
    assert static.max_tiles == max_lora_tiles(64, NUM_SLOTS)
    for slots, bucket in [*STEPS, STEPS[1], ([None] * 5, 8), STEPS[0]]:
        token_slot = _token_slot(slots)
        static.fill(token_slot, bucket)
        seg = static.view(bucket)
        assert seg.token_index.numel() == bucket and seg.block_m == DECODE_BLOCK_M
        assert seg.tile_start.numel() == max_lora_tiles(bucket, NUM_SLOTS)
        adapted = np.flatnonzero(token_slot >= 0)
        tiles = _covered(seg)
        # tiles first, then empty ones (start == end): a refill leaves no earlier tile
        assert (seg.tile_end[len(tiles) :] == seg.tile_start[len(tiles) :]).all()
        positions = [p for s, e, _ in tiles for p in range(s, e)]
        assert positions == list(range(len(adapted)))
        for start, end, slot in tiles:
            assert end - start <= DECODE_BLOCK_M
            assert (token_slot[seg.token_index[start:end].numpy()] == slot).all()
        assert sorted(seg.token_index[: len(adapted)].tolist()) == adapted.tolist()
        # the same tiles as the per-step segments of a decode step
        dynamic = build_lora_segments(torch.from_numpy(token_slot), torch.device("cpu"))
        if dynamic.block_m == DECODE_BLOCK_M:
            assert tiles == _covered(dynamic)
            assert torch.equal(seg.token_index[: len(adapted)], dynamic.token_index)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    return torch.device(request.param)


def _layer(gen, fan_in, outs, rank, dtype, device) -> LayerLora:
    P = len(outs)
    a = torch.randn(fan_in, NUM_SLOTS * P * rank, generator=gen) / fan_in**0.5
    b = [torch.randn(NUM_SLOTS * rank, n, generator=gen) / rank**0.5 for n in outs]
    starts = np.cumsum([0, *outs]).tolist()
    return LayerLora(
        a.to(device, dtype),
        [w.to(device, dtype) for w in b],
        [(starts[i], starts[i + 1]) for i in range(P)],
    )


@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_padded_segments_match_step_segments_and_references(device, rank, dtype):
    """Every step of STEPS through a graph's padded segments: the shrunk rows and the
    delta of the per-step segments, the torch references' and the masked path's; base and
    padding rows keep their values. Padding rows of x are NaN and the padding entries of
    token_index point at them: a read of either would show."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter gets tl.dot of bfloat16 wrong; the cuda case runs it")
    gen = torch.Generator().manual_seed(rank)
    fan_in, outs = 64, [64, 32, 32]
    C = len(outs) * rank
    layer = _layer(gen, fan_in, outs, rank, dtype, device)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    static = StaticLoraSegments(64, NUM_SLOTS, device)
    for slots, bucket in STEPS:
        token_slot = _token_slot(slots)
        T, N = len(token_slot), int((token_slot >= 0).sum())
        x = torch.randn(bucket, fan_in, generator=gen).to(device, dtype)
        x[T:] = float("nan")  # padding rows: no adapter reads them
        base_out = torch.randn(bucket, sum(outs), generator=gen).to(device, dtype)
        static.fill(token_slot, bucket)
        padded = static.view(bucket)
        padded.token_index[N:] = bucket - 1  # unread: positions no tile covers
        step = build_lora_segments(torch.from_numpy(token_slot), device)

        shrunk = lora_shrink(x, layer.a, padded, C)
        assert shrunk.shape == (bucket, C)
        want = lora_shrink(x[:T], layer.a, step, C)
        torch.testing.assert_close(shrunk[:N], want, **tol)
        ref_shrunk = lora_shrink_reference(x, layer.a, padded, C)
        torch.testing.assert_close(shrunk[:N], ref_shrunk[:N], **tol)

        got = SegmentedLoraBatch([{"qkv_proj": layer}], padded, rank).apply(
            base_out.clone(), x, 0, "qkv_proj"
        )
        by_step = SegmentedLoraBatch([{"qkv_proj": layer}], step, rank).apply(
            base_out[:T].clone(), x[:T], 0, "qkv_proj"
        )
        torch.testing.assert_close(got[:T], by_step, **tol)
        assert torch.equal(got[T:], base_out[T:])  # padding rows untouched
        base_rows = torch.from_numpy(token_slot < 0).to(device)
        assert torch.equal(got[:T][base_rows], base_out[:T][base_rows])
        assert not torch.allclose(got[:T][~base_rows], base_out[:T][~base_rows])

        ref = base_out.clone()
        for p, (start, stop) in enumerate(layer.out_ranges):
            part = shrunk[:, p * rank : (p + 1) * rank]
            lora_expand_add_reference(ref[:, start:stop], part, layer.b[p], padded, rank)
        torch.testing.assert_close(got, ref, **tol)
        mask = torch.zeros(T, NUM_SLOTS, dtype=dtype)
        adapted = torch.from_numpy(token_slot >= 0)
        mask[adapted, torch.from_numpy(token_slot)[adapted]] = 1
        masked = MaskedLoraBatch([{"qkv_proj": layer}], mask.to(device), NUM_SLOTS, rank)
        torch.testing.assert_close(
            got[:T], masked.apply(base_out[:T].clone(), x[:T], 0, "qkv_proj"), **tol
        )


def _write_adapters(model_dir, tmp_path) -> dict[str, str]:
    return {
        f"a{i}": write_random_adapter(model_dir, str(tmp_path / f"a{i}"), r=r, seed=i)
        for i, r in enumerate(ADAPTER_RANKS)
    }


def _mixed_requests(engine, names):
    """Prompts over every adapter and the base model, some of them short enough that their
    prefill runs in a graph too (rows of <= 16 tokens)."""
    prompts = ["The quick brown fox", "Once upon a time, in a small village by the sea", "A"]
    loras = [None, *names] * 2
    ids = [engine.tokenizer.encode(prompts[i % len(prompts)]) for i in range(len(loras))]
    return ids, loras


def _check_graph_steps(runner, tol: float) -> list[int]:
    """Wrap runner.execute: each step that a graph runs with adapted rows is also run
    eagerly (same plan, same KV), and their logits must agree (relative error < tol).
    Returns the list that collects each such step's token count."""
    execute = runner.execute
    checked = []

    def checked_execute(plan, **kwargs):
        row_loras = [runner.slots.loras[r.slot] for r in plan.rows]
        if plan.num_decode == len(plan.rows) and any(row_loras):
            before = runner.cuda_graphs.num_lora_replays
            graph_logits = runner.logits(plan).clone()
            if runner.cuda_graphs.num_lora_replays > before:
                eager_logits = runner.logits(plan, use_cuda_graph=False)
                err = ((graph_logits - eager_logits).norm() / eager_logits.norm()).item()
                assert err < tol, f"{len(plan.rows)} rows: graph vs eager rel err {err:.2e}"
                checked.append(sum(r.num_tokens for r in plan.rows))
        return execute(plan, **kwargs)

    runner.execute = checked_execute
    return checked


def _engines_with_cpu_graphs(make_engine, model_dir, tmp_path):
    """Two engines serving the same adapters: an eager one, and one whose runner takes the
    graph path through the CPU stand-in (returned too), and the adapters' names."""
    from eager_decode_graphs import EagerDecodeGraphs

    names = _write_adapters(model_dir, tmp_path)
    engines = [make_engine(max_loras=NUM_SLOTS, max_lora_rank=16) for _ in range(2)]
    for engine in engines:
        for name, path in names.items():
            engine.load_lora(name, path)
    eager, graphed = engines
    runner = graphed.core.runner
    graphs = runner.cuda_graphs = EagerDecodeGraphs(runner)
    return eager, graphed, graphs, names


def test_runner_graph_path_with_adapters_on_cpu(make_engine, tiny_model_dir, tmp_path):
    """The runner's graph path with adapters (the graphs' padded segments, interpreted)
    gives the eager CPU engine's greedy tokens and log-probs, and its logits on the same
    steps; steps with adapted rows took the LoRA graph path, padded to their bucket."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    eager, graphed, graphs, names = _engines_with_cpu_graphs(make_engine, tiny_model_dir, tmp_path)
    runner = graphed.core.runner
    checked = _check_graph_steps(runner, 1e-5)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=True)
    ids, loras = _mixed_requests(eager, names)
    want = eager.generate(prompt_token_ids=ids, sampling_params=params, lora=loras)
    got = graphed.generate(prompt_token_ids=ids, sampling_params=params, lora=loras)
    for a, b in zip(want, got, strict=True):
        assert b.token_ids == a.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert checked and graphs.num_lora_replays >= len(checked)
    assert any(bucket > tokens for tokens, bucket in graphs.lora_buckets)  # padded tiles
    base_only = graphs.num_replays - graphs.num_lora_replays
    graphed.generate(prompt_token_ids=ids[:2], sampling_params=params)  # no adapter
    assert graphs.num_replays - graphs.num_lora_replays > base_only


def test_graphs_without_lora_leave_adapted_steps_eager(make_engine, tiny_model_dir, tmp_path):
    """Graphs that cover no LoRA step (a failed LoRA capture falls back to this) replay only
    steps without adapted rows; steps with adapters run eagerly, with the same outputs."""
    eager, graphed, graphs, names = _engines_with_cpu_graphs(make_engine, tiny_model_dir, tmp_path)
    graphs._lora_segments = None  # what DecodeCudaGraphs keeps after a failed LoRA capture
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ids, loras = _mixed_requests(eager, names)
    want = eager.generate(prompt_token_ids=ids, sampling_params=params, lora=loras)
    got = graphed.generate(prompt_token_ids=ids, sampling_params=params, lora=loras)
    assert [b.token_ids for b in got] == [a.token_ids for a in want]
    assert graphs.num_lora_replays == 0 and graphs.num_replays == 0  # every step had adapters
    graphed.generate(prompt_token_ids=ids[:2], sampling_params=params)  # no adapter
    assert graphs.num_replays > 0 and graphs.num_lora_replays == 0


@pytest.mark.gpu
def test_lora_decode_graphs_match_eager(make_engine, tiny_model_dir, tmp_path):
    """An engine with CUDA graphs serving 4 adapters and the base (bf16, FlashInfer):
    every graph step with adapted rows matches the eager forward of the same plan, greedy
    tokens and log-probs match an engine without graphs, and LoRA graphs were replayed
    (base-only steps replay the base graphs)."""
    names = _write_adapters(tiny_model_dir, tmp_path)
    options = dict(
        device="cuda",
        dtype="bfloat16",
        num_kv_blocks=512,
        attention_backend="flashinfer",
        max_loras=NUM_SLOTS,
        max_lora_rank=16,
    )
    graphed = make_engine(enable_cuda_graph=True, **options)
    eager = make_engine(enable_cuda_graph=False, **options)
    graphs = graphed.core.runner.cuda_graphs
    assert graphs is not None and eager.core.runner.cuda_graphs is None
    assert set(graphs.lora_graphs) == set(graphs.graphs) == set(graphs.buckets)
    for engine in (graphed, eager):
        for name, path in names.items():
            engine.load_lora(name, path)
    params = SamplingParams(
        max_tokens=16, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    ids, loras = _mixed_requests(graphed, names)
    ids, loras = ids * 2, loras * 2  # 20 rows: the 24-row bucket, 4 padding rows
    want = eager.generate(prompt_token_ids=ids, sampling_params=params, lora=loras)
    checked = _check_graph_steps(graphed.core.runner, 1e-2)
    got = graphed.generate(prompt_token_ids=ids, sampling_params=params, lora=loras)
    assert len(checked) >= 8 and graphs.num_lora_replays >= len(checked)
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        first = next(
            (j for j, (a, b) in enumerate(zip(w.token_ids, g.token_ids)) if a != b),
            len(w.token_ids),
        )
        if first < len(w.token_ids):  # only at a near tie of the eager run's two best
            (_, lp0), (_, lp1) = w.top_logprobs[first]
            assert abs(lp0 - lp1) < 0.05, f"request {i}: tokens differ at {first}, no tie"
        torch.testing.assert_close(
            torch.tensor(g.logprobs[:first]), torch.tensor(w.logprobs[:first]), rtol=0, atol=3e-2
        )
    base_only = graphs.num_replays - graphs.num_lora_replays
    graphed.generate(prompt_token_ids=ids[:4], sampling_params=params)  # no adapter
    assert graphs.num_replays - graphs.num_lora_replays > base_only
