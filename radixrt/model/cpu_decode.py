"""The whole decode forward of a CPU float32 Llama in one native call (kernels/csrc/llama_decode.c).

A decode step of the tiny Llama spent ~1.8 of its ~5.4 ms of forward in Python around the
native kernels it already used (module calls, wrappers, views, allocations). `CpuDecode` runs
the same kernels in the same order from C: embedding, every layer (norm, QKV GEMM, rotary, KV
store, paged decode attention, o GEMM, add + norm, gate/up GEMM, SiLU-and-mul, down GEMM), the
final norm. Its hidden states are bitwise those of the layer-by-layer path
(tests/test_cpu_decode.py).

Which forwards take it (`LlamaForCausalLM.forward` asks `takes`): inference mode, every row a
decode row that the attention backend sends through its native kernel
(`SdpaAttentionBackend.native_decode_plan()`), at most `SMALL_MAX_ROWS` rows (where the
layer-by-layer path uses the same small GEMM), a float32 pool. Which models (`build`): one
rank (no tensor parallelism), no q/k norm (Qwen3), float32 weights packed for the small GEMM
(`prepack_linears`), and a build of the native library. Anything else runs the layers.

The C side holds raw pointers to the model's tensors: `CpuDecode` keeps a reference to each
and `valid()` checks before every call that none was replaced or repacked since (a changed
weight makes `build` run again).
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

import torch

from radixrt.attention.native_rows import NATIVE_MIN_PAIRS_THREADED, NativePlan
from radixrt.kernels.cpu_ops import PARALLEL_MIN_ELEMENTS
from radixrt.kernels.gemm_cpu import PARALLEL_MIN_MACS
from radixrt.kernels.native import check_status, load_library
from radixrt.kv.pool import KVPool
from radixrt.model.linear import SMALL_MAX_ROWS, Linear

if TYPE_CHECKING:
    from radixrt.attention.forward_batch import ForwardBatch

# the model: a radixrt.model.llama.LlamaForCausalLM (not imported: llama imports this module)
LlamaModel = torch.nn.Module

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Layer(ctypes.Structure):
    _fields_ = [
        (name, _P)
        for name in (
            "input_norm",
            "post_norm",
            "qkv",
            "qkv_bias",
            "o",
            "gate_up",
            "down",
            "k_cache",
            "v_cache",
        )  # fmt: skip
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, _I64) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads")),
        *((name, _I64) for name in ("head_dim", "inter", "block_size", "num_slots")),
        ("max_positions", _I64),
        ("eps", _F32),
        ("scale", _F32),
        ("embed", _P),
        ("final_norm", _P),
        ("rope_table", _P),
        ("layers", ctypes.POINTER(_Layer)),
        ("gemm_parallel_macs", _I64),
        ("attn_parallel_pairs", _I64),
        ("ops_parallel_elems", _I64),
    ]


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load_library("llama_decode")
    if lib is not None:
        fn = lib.radixrt_llama_decode_f32
        fn.restype = ctypes.c_int
        fn.argtypes = [_P, _I64, _P, _P, _P, _P, _P, _P, _I64, _P, _P, _I64, ctypes.c_int]
    return lib


class CpuDecode:
    """The native decode forward of one model over one pool; see the module docstring."""

    def __init__(self, model: LlamaModel, pool: KVPool, lib: ctypes.CDLL) -> None:
        cfg, shard = model.cfg, model.shard
        self._fn = lib.radixrt_llama_decode_f32
        self.pool = pool
        self.hidden = cfg.hidden_size
        self._vocab = model.embed_tokens.weight.shape[0]
        linears = _linears(model)
        layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            qkv, o, gate_up, down = (lin._small[1] for lin in linears[4 * i : 4 * i + 4])
            bias = layer.self_attn.qkv_proj.bias
            layers[i] = _Layer(
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                qkv.data_ptr(),
                None if bias is None else bias.data_ptr(),
                o.data_ptr(),
                gate_up.data_ptr(),
                down.data_ptr(),
                pool.k_cache(i).data_ptr(),
                pool.v_cache(i).data_ptr(),
            )
        self._layers = layers
        self._struct = _Model(
            len(model.layers), cfg.hidden_size, shard.num_heads, shard.num_kv_heads,
            cfg.head_dim, shard.intermediate_size, pool.block_size, pool.num_tokens,
            model.rope.rope_table.shape[0], model.norm.eps, cfg.head_dim**-0.5,
            model.embed_tokens.weight.data_ptr(), model.norm.weight.data_ptr(),
            model.rope.rope_table.data_ptr(), layers, PARALLEL_MIN_MACS,
            NATIVE_MIN_PAIRS_THREADED, PARALLEL_MIN_ELEMENTS,
        )  # fmt: skip
        # what the pointers point into: (the owner's parameter or buffer dict, name, tensor,
        # version or None), checked through the dicts (no nn.Module.__getattr__ per step)
        watch = [(lin._parameters, "weight", lin.weight, lin.weight._version) for lin in linears]
        watch += [(lin._parameters, "bias", lin.bias, None) for lin in linears]
        watch += [(model.rope._buffers, "rope_table", model.rope.rope_table, None)]
        owners = [model.embed_tokens, model.norm, *(n for ly in model.layers for n in _norms(ly))]
        watch += [(m._parameters, "weight", m.weight, None) for m in owners]
        self._watch = watch
        self._linears = [(lin, lin._small) for lin in linears]
        self._pool_kv = pool.kv
        self._scratch = torch.empty(0)
        per_row = 3 * cfg.hidden_size + (shard.num_heads + 2 * shard.num_kv_heads) * cfg.head_dim
        self._per_row = per_row + shard.num_heads * cfg.head_dim + 3 * shard.intermediate_size

    @staticmethod
    def applies(model: LlamaModel, pool: KVPool) -> bool:
        """Whether the native forward can ever run `model` over `pool` (its structure, dtypes
        and a build of the library; not whether its weights are packed right now)."""
        cfg = model.cfg
        if model.group is not None or cfg.qk_norm or model.rope.rope_table is None:
            return False
        if pool.kv.device.type != "cpu" or pool.dtype != torch.float32 or pool.is_fp8:
            return False
        params = [model.embed_tokens.weight, model.norm.weight, model.rope.rope_table]
        params += [n.weight for layer in model.layers for n in _norms(layer)]
        params += [lin.bias for lin in _linears(model) if lin.bias is not None]
        if any(p.dtype != torch.float32 or not p.is_cpu for p in params):
            return False
        return _library() is not None

    @staticmethod
    def build(model: LlamaModel, pool: KVPool) -> CpuDecode | None:
        """The native forward of `model` over `pool` (which `applies`), or None while a
        linear's small-GEMM copy is missing or stale (`prepack_linears` makes them)."""
        if not all(_small_ready(lin) for lin in _linears(model)):
            return None
        lib = _library()
        return None if lib is None else CpuDecode(model, pool, lib)

    def valid(self, pool: KVPool) -> bool:
        """Whether every pointer the C side holds is still the model's and pool's memory, and
        every packed copy current (~3 us)."""
        if pool is not self.pool or pool.kv is not self._pool_kv:
            return False
        for lin, small in self._linears:
            if lin._small is not small:
                return False
        for owner, name, t, version in self._watch:
            if owner.get(name) is not t or (version is not None and t._version != version):
                return False
        return True

    def forward(self, batch: ForwardBatch, plan: NativePlan) -> torch.Tensor:
        """The final hidden states [T, hidden] (normed) of a decode-only batch."""
        n = batch.input_ids.shape[0]
        need = n * self._per_row
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        out = torch.empty((n, self.hidden), dtype=torch.float32)
        rc = self._fn(
            ctypes.byref(self._struct), n, batch.input_ids.data_ptr(),
            batch.positions.data_ptr(), batch.slot_mapping.data_ptr(),
            batch.kv_indices.data_ptr(), plan.block_start.data_ptr(), plan.kv_len.data_ptr(),
            batch.kv_indices.numel(), out.data_ptr(), self._scratch.data_ptr(), self._vocab,
            torch.get_num_threads(),
        )  # fmt: skip
        check_status(rc, "native decode forward")
        return out


def takes(batch: ForwardBatch, plan: NativePlan | None) -> bool:
    """Whether a step's batch fits the native forward (see the module docstring)."""
    return (
        plan is not None
        and batch.num_decode == batch.num_rows
        and plan.token_index is None
        and plan.extend is None
        and 0 < batch.input_ids.shape[0] <= SMALL_MAX_ROWS
        and batch.input_ids.is_cpu
        and batch.input_ids.dtype == batch.positions.dtype == batch.slot_mapping.dtype
        and batch.input_ids.dtype == torch.int64
        and batch.input_ids.is_contiguous()
        and batch.positions.is_contiguous()
        and batch.slot_mapping.is_contiguous()
        and torch.is_inference_mode_enabled()
    )


def _small_ready(lin: Linear) -> bool:
    small = lin._small
    return small is not None and lin._packed_version == lin.weight._version


def _linears(model: LlamaModel) -> list[Linear]:
    """Every layer's qkv, o, gate_up and down projections, in that order."""
    out = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    return out


def _norms(layer: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    return layer.input_layernorm, layer.post_attention_layernorm
