"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV pool.

Weights are merged at load time: q/k/v -> `qkv_proj`, gate/up -> `gate_up_proj`.
Shapes: T = new tokens in the step (flattened across requests).

FP8 linears may hand their output on unscaled (`Fp8Linear.product`, an `Fp8Product`): o_proj's
and down_proj's to the next fused residual add + RMSNorm + quantization, gate_up's to the
fused SiLU-and-mul + quantization, which apply the scales as they read it; anything else
applies them first (`as_tensor`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixrt.attention.base import AttentionBackend
from radixrt.attention.forward_batch import ForwardBatch
from radixrt.config import ModelConfig
from radixrt.kernels.fp8_quant import FP8_DTYPE, Fp8Activation, Fp8Product
from radixrt.kv.pool import KVPool
from radixrt.model.fp8_linear import FP8_TENSOR_NAMES, Fp8Linear, as_tensor, linear_product
from radixrt.model.kv_scales import is_kv_scale_name
from radixrt.model.layer_ops import LayerOps, ModuleOps
from radixrt.model.layers import RMSNorm, RopeInputs, RotaryEmbedding, silu_mul_
from radixrt.model.linear import PACKED_MIN_ROWS, Linear
from radixrt.model.tp.layers import Fp8RowParallelLinear, RowParallelLinear
from radixrt.quantization import Fp8Scheme
from radixrt.tp_shard import TPShard

if TYPE_CHECKING:
    from radixrt.lora.slots import LoraBatch
    from radixrt.model.tp.group import TPGroup

    WeightSource = torch.Tensor | Any  # a tensor, or a safetensors slice (`get_slice`)


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them with one rank)."""

    def __init__(
        self,
        cfg: ModelConfig,
        shard: TPShard,
        layer_id: int,
        rope: RotaryEmbedding,
        group: TPGroup | None,
        fp8: Fp8Scheme | None = None,
        ops: LayerOps | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.ops = ops or ModuleOps()
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = shard.q_size, shard.kv_size
        prefix = f"model.layers.{layer_id}.self_attn"
        q, kv = self.q_size, self.kv_size
        self.qkv_proj = _linear(
            cfg.hidden_size,
            q + 2 * kv,
            _fp8_for(fp8, prefix, ("q_proj", "k_proj", "v_proj")),
            bias=cfg.attention_bias,
            shards=((0, q), (q, kv), (q + kv, kv)),
        )
        self.o_proj = _row_linear(
            self.q_size, cfg.hidden_size, group, _fp8_for(fp8, prefix, ("o_proj",))
        )
        self.rope = rope
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        rope: RopeInputs,  # the step's positions [T] (+ their cos/sin)
        x: torch.Tensor | Fp8Activation,  # [T, hidden] (quantized by a fused norm)
        backend: AttentionBackend,
        pool: KVPool,
        lora: LoraBatch | None = None,  # the step's adapters (None: every row is the base's)
    ) -> torch.Tensor | Fp8Product:
        """[T, hidden]: o_proj's output, perhaps unscaled (`Fp8Linear.product`)."""
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.apply(qkv, x, self.layer_id, "qkv_proj")
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # RoPE, K/V into the pool, attention: [T, hq, d]
        out = self.ops.attention(self.layer_id, self.rope, rope, q, k, v, backend, pool)
        out = out.reshape(-1, self.q_size)
        if lora is not None:
            return _with_lora(self.o_proj, out, lora, self.layer_id, "o_proj")
        return linear_product(self.o_proj, out)


