"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV pool.

Weights are merged at load time: q/k/v -> `qkv_proj`, gate/up -> `gate_up_proj`.
Shapes: T = new tokens in the step (flattened across requests).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixrt.attention.base import AttentionBackend
from radixrt.attention.forward_batch import ForwardBatch
from radixrt.config import ModelConfig
from radixrt.kv.pool import KVPool
from radixrt.model.kv_scales import is_kv_scale_name
from radixrt.model.layers import RMSNorm, RopeInputs, RotaryEmbedding, silu_and_mul, silu_mul_
from radixrt.model.linear import PACKED_MIN_ROWS, Linear
from radixrt.model.tp.shard import TPShard

if TYPE_CHECKING:
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
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = shard.q_size, shard.kv_size
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = _row_linear(self.q_size, cfg.hidden_size, group)
        self.rope = rope
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        rope: RopeInputs,  # the step's positions [T] (+ their cos/sin)
        x: torch.Tensor,  # [T, hidden]
        backend: AttentionBackend,
        pool: KVPool,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(rope, q, k)
        out = backend.forward(self.layer_id, q, k, v, pool)  # [T, hq, d]
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard, group: TPGroup | None) -> None:
        super().__init__()
        inter = shard.intermediate_size
        self.inter = inter
        self.gate_up_proj = Linear(
            cfg.hidden_size, 2 * inter, bias=False, row_parts=((0, inter), (inter, 2 * inter))
        )
        self.down_proj = _row_linear(inter, cfg.hidden_size, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if x.is_cuda or not gate_up.is_packed or x.shape[0] < PACKED_MIN_ROWS:
            # one GEMM (FlashInfer's silu_and_mul reads its halves; on CPU, few rows)
            return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        # CPU, many rows: the packed gate and up GEMMs apart, so that silu and mul run on
        # contiguous tensors (on strided halves of one [T, 2I] output silu was 3x slower:
        # 2.9 vs 0.9 ms at 4096 x 512)
        gate = self.gate_up_proj.forward_rows(x, 0, self.inter)
        up = self.gate_up_proj.forward_rows(x, self.inter, 2 * self.inter)
        return self.down_proj(silu_mul_(gate, up))


def _row_linear(in_local: int, out_features: int, group: TPGroup | None) -> Linear:
    """Linear with one rank; with several, its row-parallel version (+ all-reduce)."""
    if group is None:
        return Linear(in_local, out_features, bias=False)
    from radixrt.model.tp.layers import RowParallelLinear

    return RowParallelLinear(in_local, out_features, group)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        shard: TPShard,
        layer_id: int,
        rope: RotaryEmbedding,
        group: TPGroup | None,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, shard, layer_id, rope, group)
        self.mlp = MLP(cfg, shard, group)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        rope: RopeInputs,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        backend: AttentionBackend,
        pool: KVPool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, backend, pool)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


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
    ) -> None:
        super().__init__()
        assert (shard is None or shard.size == 1) == (group is None)
        self.cfg = cfg
        self.group = group
        self.shard = shard = shard or TPShard.of(cfg, 0, 1)
        self.rope = rope = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, shard, i, rope, group) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if group is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        else:
            from radixrt.model.tp.layers import VocabParallelEmbedding, VocabParallelLMHead

            self.embed_tokens = VocabParallelEmbedding(shard, cfg.hidden_size, group)
            self.lm_head = VocabParallelLMHead(shard, cfg.hidden_size, group)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, batch: ForwardBatch, backend: AttentionBackend, pool: KVPool) -> torch.Tensor:
        """Runs every new token of `batch`; returns hidden states [T, hidden] (normed)."""
        x = self.embed_tokens(batch.input_ids)
        rope = self.rope.prepare(batch.positions, x)  # cos/sin gathered once for all layers
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, backend, pool)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] float32."""
        return self.lm_head(hidden).float()

    # ---- weights ----
    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Copy HF-named weights in, merging q/k/v and gate/up; of a split tensor only this
        rank's part is read (`TPShard.checkpoint_range`; a safetensors slice reads only
        those bytes). Raises ValueError when a checkpoint tensor is unknown or a model
        parameter stays unloaded."""
        cfg, shard = self.cfg, self.shard
        params = dict(self.named_parameters())
        # HF shard name -> (our param, offset along dim 0)
        merged = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", shard.q_size),
            "v_proj": ("qkv_proj", shard.q_size + shard.kv_size),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", shard.intermediate_size),
        }
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
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights (benchmarks): small uniform values, norms at 1."""
        gen = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
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
