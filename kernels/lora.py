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

A decode CUDA graph replays fixed grids over fixed addresses, so it takes padded segments
(`StaticLoraSegments`): token_index as long as the graph's bucket and as many tiles as any
batch of that many tokens can need (`max_lora_tiles`), the unused ones empty (start ==
end: their programs return at once); positions of token_index that no tile covers are
never read, and their shrunk rows are neither written nor read.
"""

from typing import NamedTuple

import numpy as np
import torch

from ._triton import cdiv, load_triton_module, next_power_of_2

SHRINK_BLOCK_N = 64
SHRINK_BLOCK_K = 64
EXPAND_BLOCK_N = 64
EXPAND_BLOCK_K_MAX = 64
DECODE_BLOCK_M = 16  # tokens per tile where no slot has more (decode steps, CUDA graphs)


class LoraSegments(NamedTuple):
    """A batch's adapted tokens grouped by slot, in tiles (all int32, on the kernels' device).
    Built per step (`build_lora_segments`: N adapted tokens, NT tiles, all used) or padded
    for a CUDA graph (`StaticLoraSegments`: see the module docstring)."""

    token_index: torch.Tensor  # [N] the adapted tokens (rows of x / out), grouped by slot
    tile_start: torch.Tensor  # [NT] each tile's first position in token_index
    tile_end: torch.Tensor  # [NT] one past its last (at most block_m after its start)
    tile_slot: torch.Tensor  # [NT] the slot every token of the tile runs under
    block_m: int  # tokens per tile at most

    @property
    def num_tokens(self) -> int:
        """Rows of the shrunk tensor (N; a padded batch's bucket)."""
        return self.token_index.shape[0]


def _group_tokens(token_slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token_index [N], slots [S], counts [S]) int64: the adapted tokens of `token_slot`
    [T] (negative: a base token) grouped by slot in token order, the slots used, ascending,
    and their numbers of tokens."""
    adapted = np.flatnonzero(token_slot >= 0)
    order = np.argsort(token_slot[adapted], kind="stable")
    token_index = adapted[order]
    slots, counts = np.unique(token_slot[token_index], return_counts=True)
    return token_index, slots, counts


def _tiles(
    slots: np.ndarray, counts: np.ndarray, block_m: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tile_start, tile_end, tile_slot) [NT] int64 over token_index of `_group_tokens`:
    each slot's tokens in tiles of at most block_m."""
    tiles = (counts + block_m - 1) // block_m  # per slot
    seg_of_tile = np.repeat(np.arange(len(slots)), tiles)
    first_tile = np.cumsum(tiles) - tiles
    nth = np.arange(int(tiles.sum())) - first_tile[seg_of_tile]
    seg_start = np.cumsum(counts) - counts
    tile_start = seg_start[seg_of_tile] + nth * block_m
    tile_end = np.minimum(tile_start + block_m, (seg_start + counts)[seg_of_tile])
    return tile_start, tile_end, slots[seg_of_tile]


def max_lora_tiles(num_tokens: int, num_slots: int, block_m: int = DECODE_BLOCK_M) -> int:
    """Most tiles a batch of up to `num_tokens` adapted tokens over `num_slots` slots needs:
    a slot of c tokens takes ceil(c / block_m) <= (c + block_m - 1) / block_m tiles, and
    every tile holds a token."""
    used = min(num_slots, num_tokens)
    return min(num_tokens, (num_tokens + (block_m - 1) * used) // block_m)


def build_lora_segments(token_slot: torch.Tensor, device: torch.device) -> LoraSegments:
    """Tiles of `token_slot` [T] integer (CPU): each token's slot, negative for a base-model
    token. Tiles hold at most 16 tokens where no slot has more than 16 (decode steps),
    else 64. The result is copied to `device` in one transfer."""
    if token_slot.dim() != 1 or token_slot.dtype.is_floating_point:
        raise ValueError(f"token_slot must be [T] integer, got {tuple(token_slot.shape)}")
    token_index, slots, counts = _group_tokens(token_slot.cpu().long().numpy())
    block_m = DECODE_BLOCK_M if not len(counts) or counts.max() <= DECODE_BLOCK_M else 64
    parts = (token_index, *_tiles(slots, counts, block_m))
    packed = torch.from_numpy(np.concatenate(parts).astype(np.int32))
    packed = packed.to(device, non_blocking=True)
    split = packed.split([len(p) for p in parts])
    return LoraSegments(*split, block_m)


class StaticLoraSegments:
    """Padded segments at fixed device addresses for decode CUDA graphs of up to
    `max_tokens` tokens over `num_slots` slots (tiles of DECODE_BLOCK_M tokens). `view(bucket)`
    is the LoraSegments a graph of `bucket` tokens is captured with; `fill` writes a step's
    tiles into them before its replay. One int32 buffer: token_index [max_tokens], then
    tile_start, tile_end and tile_slot [max_lora_tiles(max_tokens, num_slots)] each."""

    def __init__(self, max_tokens: int, num_slots: int, device: torch.device) -> None:
        self.max_tokens, self.num_slots = max_tokens, num_slots
        self.max_tiles = max_lora_tiles(max_tokens, num_slots)
        size = max_tokens + 3 * self.max_tiles
        # a pinned host copy: one non-blocking transfer per step, like the graphs' inputs
        self._host = torch.zeros(size, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._device = torch.zeros(size, dtype=torch.int32, device=device)

    def _sections(self, buffer: torch.Tensor, bucket: int) -> list[torch.Tensor]:
        n, t, tiles = self.max_tokens, self.max_tiles, max_lora_tiles(bucket, self.num_slots)
        return [buffer[:bucket], *(buffer[n + i * t : n + i * t + tiles] for i in range(3))]

    def view(self, bucket: int) -> LoraSegments:
        """The segments of graphs of `bucket` tokens: views of the device buffer (their
        addresses never change; their contents are the last `fill`'s)."""
        assert 0 < bucket <= self.max_tokens, bucket
        return LoraSegments(*self._sections(self._device, bucket), DECODE_BLOCK_M)

    def fill(self, token_slot: np.ndarray, bucket: int) -> None:
        """Write the tiles of `token_slot` [T <= bucket] int (negative: a base token; tokens
        past T are base too) into `view(bucket)`: built on the host, then one non-blocking
        copy. The previous fill's copy must have finished (the host buffer is rewritten)."""
        assert len(token_slot) <= bucket <= self.max_tokens, (len(token_slot), bucket)
        token_index, slots, counts = _group_tokens(np.asarray(token_slot))
        starts, ends, tile_slots = _tiles(slots, counts, DECODE_BLOCK_M)
        index, *tiles = (s.numpy() for s in self._sections(self._host, bucket))
        num_tiles = len(starts)
        assert num_tiles <= len(tiles[0]) and len(counts) <= self.num_slots, (num_tiles, counts)
        index[: len(token_index)] = token_index
        index[len(token_index) :] = 0  # padding: never read
        for section, values in zip(tiles, (starts, ends, tile_slots)):
            section[:num_tiles] = values
            section[num_tiles:] = 0  # empty tiles (start == end): their programs return
        self._device.copy_(self._host, non_blocking=True)


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


def _token_slots(segments: LoraSegments) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The positions in token_index that tiles cover, their tokens and slots ([n] int64
    each): every position of a built batch, the used ones of a padded batch."""
    starts, ends = segments.tile_start.long().cpu(), segments.tile_end.long().cpu()
    lengths = ends - starts
    first = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths)
    positions = (first + torch.arange(int(lengths.sum()))).to(segments.token_index.device)
    slots = torch.repeat_interleave(segments.tile_slot.long().cpu(), lengths)
    return positions, segments.token_index.long()[positions], slots.to(positions.device)


def lora_shrink_reference(
    x: torch.Tensor, a: torch.Tensor, segments: LoraSegments, cols_per_slot: int
) -> torch.Tensor:
    """Torch version of `lora_shrink` (same contract, rows no tile covers are zeros;
    gathers each token's weights)."""
    _check(x, a, segments, "a")
    positions, rows, slots = _token_slots(segments)
    per_slot = a.view(a.shape[0], -1, cols_per_slot).transpose(0, 1)  # [L, in, C]
    y = torch.zeros(segments.num_tokens, cols_per_slot, dtype=x.dtype, device=x.device)
    prod = torch.bmm(x[rows].float().unsqueeze(1), per_slot[slots].float())
    y[positions] = prod.squeeze(1).to(x.dtype)
    return y


def lora_expand_add_reference(
    out: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor, segments: LoraSegments, rank: int
) -> torch.Tensor:
    """Torch version of `lora_expand_add` (same contract; gathers each token's weights)."""
    _check(shrunk, b, segments, "b")
    positions, rows, slots = _token_slots(segments)
    per_slot = b.view(-1, rank, b.shape[1])  # [L, R, out]
    delta = torch.bmm(shrunk[positions].float().unsqueeze(1), per_slot[slots].float())
    out[rows] = (out[rows].float() + delta.squeeze(1)).to(out.dtype)
    return out
