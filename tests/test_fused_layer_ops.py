"""The model's layer ops (radixrt.model.layer_ops): the Triton ones (RoPE + KV store fused,
under Triton's interpreter on CPU) give the same hidden states and KV pool as the modules,
over a prefill step then a decode step; `create_layer_ops` decides once per model."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from radixrt.attention.forward_batch import reference_batch
from radixrt.attention.torch_backend import TorchAttentionBackend
from radixrt.config import ModelConfig
from radixrt.kernels import HAS_TRITON
from radixrt.kv.pool import KVPool
from radixrt.model.layer_ops import (
    FUSED_OPS_ENV,
    FusedRopeStoreOps,
    ModuleOps,
    RopeStoreOps,
    TritonOps,
    create_layer_ops,
)
from radixrt.model.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

BLOCK_SIZE = 4
CFG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=50,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
)


class StoredKVTorchBackend(TorchAttentionBackend):
    """The torch oracle with the `slots` / `attend` pair of the flashinfer backend: attends
    over K/V a fused kernel stored already (storing the stored values again changes nothing)."""

    @property
    def slots(self) -> torch.Tensor:
        return self.batch.slot_mapping

    def attend(self, layer: int, q: torch.Tensor, pool: KVPool) -> torch.Tensor:
        hkv, d = self.num_kv_heads, self.head_dim
        k = pool.k_cache(layer).reshape(-1, hkv, d)[self.slots]
        v = pool.v_cache(layer).reshape(-1, hkv, d)[self.slots]
        return self.forward(layer, q, k, v, pool)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    """CPU (Triton's interpreter) or CUDA; float32 either way, so the modules run torch."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    if request.param == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1; the cuda case runs instead")
    return torch.device(request.param)


def _run(ops, backend, device) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(CFG, 256, ops=ops)
    model.init_dummy_weights(seed=3)
    with torch.no_grad():  # norms away from 1, so a weight read wrongly shows
        for layer in model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
    pool = KVPool(
        CFG.num_layers, 16, BLOCK_SIZE, CFG.num_kv_heads, CFG.head_dim, torch.float32, device
    )
    table = torch.tensor([[3, 5, 7, 9], [1, 2, 4, 6]], dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    outs = []
    steps = [  # (cached, new): a prefill of both rows, then one decode step
        (torch.tensor([0, 0], dtype=torch.int32), torch.tensor([9, 5], dtype=torch.int32), 0),
        (torch.tensor([9, 5], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32), 2),
    ]
    with torch.inference_mode():
        for cached, new, num_decode in steps:
            batch = reference_batch(table, cached, new, num_decode, BLOCK_SIZE, device)
            ids = torch.randint(0, CFG.vocab_size, batch.input_ids.shape, generator=gen)
            batch.input_ids = ids.to(device)
            backend.prepare(batch)
            outs.append(model(batch, backend, pool))
    return outs, pool.kv.clone()


@pytest.mark.parametrize("fused_ops", [TritonOps, RopeStoreOps, FusedRopeStoreOps])
def test_triton_layer_ops_match_modules(fused_ops, device):
    args = (CFG.num_heads, CFG.num_kv_heads, CFG.head_dim)
    want, want_kv = _run(ModuleOps(), TorchAttentionBackend(*args), device)
    got, got_kv = _run(fused_ops(), StoredKVTorchBackend(*args), device)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_kv, want_kv, rtol=1e-5, atol=1e-6)


def test_create_layer_ops_decides_by_device_backend_and_env(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setenv(FUSED_OPS_ENV, "triton")
    assert type(create_layer_ops(cpu, "flashinfer")) is ModuleOps  # CPU keeps the modules
    assert type(create_layer_ops(cuda, "flashinfer")) is FusedRopeStoreOps
    assert type(create_layer_ops(cuda, "torch")) is TritonOps  # no `attend`: store unfused
    monkeypatch.setenv(FUSED_OPS_ENV, "flashinfer")
    assert type(create_layer_ops(cuda, "flashinfer")) is ModuleOps
    monkeypatch.setenv(FUSED_OPS_ENV, "triton-rope")
    assert type(create_layer_ops(cuda, "flashinfer")) is RopeStoreOps
    assert type(create_layer_ops(cuda, "torch")) is ModuleOps
    monkeypatch.delenv(FUSED_OPS_ENV)
    assert type(create_layer_ops(cuda, "flashinfer")) is ModuleOps  # the default
    monkeypatch.setenv(FUSED_OPS_ENV, "cutlass")
    with pytest.raises(ValueError, match="RADIXRT_FUSED_OPS must be one of"):
        create_layer_ops(cuda, "flashinfer")


def test_layers_share_the_model_ops():
    ops = TritonOps()
    model = LlamaForCausalLM(CFG, 64, ops=ops)
    assert all(m.ops is ops for layer in model.layers for m in (layer, layer.self_attn, layer.mlp))
    assert type(LlamaForCausalLM(CFG, 64).ops) is ModuleOps
