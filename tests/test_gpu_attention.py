"""FlashInfer backend and fused CUDA layers against the torch references (GPU, bf16).

Random mixed batches: decode rows (one new token over a cached context) and extend rows
(prefill chunks on top of a cached prefix, or from scratch), blocks scattered over the pool,
block sizes 1 and 16, head dims 128 and 32 (zero-padded to 64 by the backend).
"""

from __future__ import annotations

import bisect

import numpy as np
import pytest
import torch

from radixrt.attention.flashinfer_backend import kv_head_dim
from radixrt.attention.forward_batch import ForwardBatch, reference_batch
from radixrt.config import ModelConfig
from radixrt.executor.cuda_graph import DECODE_BUCKETS, decode_buckets, decode_metadata
from radixrt.kernels import build_kv_metadata_reference, build_token_metadata_reference
from radixrt.kv.pool import KVPool

NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS = 8, 2, 2
DTYPE = torch.bfloat16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def test_kv_head_dim():
    assert [kv_head_dim(d) for d in (32, 64, 80, 128, 256)] == [64, 64, 128, 128, 256]
    with pytest.raises(ValueError, match="head_dim"):
        kv_head_dim(512)


def test_decode_buckets():
    assert DECODE_BUCKETS[:6] == (1, 2, 4, 8, 16, 24) and DECODE_BUCKETS[-1] == 1024
    assert decode_buckets(1024) == DECODE_BUCKETS
    assert decode_buckets(20)[-1] == 24 and decode_buckets(1) == (1,)
    assert decode_buckets(256)[-1] == 256 and len(decode_buckets(256)) == 35
    assert decode_buckets(300)[-1] == 304 and decode_buckets(512)[-1] == 512
    assert decode_buckets(513)[-1] == 544 and len(DECODE_BUCKETS) == 67
    with pytest.raises(ValueError):
        decode_buckets(1025)
    with pytest.raises(ValueError):
        decode_buckets(0)


def test_decode_bucket_of_every_row_count():
    """A step of n rows runs the smallest bucket >= n; past 64 rows padding stays under 1/8
    of the step (8 rows apart to 256, 16 to 512, 32 to 1024)."""
    buckets = decode_buckets(1024)
    assert list(buckets) == sorted(set(buckets))
    for n in range(1, 1025):
        bucket = buckets[bisect.bisect_left(buckets, n)]
        assert bucket >= n and not any(n <= b < bucket for b in buckets)
        if n > 64:
            assert (bucket - n) * 8 < n, (n, bucket)
    steps = {b - a for a, b in zip(buckets[4:], buckets[5:])}
    assert steps == {8, 16, 32}


def test_graph_tokens_per_row_covers_verify_rows():
    from radixrt.config import EngineConfig, SchedulerConfig, SpeculativeConfig
    from radixrt.executor.runner import graph_tokens_per_row

    assert graph_tokens_per_row(EngineConfig(model_path="m")) == 1
    spec = EngineConfig(
        model_path="m",
        scheduler=SchedulerConfig(num_speculative_tokens=5),
        speculative=SpeculativeConfig(speculative_method="ngram"),
    )
    assert graph_tokens_per_row(spec) == 6


