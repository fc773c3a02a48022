"""Segmented LoRA shrink and expand (SGMV-style) over a batch whose tokens run under
different adapter slots, and tokens of none (the base model's, which these kernels skip).

The adapters' weights live in slot-major pools: a merged projection's A matrices as
`a [in, L * C]` (slot s owns columns [s * C, (s + 1) * C)) and each output part's B matrices
as `b [L * R, out]` (slot s owns rows [s * R, (s + 1) * R)). `build_lora_segments` groups a
batch's adapted tokens by slot once per forward, in tiles of at most `block_m` tokens of one
slot; every layer's shrink and expand then reuse them:

    shrunk = lora_shrink(x, a, segments, C)        # [N, C]: x[token] @ a[:, slot's columns]
    lora_expand_add(out, shrunk, b, segments, R)   # out[token] += shrunk[j] @ b[slot's rows]

One launch covers all adapters (no loop over them): a tile's program reads its slot's
weights once for up to `block_m` tokens, whether they are one request's prefill or the
decode rows of several requests of that adapter.
"""

from typing import NamedTuple

import torch

from ._triton import cdiv, load_triton_module, next_power_of_2

SHRINK_BLOCK_N = 64
SHRINK_BLOCK_K = 64
EXPAND_BLOCK_N = 64
EXPAND_BLOCK_K_MAX = 64


class LoraSegments(NamedTuple):
    """A batch's adapted tokens grouped by slot, in tiles (all int32, on the kernels' device)."""

    token_index: torch.Tensor  # [N] the adapted tokens (rows of x / out), grouped by slot
    tile_start: torch.Tensor  # [NT] each tile's first position in token_index
    tile_end: torch.Tensor  # [NT] one past its last (at most block_m after its start)
    tile_slot: torch.Tensor  # [NT] the slot every token of the tile runs under
    block_m: int  # tokens per tile at most

    @property
    def num_tokens(self) -> int:
        return self.token_index.shape[0]


