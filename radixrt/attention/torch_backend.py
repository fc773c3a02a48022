"""Reference paged attention in plain torch (CPU and CUDA): `attention_backend="torch-reference"`.

Exact and simple rather than fast: the test oracle of the other backends (the fast torch path
is `sdpa_backend`). Decode rows (one query each) are padded to the
longest KV length among them and attended in one batched masked softmax; extend rows
(prefill chunks over a cached prefix) are attended one row at a time. Gather indices
and masks are built once per step in `prepare`. An fp8 pool is dequantized (stored value x
the layer's scale, `KVPool.dequantize`) in float32 after the gather.
"""

from __future__ import annotations

import torch

from radixrt.attention.forward_batch import ForwardBatch
from radixrt.kv.pool import KVPool


def _row_slots(batch: ForwardBatch, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat KV slots of rows `rows`, padded: ([R, max_kv] int64, valid [R, max_kv] bool)."""
    bs = batch.block_size
    seq_lens = batch.seq_lens[rows].to(torch.int64)
    kv_start = batch.kv_indptr[:-1][rows].to(torch.int64)
    max_kv = int(batch.seq_lens_cpu[rows].max())
    pos = torch.arange(max_kv, device=seq_lens.device)
    valid = pos.unsqueeze(0) < seq_lens.unsqueeze(1)
    idx = torch.where(valid, kv_start.unsqueeze(1) + (pos // bs).unsqueeze(0), 0)
    blocks = batch.kv_indices.to(torch.int64)[idx]
    return torch.where(valid, blocks * bs + pos % bs, 0), valid


def _gather(flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """flat[index]; fp8 through its uint8 view (fp8 has no index kernel on every device)."""
    if flat.dtype == torch.float8_e4m3fn:
        return flat.view(torch.uint8)[index].view(torch.float8_e4m3fn)
    return flat[index]


class TorchAttentionBackend:
    supports_fp8_kv = True  # dequantizes after the gather (KVPool.dequantize)
    supports_cuda_graph = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_head_dim = head_dim  # the pool stores the model's heads as they are
        self.scale = head_dim**-0.5
        self.batch: ForwardBatch | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        self.batch = batch
        nd = batch.num_decode
        if nd:
            self.decode_slots, self.decode_valid = _row_slots(batch, slice(0, nd))
        # Extend rows: (first token, last token + 1, KV slots [seq_len], causal mask)
        self.extend_rows = []
        qo = batch.qo_indptr_cpu.tolist()
        seq = batch.seq_lens_cpu.tolist()
        for r in range(nd, batch.num_rows):
            slots, _ = _row_slots(batch, slice(r, r + 1))
            q_len, kv_len = qo[r + 1] - qo[r], seq[r]
            q_pos = torch.arange(kv_len - q_len, kv_len, device=slots.device)
            mask = torch.arange(kv_len, device=slots.device).unsqueeze(0) <= q_pos.unsqueeze(1)
            self.extend_rows.append((qo[r], qo[r + 1], slots[0, :kv_len], mask))

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q [R, Q, hq, d]; keys/vals [R, K, hkv, d]; mask [R, Q, K] -> [R, Q, hq, d]."""
        group = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(group, dim=2).float()
        vals = vals.repeat_interleave(group, dim=2).float()
        scores = torch.einsum("rqhd,rkhd->rhqk", q.float(), keys) * self.scale
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("rhqk,rkhd->rqhd", probs, vals).to(q.dtype)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool
    ) -> torch.Tensor:
        batch = self.batch
        assert batch is not None, "prepare() must run before forward()"
        pool.store(layer, batch.slot_mapping, k, v)
        hkv, hd = self.num_kv_heads, self.head_dim
        k_flat = pool.k_cache(layer).reshape(-1, hkv, hd)
        v_flat = pool.v_cache(layer).reshape(-1, hkv, hd)
        out = torch.empty_like(q)
        nd = batch.num_decode
        if nd:
            keys, vals = _gather(k_flat, self.decode_slots), _gather(v_flat, self.decode_slots)
            keys, vals = pool.dequantize(layer, keys, vals, torch.float32)
            out[:nd] = self._attend(
                q[:nd].unsqueeze(1), keys, vals, self.decode_valid.unsqueeze(1)
            ).squeeze(1)
        for start, end, slots, mask in self.extend_rows:
            keys, vals = _gather(k_flat, slots).unsqueeze(0), _gather(v_flat, slots).unsqueeze(0)
            keys, vals = pool.dequantize(layer, keys, vals, torch.float32)
            out[start:end] = self._attend(
                q[start:end].unsqueeze(0), keys, vals, mask.unsqueeze(0)
            ).squeeze(0)
        return out