@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_metadata_matches_reference(block_size):
    """The CUDA-graph host metadata (numpy) equals the reference builders on the real rows;
    padding rows use the scratch block only (CPU test)."""
    gen = torch.Generator().manual_seed(block_size)
    num_rows, bucket, scratch = 5, 8, 999
    tables = np.zeros((num_rows, 320), dtype=np.int32)
    positions = torch.randint(1, 300, (num_rows,), generator=gen).numpy()
    for i, computed in enumerate(positions):
        nb = (computed + block_size) // block_size
        tables[i, :nb] = torch.randperm(900, generator=gen)[:nb].numpy()
    ids = np.arange(num_rows, dtype=np.int64) + 40
    meta = decode_metadata(ids, positions, tables, bucket, block_size, scratch)
    table = torch.from_numpy(tables)
    start = torch.from_numpy(positions.astype(np.int32))
    ones = torch.ones(num_rows, dtype=torch.int32)
    qo = torch.arange(num_rows + 1, dtype=torch.int32)
    kv = build_kv_metadata_reference(table, start + 1, block_size)
    tok = build_token_metadata_reference(table, start, ones, qo, num_rows, block_size)
    real = int(kv.kv_indptr[-1])
    assert meta.kv_indptr[: num_rows + 1].tolist() == kv.kv_indptr.tolist()
    assert meta.kv_indices[:real].tolist() == kv.kv_indices.tolist()
    assert meta.kv_last_page_len[:num_rows].tolist() == kv.kv_last_page_len.tolist()
    assert meta.positions[:num_rows].tolist() == tok.positions.tolist()
    assert meta.slot_mapping[:num_rows].tolist() == tok.slot_mapping.tolist()
    assert meta.input_ids[:num_rows].tolist() == ids.tolist()
    assert meta.seq_lens[:num_rows].tolist() == (start + 1).tolist()
    # padding: one scratch block each, one token, slots inside the scratch block
    assert np.diff(meta.kv_indptr[num_rows:]).tolist() == [1] * (bucket - num_rows)
    assert (meta.kv_indices[real:] == scratch).all() and len(meta.kv_indices) == real + 3
    assert (meta.slot_mapping[num_rows:] // block_size == scratch).all()
    assert (meta.seq_lens[num_rows:] == 1).all() and (meta.kv_last_page_len[num_rows:] == 1).all()
    with pytest.raises(AssertionError, match="scratch block"):
        decode_metadata(ids, positions, tables, bucket, block_size, int(kv.kv_indices[0]))


def make_batch(
    rows: list[tuple[int, int]], num_decode: int, block_size: int, gen: torch.Generator
) -> tuple[ForwardBatch, int]:
    """ForwardBatch on CUDA for rows [(num_cached, num_new)], decode rows first; each row's
    blocks are drawn at random from the pool. Returns (batch, pool blocks needed)."""
    cached = torch.tensor([c for c, _ in rows], dtype=torch.int32)
    new = torch.tensor([n for _, n in rows], dtype=torch.int32)
    seq_lens = cached + new
    nblocks = (seq_lens + block_size - 1) // block_size
    num_blocks = int(nblocks.sum()) + 3
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(rows), int(nblocks.max()), dtype=torch.int32)
    used = 0
    for r, nb in enumerate(nblocks.tolist()):
        table[r, :nb] = perm[used : used + nb]
        used += nb
    batch = reference_batch(table, cached, new, num_decode, block_size, "cuda")
    return batch, num_blocks


