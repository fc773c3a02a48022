"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV pool.

Weights are merged at load time: q/k/v -> `qkv_proj`, gate/up -> `gate_up_proj`.
Shapes: T = new tokens in the step (flattened across requests).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from radixrt.attention.base import AttentionBackend
from radixrt.attention.forward_batch import ForwardBatch
from radixrt.config import ModelConfig
from radixrt.kv.pool import KVPool
from radixrt.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.cfg = cfg
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.rope = rope
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, hidden]
        backend: AttentionBackend,
        pool: KVPool,
    ) -> torch.Tensor:
        cfg = self.cfg
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        out = backend.forward(self.layer_id, q, k, v, pool)  # [T, hq, d]
        return self.o_proj(out.reshape(-1, cfg.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, rope)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
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
        x = self.self_attn(positions, x, backend, pool)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, batch: ForwardBatch, backend: AttentionBackend, pool: KVPool) -> torch.Tensor:
        """Runs every new token of `batch`; returns hidden states [T, hidden] (normed)."""
        x = self.embed_tokens(batch.input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(batch.positions, x, residual, backend, pool)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] float32."""
        return self.lm_head(hidden).float()

    # ---- weights ----
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named weights in, merging q/k/v and gate/up. Raises ValueError when a
        checkpoint tensor is unknown or a model parameter stays unloaded."""
        cfg = self.cfg
        params = dict(self.named_parameters())
        # HF shard name -> (our param, offset along dim 0)
        merged = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", cfg.q_size),
            "v_proj": ("qkv_proj", cfg.q_size + cfg.kv_size),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", cfg.intermediate_size),
        }
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            parts = name.split(".")
            target, offset = name, None
            if len(parts) >= 3 and parts[-2] in merged:
                ours, offset = merged[parts[-2]]
                target = ".".join(parts[:-2] + [ours, parts[-1]])
            if target not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
            param = params[target]
            with torch.no_grad():
                if offset is None:
                    if param.shape != tensor.shape:
                        raise ValueError(
                            f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != "
                            f"model shape {tuple(param.shape)}"
                        )
                    param.copy_(tensor)
                    loaded.add(target)
                else:
                    param[offset : offset + tensor.shape[0]].copy_(tensor)
                    loaded.add(f"{target}#{offset}")
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
