"""LoRA under tensor parallelism on a CPU with gloo (2 ranks, float32): each rank's slot pool
holds its shard of every adapter (B's output rows of column-parallel layers, A's input
columns of row-parallel ones), the shards' deltas make the whole delta, and a mixed batch of
two adapters and the base gives one rank's greedy tokens and log-probs (within 1e-4), with KV
heads split over the ranks or replicated on them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from lora_adapters import write_random_adapter

from radixrt import SamplingParams
from radixrt.config import ModelConfig
from radixrt.kernels import HAS_TRITON
from radixrt.lora.adapter import digest, module_shapes
from radixrt.lora.shard import local_module_shapes
from radixrt.lora.slots import MERGED, LoraSlots
from radixrt.model.tiny import make_hf_checkpoint
from radixrt.sampling import LoraRef
from radixrt.tp_shard import TPShard

TP = 2
RANK = 8
# rows of a step: (adapter index or None for the base, new tokens)
ROWS = [(0, 7), (None, 5), (1, 9), (0, 1), (None, 1), (1, 1)]


def _refs(model_dir, tmp_path) -> list[LoraRef]:
    refs = []
    for i, r in enumerate((RANK, RANK // 2)):
        path = write_random_adapter(model_dir, str(tmp_path / f"a{i}"), r=r, seed=i)
        refs.append(LoraRef(f"a{i}", digest(path), path))
    return refs


def _pool(cfg, shard=None, segmented=False) -> LoraSlots:
    return LoraSlots(cfg, 2, RANK, 2, torch.device("cpu"), torch.float32, segmented, shard)


def test_local_shapes_follow_the_base_shards(tiny_model_dir):
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    for rank in range(TP):
        shapes = local_module_shapes(cfg, TPShard.of(cfg, rank, TP))
        assert shapes == {
            "q_proj": (h, q // TP),
            "k_proj": (h, kv // TP),
            "v_proj": (h, kv // TP),
            "o_proj": (q // TP, h),
            "gate_proj": (h, i // TP),
            "up_proj": (h, i // TP),
            "down_proj": (i // TP, h),
        }
    # fewer KV heads than ranks: each rank's k/v B rows are its one (replicated) KV head's
    one_kv = dataclasses.replace(cfg, num_kv_heads=1)
    assert local_module_shapes(one_kv, TPShard.of(one_kv, 1, TP))["k_proj"] == (h, d)
    assert local_module_shapes(cfg, TPShard.of(cfg, 0, 1)) == module_shapes(cfg)


@pytest.mark.parametrize(
    "segmented",
    [False, pytest.param(True, marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton"))],
    ids=["torch", "kernels"],
)
def test_rank_pools_hold_their_shards(tiny_model_dir, tmp_path, segmented):
    """Every rank's slot weights are the whole pool's, sliced as its base layers are; the
    column-parallel deltas of the ranks are the whole delta's columns, the row-parallel ones
    sum to it (what the layer's all-reduce does)."""
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    refs = _refs(tiny_model_dir, tmp_path)
    whole = _pool(cfg)
    shards = [TPShard.of(cfg, r, TP) for r in range(TP)]
    ranks = [_pool(cfg, s, segmented) for s in shards]
    row_refs = [None if a is None else refs[a] for a, _ in ROWS]
    num_new = np.array([n for _, n in ROWS])
    batches = [p.batch(p.token_slots(row_refs, num_new)) for p in [whole, *ranks]]
    assert all(p.slot_keys == whole.slot_keys for p in ranks)
    assert ranks[0]._make_batch.__name__ == ("_segmented_batch" if segmented else "_masked_batch")
    T = int(num_new.sum())
    base_rows = torch.tensor([a is None for a, n in ROWS for _ in range(n)])
    gen = torch.Generator().manual_seed(0)
    for layer in range(cfg.num_layers):
        for module, parts in MERGED.items():
            w = whole.layers[layer][module]
            x = torch.randn(T, w.a.shape[0], generator=gen)
            want = batches[0].apply(torch.zeros(T, w.out_ranges[-1][1]), x, layer, module)
            assert not torch.allclose(want[~base_rows], torch.zeros(()))
            got = []
            for shard, pool, batch in zip(shards, ranks, batches[1:]):
                local = pool.layers[layer][module]
                ranges = [shard.checkpoint_range(p) for p in parts]
                if ranges[0][0] == 0:  # column-parallel: A whole, B's rows of its outputs (b = B^T)
                    assert torch.equal(local.a, w.a)
                    for p, (_, start, stop) in enumerate(ranges):
                        assert torch.equal(local.b[p], w.b[p][:, start:stop])
                    got.append(
                        batch.apply(torch.zeros(T, local.out_ranges[-1][1]), x, layer, module)
                    )
                else:  # row-parallel: A's columns of its inputs (a = A^T), B whole
                    ((_, start, stop),) = ranges
                    assert torch.equal(local.a, w.a[start:stop])
                    assert torch.equal(local.b[0], w.b[0])
                    got.append(batch.apply(torch.zeros_like(want), x[:, start:stop], layer, module))
            if ranges[0][0] == 0:
                columns = [
                    torch.cat(
                        [
                            g[:, slice(*pool.layers[layer][module].out_ranges[p])]
                            for g, pool in zip(got, ranks)
                        ],
                        1,
                    )
                    for p in range(len(parts))
                ]
                torch.testing.assert_close(torch.cat(columns, 1), want, atol=1e-5, rtol=1e-5)
            else:
                torch.testing.assert_close(sum(got), want, atol=1e-5, rtol=1e-5)
            assert torch.equal(want[base_rows], torch.zeros_like(want[base_rows]))


@pytest.fixture(params=["tiny", "qwen3-kv1"])
def model_dir(request, tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model (KV heads split over the ranks), or a random Qwen3 with ONE KV head
    (replicated: both ranks take the same k/v rows of B), q/k norms and q_size != hidden."""
    if request.param == "tiny":
        return tiny_model_dir
    path = str(tmp_path_factory.mktemp("lora-tp") / request.param)
    return make_hf_checkpoint(path, "qwen3", num_heads=4, num_kv_heads=1)


def test_mixed_batch_same_as_one_rank(model_dir, make_engine, tmp_path):
    """Two adapters and the base in one batch on two ranks: one rank's greedy tokens and
    log-probs; the adapters change the outputs (the delta is applied at all)."""
    refs = _refs(model_dir, tmp_path)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=True)
    loras = [None, "a0", "a1"]
    prompts = [p for p in ([5, 6, 7, 8, 9, 10], list(range(20, 47))) for _ in loras]
    loras = loras * 2
    outs = []
    for tp in (1, TP):
        engine = make_engine(model_dir, max_loras=2, max_lora_rank=RANK, tensor_parallel_size=tp)
        for ref in refs:
            engine.load_lora(ref.name, ref.path)
        outs.append(engine.generate(prompt_token_ids=prompts, sampling_params=params, lora=loras))
    want, got = outs
    for a, b in zip(want, got):
        assert b.token_ids == a.token_ids
        torch.testing.assert_close(
            torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-4
        )
    for k in range(0, len(want), 3):  # base, a0, a1 of one prompt
        assert want[k].token_ids != want[k + 1].token_ids != want[k + 2].token_ids