def random_rows(kind: str, gen: torch.Generator) -> tuple[list[tuple[int, int]], int]:
    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    num_decode = randint(1, 9) if kind in ("decode", "mixed") else 0
    num_extend = randint(1, 5) if kind in ("extend", "mixed") else 0
    rows = [(randint(1, 700), 1) for _ in range(num_decode)]
    # extend rows: from scratch, on a cached prefix, and one-token chunks
    rows += [(randint(0, 1) * randint(1, 400), randint(1, 300)) for _ in range(num_extend)]
    return rows, num_decode


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode", "extend", "mixed"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("head_dim", [128, 32])
@pytest.mark.parametrize("seed", [0, 1])
def test_flashinfer_matches_torch(kind, block_size, head_dim, seed):
    from radixrt.attention.flashinfer_backend import FlashInferBackend
    from radixrt.attention.torch_backend import TorchAttentionBackend

    gen = torch.Generator().manual_seed(1000 * seed + 7 * head_dim + block_size)
    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=64,
        hidden_size=NUM_HEADS * head_dim,
        intermediate_size=64,
        num_layers=NUM_LAYERS,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
    )
    dev = torch.device("cuda")
    fi = FlashInferBackend(cfg, dev, DTYPE)
    ref = TorchAttentionBackend(NUM_HEADS, NUM_KV_HEADS, head_dim)
    rows, num_decode = random_rows(kind, gen)
    batch, num_blocks = make_batch(rows, num_decode, block_size, gen)
    pool_ref = KVPool(NUM_LAYERS, num_blocks, block_size, NUM_KV_HEADS, head_dim, DTYPE, dev)
    pool_fi = KVPool(NUM_LAYERS, num_blocks, block_size, NUM_KV_HEADS, fi.kv_head_dim, DTYPE, dev)
    pool_ref.kv.copy_(torch.randn(pool_ref.kv.shape, generator=gen).to(DTYPE))
    pool_fi.kv.zero_()
    pool_fi.kv[..., :head_dim] = pool_ref.kv
    q_size, kv_size = NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim
    with torch.inference_mode():
        fi.prepare(batch)
        ref.prepare(batch)
        for layer in range(NUM_LAYERS):
            # strided views into one fused qkv, as the model passes them
            qkv = torch.randn(batch.num_tokens, q_size + 2 * kv_size, generator=gen).to(dev, DTYPE)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(-1, NUM_HEADS, head_dim)
            k = k.view(-1, NUM_KV_HEADS, head_dim)
            v = v.view(-1, NUM_KV_HEADS, head_dim)
            out = fi.forward(layer, q, k, v, pool_fi)
            expected = ref.forward(layer, q, k, v, pool_ref)
            assert out.shape == expected.shape and out.dtype == DTYPE
            assert torch.isfinite(out).all()
            err = rel_err(out, expected)
            assert err <= 1e-2, f"layer {layer}: rel err {err:.2e} rows={rows}"
    torch.cuda.synchronize()
    assert torch.equal(pool_fi.kv[..., :head_dim], pool_ref.kv), "stored K/V differ"


@pytest.mark.gpu
def test_fused_layers_match_torch():
    """FlashInfer RMSNorm (+ fused residual add), RoPE and SiLU-and-mul vs the torch path
    computed in float32 on the same inputs."""
    from radixrt.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul

    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    tokens, hidden, head_dim = 37, 512, 128
    x = torch.randn(tokens, hidden, generator=gen)
    res = torch.randn(tokens, hidden, generator=gen)
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=gen))
    norm_gpu = RMSNorm(hidden, 1e-5).to(dev, DTYPE)
    norm_gpu.load_state_dict(norm.state_dict())
    with torch.inference_mode():
        assert rel_err(norm_gpu(x.to(dev, DTYPE)).cpu(), norm(x)) < 1e-2
        out, new_res = norm_gpu(x.to(dev, DTYPE), res.to(dev, DTYPE))
        ref_out, ref_res = norm(x.clone(), res.clone())  # the CPU path is in place too
        assert rel_err(out.cpu(), ref_out) < 1e-2 and rel_err(new_res.cpu(), ref_res) < 1e-2

        gate_up = torch.randn(tokens, 2 * hidden, generator=gen)
        assert rel_err(silu_and_mul(gate_up.to(dev, DTYPE)).cpu(), silu_and_mul(gate_up)) < 1e-2

        rope = RotaryEmbedding(head_dim, 4096, 500000.0, None)
        positions = torch.randint(0, 4096, (tokens,), generator=gen)
        qkv = torch.randn(tokens, 12 * head_dim, generator=gen)
        q, k = (
            qkv[:, : 8 * head_dim].view(tokens, 8, head_dim),
            qkv[:, 8 * head_dim : 10 * head_dim],
        )
        k = k.reshape(tokens, 2, head_dim)
        qkv_gpu = qkv.to(dev, DTYPE)  # before the CPU path rotates q and k (in place)
        ref_q, ref_k = rope(rope.prepare(positions, q), q, k)
        q_gpu = qkv_gpu[:, : 8 * head_dim].view(tokens, 8, head_dim)
        k_gpu = qkv_gpu[:, 8 * head_dim : 10 * head_dim].view(tokens, 2, head_dim)
        rope = rope.to(dev)
        out_q, out_k = rope(rope.prepare(positions.to(dev), q_gpu), q_gpu, k_gpu)
        assert rel_err(out_q.cpu(), ref_q) < 1e-2 and rel_err(out_k.cpu(), ref_k) < 1e-2