class MLP(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        shard: TPShard,
        group: TPGroup | None,
        layer_id: int = 0,
        fp8: Fp8Scheme | None = None,
        ops: LayerOps | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops or ModuleOps()
        inter = shard.intermediate_size
        self.inter = inter
        self.layer_id = layer_id
        prefix = f"model.layers.{layer_id}.mlp"
        self.gate_up_proj = _linear(
            cfg.hidden_size,
            2 * inter,
            _fp8_for(fp8, prefix, ("gate_proj", "up_proj")),
            shards=((0, inter), (inter, inter)),
            row_parts=((0, inter), (inter, 2 * inter)),
        )
        self.down_proj = _row_linear(
            inter, cfg.hidden_size, group, _fp8_for(fp8, prefix, ("down_proj",))
        )
        self.fused_fp8 = False  # set by `fuse_fp8` (quantize silu-and-mul's output in one pass)

    def forward(
        self, x: torch.Tensor | Fp8Activation, lora: LoraBatch | None = None
    ) -> torch.Tensor | Fp8Product:
        """[T, hidden]: down_proj's output, perhaps unscaled (`Fp8Linear.product`); with
        `lora`, each row's adapter delta added to gate_up_proj's and down_proj's outputs."""
        if lora is not None:
            assert isinstance(x, torch.Tensor)  # LoRA runs over 16/32-bit bases only
            gate_up = lora.apply(self.gate_up_proj(x), x, self.layer_id, "gate_up_proj")
            act = self.ops.silu_and_mul(gate_up)
            return _with_lora(self.down_proj, act, lora, self.layer_id, "down_proj")
        if self.fused_fp8:
            down = self.down_proj
            assert isinstance(down, Fp8Linear)
            gate_up = linear_product(self.gate_up_proj, x)
            return down.product(down.quantize_silu_mul(gate_up))
        assert isinstance(x, torch.Tensor)
        gate_up = self.gate_up_proj
        if x.is_cuda or not gate_up.is_packed or x.shape[0] < PACKED_MIN_ROWS:
            # one GEMM (the fused silu-and-mul reads its halves; on CPU, few rows)
            return linear_product(self.down_proj, self.ops.silu_and_mul(self.gate_up_proj(x)))
        # CPU, many rows: the packed gate and up GEMMs apart, so that silu and mul run on
        # contiguous tensors (on strided halves of one [T, 2I] output silu was 3x slower:
        # 2.9 vs 0.9 ms at 4096 x 512)
        gate = self.gate_up_proj.forward_rows(x, 0, self.inter)
        up = self.gate_up_proj.forward_rows(x, self.inter, 2 * self.inter)
        return self.down_proj(silu_mul_(gate, up))


def _with_lora(
    layer: Linear, x: torch.Tensor, lora: LoraBatch, layer_id: int, module: str
) -> torch.Tensor:
    """`layer(x)` plus each row's LoRA delta of `module` (o_proj, down_proj). Row-parallel,
    each rank adds its input features' part of the delta (its columns of A: radixrt.lora.shard)
    to its partial product before the layer's all-reduce, which sums both."""

    def add(out: torch.Tensor, x_local: torch.Tensor) -> torch.Tensor:
        return lora.apply(out, x_local, layer_id, module)

    if isinstance(layer, RowParallelLinear):
        return layer.forward_adding(x, add)
    return add(layer(x), x)


def _fp8_for(fp8: Fp8Scheme | None, prefix: str, parts: tuple[str, ...]) -> Fp8Scheme | None:
    """`fp8` when it quantizes the HF modules `prefix.<part>` (all of a merged layer's parts
    or none: ValueError otherwise), else None."""
    if fp8 is None:
        return None
    flags = {fp8.quantizes(f"{prefix}.{p}" if prefix else p) for p in parts}
    if len(flags) > 1:
        raise ValueError(
            f"the checkpoint quantizes some of {prefix}.{{{','.join(parts)}}} but not all; "
            "they are one merged layer here"
        )
    return fp8 if flags.pop() else None


def _linear(
    in_features: int,
    out_features: int,
    fp8: Fp8Scheme | None,
    bias: bool = False,
    shards: tuple[tuple[int, int], ...] = (),
    row_parts: tuple[tuple[int, int], ...] = (),
) -> Linear:
    """A column-parallel (or single-rank) linear: `Fp8Linear` under an fp8 scheme."""
    if fp8 is None:
        return Linear(in_features, out_features, bias=bias, row_parts=row_parts)
    return Fp8Linear(in_features, out_features, fp8, bias=bias, shards=shards, row_parts=row_parts)


def _row_linear(
    in_local: int, out_features: int, group: TPGroup | None, fp8: Fp8Scheme | None = None
) -> Linear:
    """Linear with one rank; with several, its row-parallel version (+ all-reduce); their
    fp8 versions under an fp8 scheme."""
    if group is None:
        return _linear(in_local, out_features, fp8)
    if fp8 is not None:
        return Fp8RowParallelLinear(in_local, out_features, fp8, group)
    return RowParallelLinear(in_local, out_features, group)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        shard: TPShard,
        layer_id: int,
        rope: RotaryEmbedding,
        group: TPGroup | None,
        fp8: Fp8Scheme | None = None,
        ops: LayerOps | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops = ops or ModuleOps()
        self.self_attn = Attention(cfg, shard, layer_id, rope, group, fp8, ops)
        self.mlp = MLP(cfg, shard, group, layer_id, fp8, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fused_fp8 = False  # set by `fuse_fp8`: norms quantize the next GEMM's input

    def fuse_fp8(self) -> bool:
        """Quantize the inputs of qkv_proj and gate_up_proj in the norms before them and
        down_proj's in silu-and-mul, where the layers allow it (fp8 on CUDA with per-token or
        static per-tensor activation scales; see Fp8Linear.fusable). Returns whether the
        norms are fused (after the weights are loaded)."""
        qkv, gate_up = self.self_attn.qkv_proj, self.mlp.gate_up_proj
        down = self.mlp.down_proj
        self.fused_fp8 = all(isinstance(m, Fp8Linear) and m.fusable for m in (qkv, gate_up))
        self.mlp.fused_fp8 = isinstance(down, Fp8Linear) and down.fusable
        return self.fused_fp8

    def _norm(
        self,
        norm: RMSNorm,
        x: torch.Tensor | Fp8Product,
        residual: torch.Tensor | None,
        linear: nn.Module,
    ) -> tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
        """(norm(x + residual), x + residual), quantized for `linear` when fused (x's scales
        applied in the same kernel when it is an unscaled product)."""
        if self.fused_fp8:
            assert isinstance(linear, Fp8Linear)
            return linear.quantize_rmsnorm(x, residual, norm.weight, norm.eps)
        return self.ops.add_rmsnorm(norm, as_tensor(x), residual)

    def forward(
        self,
        rope: RopeInputs,
        x: torch.Tensor | Fp8Product,
        residual: torch.Tensor | None,
        backend: AttentionBackend,
        pool: KVPool,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor | Fp8Product, torch.Tensor]:
        """(the MLP's output, perhaps unscaled, the residual stream): the next layer's x and
        residual."""
        h, residual = self._norm(self.input_layernorm, x, residual, self.self_attn.qkv_proj)
        x = self.self_attn(rope, h, backend, pool, lora)
        h, residual = self._norm(self.post_attention_layernorm, x, residual, self.mlp.gate_up_proj)
        return self.mlp(h, lora), residual


class LlamaForCausalLM(nn.Module):
    """The decoder, or with `group` (tensor parallelism) this rank's shard of it: heads,
    MLP features and vocabulary rows as `shard` says, one all-reduce after o_proj, down_proj
    and the embedding, an all-gather of the logits. Every rank computes the same hidden
    states and full logits."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        shard: TPShard | None = None,
        group: TPGroup | None = None,
        fp8: Fp8Scheme | None = None,
        ops: LayerOps | None = None,
    ) -> None:
        super().__init__()
        assert (shard is None or shard.size == 1) == (group is None)
        self.cfg = cfg
        # how the layers run their norms, activation, RoPE and KV store (`create_layer_ops`)
        self.ops = ops = ops or ModuleOps()
        self.fp8 = fp8
        self.group = group
        # [1] int64: a forward's real tokens, the only rows whose absmax dynamic per-tensor
        # activation scales take (padding rows of a CUDA graph must not change them); made
        # by `finish_loading` when a layer has such scales, else None
        self.fp8_num_rows: torch.Tensor | None = None
        self.shard = shard = shard or TPShard.of(cfg, 0, 1)
        self.rope = rope = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, shard, i, rope, group, fp8, ops) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        lm_head_fp8 = _fp8_for(fp8, "", ("lm_head",))
        if lm_head_fp8 is not None and (group is not None or cfg.tie_word_embeddings):
            raise ValueError(
                "the checkpoint quantizes lm_head, which is supported only without tensor "
                "parallelism and with untied embeddings"
            )
        if group is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size, lm_head_fp8)
        else:
            from radixrt.model.tp.layers import VocabParallelEmbedding, VocabParallelLMHead

            self.embed_tokens = VocabParallelEmbedding(shard, cfg.hidden_size, group)
            self.lm_head = VocabParallelLMHead(shard, cfg.hidden_size, group)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, batch: ForwardBatch, backend: AttentionBackend, pool: KVPool) -> torch.Tensor:
        """Runs every new token of `batch`; returns hidden states [T, hidden] (normed)."""
        if self.fp8_num_rows is not None:  # the rows dynamic per-tensor scales count
            if batch.num_real_tokens is None:
                self.fp8_num_rows.fill_(batch.num_tokens)
            else:
                self.fp8_num_rows.copy_(batch.num_real_tokens)
        x = self.embed_tokens(batch.input_ids)
        # cos/sin gathered once for all layers (none where a fused kernel reads the cache)
        rope = self.ops.prepare_rope(self.rope, batch.positions, x)
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, backend, pool, batch.lora)
        x, _ = self.ops.add_rmsnorm(self.norm, as_tensor(x), residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] float32: new, or written into `out` (then
        returned), at the cost of the same one cast."""
        logits = self.lm_head(hidden)
        if out is None:
            return logits.float()
        return out.copy_(logits)

    # ---- weights ----
    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Copy HF-named weights in, merging q/k/v and gate/up; of a split tensor only this
        rank's part is read (`TPShard.checkpoint_range`; a safetensors slice reads only
        those bytes). Fp8 layers take their weight, `weight_scale` and `input_scale`
        through `Fp8Linear.load` (a 16/32-bit weight is quantized there); call
        `finish_loading` after. Raises ValueError when a checkpoint tensor is unknown or a
        model parameter stays unloaded."""
        cfg, shard = self.cfg, self.shard
        params = dict(self.named_parameters())
        fp8_layers = {n: m for n, m in self.named_modules() if isinstance(m, Fp8Linear)}
        # HF shard name -> (our param, offset along dim 0)
        merged = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", shard.q_size),
            "v_proj": ("qkv_proj", shard.q_size + shard.kv_size),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", shard.intermediate_size),
        }
        shard_index = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}
        loaded: set[str] = set()
        for hf_name, source in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or is_kv_scale_name(name):
                continue  # kv scales: read by the runner for an fp8 pool (model.kv_scales)
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            parts = name.split(".")
            kind = parts[-2] if len(parts) >= 2 else ""
            target, offset = name, None
            if len(parts) >= 3 and kind in merged:
                ours, offset = merged[kind]
                target = ".".join(parts[:-2] + [ours, parts[-1]])
            module_name, _, leaf = target.rpartition(".")
            fp8_layer = fp8_layers.get(module_name)
            if fp8_layer is not None and leaf in FP8_TENSOR_NAMES:
                part = shard.checkpoint_range(kind) if shard.size > 1 else None
                tensor = _read_fp8(source, leaf, part)
                fp8_layer.load(leaf, tensor, shard_index.get(kind, 0))
                loaded.add(f"{target}#{offset}" if offset is not None else target)
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
            param = params[target]
            tensor = _read(source, shard.checkpoint_range(kind) if shard.size > 1 else None)
            with torch.no_grad():
                if offset is not None:
                    param[offset : offset + tensor.shape[0]].copy_(tensor)
                    loaded.add(f"{target}#{offset}")
                    continue
                rows = param.shape[0]
                if kind in ("embed_tokens", "lm_head") and tensor.shape[0] < rows:
                    rows = tensor.shape[0]  # a vocabulary shard: the rest is padding
                    param[rows:].zero_()
                if param[:rows].shape != tensor.shape:
                    raise ValueError(
                        f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != "
                        f"model shape {tuple(param.shape)}"
                    )
                param[:rows].copy_(tensor)
                loaded.add(target)
        expected = set()
        for name in params:
            base = name.split(".")[-2] if "." in name else ""
            if base in ("qkv_proj", "gate_up_proj"):
                shards = [o for ours, o in merged.values() if ours == base]
                if base == "qkv_proj" and name.endswith("bias") and not cfg.attention_bias:
                    continue
                expected.update(f"{name}#{o}" for o in shards)
            else:
                expected.add(name)
        for module_name, layer in fp8_layers.items():
            scheme = layer.scheme
            names = ["weight_scale"] if scheme.from_checkpoint else []
            names += ["input_scale"] if scheme.static_input_scale else []
            base = module_name.rpartition(".")[2]
            offsets = [o for ours, o in merged.values() if ours == base] or [None]
            for leaf in names:
                expected.update(
                    f"{module_name}.{leaf}" + ("" if o is None else f"#{o}") for o in offsets
                )
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def finish_loading(self, dequantize: bool) -> None:
        """After the weights are in: finish fp8 layers (`Fp8Linear.finish_loading`; with
        `dequantize`, the CPU path) and fuse their input quantization into the norms where
        they allow it."""
        dynamic_tensor = []
        for m in self.modules():
            if isinstance(m, Fp8Linear):
                m.finish_loading(dequantize)
                if not m.per_token and not m.static:
                    dynamic_tensor.append(m)
        if dynamic_tensor:
            device = dynamic_tensor[0].weight.device
            self.fp8_num_rows = torch.zeros(1, dtype=torch.int64, device=device)
            for m in dynamic_tensor:
                m.num_rows = self.fp8_num_rows
        for layer in self.layers:
            layer.fuse_fp8()

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights (benchmarks): small uniform values, norms at 1."""
        gen = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, Fp8Linear):  # quantized as a checkpoint's weight at load
                    m.init_dummy(gen, -0.02, 0.02)
            for name, p in self.named_parameters():
                if p.dtype == FP8_DTYPE:
                    continue
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.uniform_(-0.02, 0.02, generator=gen)


def _read(source: WeightSource, part: tuple[int, int, int] | None) -> torch.Tensor:
    """The tensor, or its [start, stop) part along `dim`, from a tensor or a safetensors
    slice (which then reads only that part from the file)."""
    if part is None:
        return source if isinstance(source, torch.Tensor) else source[:]
    dim, start, stop = part
    if isinstance(source, torch.Tensor):
        return source.narrow(dim, start, stop - start)
    return source[start:stop] if dim == 0 else source[:, start:stop]


def _read_fp8(source: WeightSource, leaf: str, part: tuple[int, int, int] | None) -> torch.Tensor:
    """An fp8 layer's checkpoint tensor, or this rank's part of it: the weight as `_read`
    reads it; a per-channel `weight_scale` ([N] or [N, 1]) split like the weight's rows when
    those are split (column-parallel), whole otherwise; per-tensor scales whole."""
    if leaf == "weight":
        return _read(source, part)
    shape = tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())
    whole = source if isinstance(source, torch.Tensor) else source[...]
    numel = 1
    for n in shape:
        numel *= n
    if part is None or numel == 1 or part[0] != 0:
        return whole
    _, start, stop = part
    return whole[start:stop]