def build_lora_segments(token_slot: torch.Tensor, device: torch.device) -> LoraSegments:
    """Tiles of `token_slot` [T] integer (CPU): each token's slot, negative for a base-model
    token. Tiles hold at most 16 tokens where no slot has more than 16 (decode steps),
    else 64. The result is copied to `device` in one transfer."""
    if token_slot.dim() != 1 or token_slot.dtype.is_floating_point:
        raise ValueError(f"token_slot must be [T] integer, got {tuple(token_slot.shape)}")
    token_slot = token_slot.cpu().long()
    adapted = torch.nonzero(token_slot >= 0).flatten()
    slots, order = torch.sort(token_slot[adapted], stable=True)
    token_index = adapted[order]
    uniq, counts = torch.unique_consecutive(slots, return_counts=True)
    block_m = 16 if counts.numel() == 0 or int(counts.max()) <= 16 else 64
    tiles = (counts + block_m - 1) // block_m  # per slot
    seg_of_tile = torch.repeat_interleave(torch.arange(len(uniq)), tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles
    nth = torch.arange(int(tiles.sum())) - first_tile[seg_of_tile]
    seg_start = torch.cumsum(counts, 0) - counts
    tile_start = seg_start[seg_of_tile] + nth * block_m
    tile_end = torch.minimum(tile_start + block_m, (seg_start + counts)[seg_of_tile])
    parts = (token_index, tile_start, tile_end, uniq[seg_of_tile])
    packed = torch.cat(parts).to(torch.int32).to(device, non_blocking=True)
    split = packed.split([p.numel() for p in parts])
    return LoraSegments(*split, block_m)


def _check(x: torch.Tensor, weights: torch.Tensor, segments: LoraSegments, name: str) -> None:
    if x.dim() != 2 or weights.dim() != 2:
        raise ValueError(
            f"x and {name} must be 2-D, got {tuple(x.shape)} and {tuple(weights.shape)}"
        )
    devices = {x.device, weights.device, segments.token_index.device}
    if len(devices) != 1:
        raise ValueError(f"x, {name} and the segments must share one device, got {devices}")


def _input_precision(dtype: torch.dtype) -> str:
    # float32 products in full precision, as torch's default matmul; others ignore it
    return "ieee" if dtype == torch.float32 else "tf32"


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, segments: LoraSegments, cols_per_slot: int
) -> torch.Tensor:
    """x [T, in] times each adapted token's slot columns of a [in, L * C]: returns [N, C]
    x.dtype, row j for token segments.token_index[j] (accumulated in float32, rounded once).
    Reads only; last dims must be contiguous (they are made so otherwise)."""
    _check(x, a, segments, "a")
    if a.shape[0] != x.shape[1] or a.shape[1] % cols_per_slot:
        raise ValueError(
            f"a must be [in, L * C] = [{x.shape[1]}, L * {cols_per_slot}], got {tuple(a.shape)}"
        )
    n = segments.num_tokens
    y = torch.empty(n, cols_per_slot, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    x = x if x.stride(-1) == 1 else x.contiguous()
    a = a if a.stride(-1) == 1 else a.contiguous()
    block_n = min(SHRINK_BLOCK_N, max(16, next_power_of_2(cols_per_slot)))
    kernel = load_triton_module("_lora_triton").lora_shrink_kernel
    grid = (segments.tile_start.shape[0], cdiv(cols_per_slot, block_n))
    kernel[grid](
        x,
        a,
        y,
        segments.token_index,
        segments.tile_start,
        segments.tile_end,
        segments.tile_slot,
        x.stride(0),
        a.stride(0),
        y.stride(0),
        x.shape[1],
        cols_per_slot,
        INPUT_PRECISION=_input_precision(x.dtype),
        BLOCK_M=segments.block_m,
        BLOCK_N=block_n,
        BLOCK_K=SHRINK_BLOCK_K,
    )
    return y


def lora_expand_add(
    out: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor, segments: LoraSegments, rank: int
) -> torch.Tensor:
    """out[token] += shrunk[j] @ b[slot * R : (slot + 1) * R] for each adapted token
    (token = segments.token_index[j]); mutates `out` [T, out] in place (base tokens keep
    their values) and returns it. shrunk: [N, R] (a column slice of lora_shrink's result is
    fine), b: [L * R, out]; the sum is taken in float32 and rounded once to out.dtype.
    `out` may be a column slice of a wider tensor; its last dim must be contiguous."""
    _check(shrunk, b, segments, "b")
    if (
        shrunk.shape != (segments.num_tokens, rank)
        or b.shape[0] % rank
        or b.shape[1] != out.shape[1]
    ):
        raise ValueError(
            f"shrunk must be [N, R] = [{segments.num_tokens}, {rank}] and b [L * R, "
            f"{out.shape[1]}], got {tuple(shrunk.shape)} and {tuple(b.shape)}"
        )
    if out.stride(-1) != 1:
        raise ValueError("out's last dim must be contiguous (it is written in place)")
    if segments.num_tokens == 0:
        return out
    shrunk = shrunk if shrunk.stride(-1) == 1 else shrunk.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    block_k = min(EXPAND_BLOCK_K_MAX, max(16, next_power_of_2(rank)))
    kernel = load_triton_module("_lora_triton").lora_expand_kernel
    grid = (segments.tile_start.shape[0], cdiv(out.shape[1], EXPAND_BLOCK_N))
    kernel[grid](
        shrunk,
        b,
        out,
        segments.token_index,
        segments.tile_start,
        segments.tile_end,
        segments.tile_slot,
        shrunk.stride(0),
        b.stride(0),
        out.stride(0),
        out.shape[1],
        rank,
        INPUT_PRECISION=_input_precision(shrunk.dtype),
        BLOCK_M=segments.block_m,
        BLOCK_N=EXPAND_BLOCK_N,
        BLOCK_K=block_k,
    )
    return out


def _token_slots(segments: LoraSegments) -> tuple[torch.Tensor, torch.Tensor]:
    """Each adapted token's row and slot ([N] int64 each), from the tiles."""
    lengths = (segments.tile_end - segments.tile_start).long()
    return segments.token_index.long(), torch.repeat_interleave(segments.tile_slot.long(), lengths)


def lora_shrink_reference(
    x: torch.Tensor, a: torch.Tensor, segments: LoraSegments, cols_per_slot: int
) -> torch.Tensor:
    """Torch version of `lora_shrink` (same contract; gathers each token's weights)."""
    _check(x, a, segments, "a")
    rows, slots = _token_slots(segments)
    per_slot = a.view(a.shape[0], -1, cols_per_slot).transpose(0, 1)  # [L, in, C]
    y = torch.bmm(x[rows].float().unsqueeze(1), per_slot[slots].float())
    return y.squeeze(1).to(x.dtype)


def lora_expand_add_reference(
    out: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor, segments: LoraSegments, rank: int
) -> torch.Tensor:
    """Torch version of `lora_expand_add` (same contract; gathers each token's weights)."""
    _check(shrunk, b, segments, "b")
    rows, slots = _token_slots(segments)
    per_slot = b.view(-1, rank, b.shape[1])  # [L, R, out]
    delta = torch.bmm(shrunk.float().unsqueeze(1), per_slot[slots].float()).squeeze(1)
    out[rows] = (out[rows].float() + delta).to(out.dtype)
    return out
