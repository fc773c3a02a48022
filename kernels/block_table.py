"""Attention metadata built on the device from a padded block table.

Row r of `block_tables` lists the KV blocks of request r in order; entries past the
ones its sequence uses are padding and never read. The token at absolute position p of
row r lives in block `block_tables[r, p // B]` at offset `p % B` (flat slot
`block * B + offset`), as in `radixrt.kv.pool`.
"""

from typing import NamedTuple

import torch

from ._triton import load_triton_module

_BLOCK = 256  # entries copied per loop iteration of one program


class KVMetadata(NamedTuple):
    kv_indptr: torch.Tensor  # [R + 1] int32: prefix sums of the rows' block counts
    kv_indices: torch.Tensor  # [sum ceil(seq_len / B)] int32: the used block ids, concatenated
    kv_last_page_len: torch.Tensor  # [R] int32: tokens in each row's last block, 1..B


class TokenMetadata(NamedTuple):
    positions: torch.Tensor  # [T] int64: absolute position of each new token
    slot_mapping: torch.Tensor  # [T] int64: flat KV slot (block * B + offset) of each new token


def _check_table(block_tables: torch.Tensor, block_size: int, **rows: torch.Tensor) -> None:
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be [R, max_blocks] int32, got "
            f"{tuple(block_tables.shape)} {block_tables.dtype}"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_rows = block_tables.shape[0]
    for name, t in rows.items():
        length = num_rows + 1 if name == "qo_indptr" else num_rows
        if t.shape != (length,) or t.dtype != torch.int32:
            raise ValueError(
                f"{name} must be [{length}] int32 (R = {num_rows}), got {tuple(t.shape)} {t.dtype}"
            )
        if t.device != block_tables.device:
            raise ValueError(
                f"{name} is on {t.device} but block_tables on {block_tables.device}; "
                "all inputs must share one device"
            )


def build_kv_metadata(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    num_kv_indices: int | None = None,
) -> KVMetadata:
    """Paged-KV metadata (FlashInfer's kv_indptr / kv_indices / kv_last_page_len).

    block_tables: [R, max_blocks] int32, any device (any strides): padded block table.
    seq_lens:     [R] int32, same device: KV length of each row after this step; each must
                  be in 1..max_blocks * block_size (not checked: that needs a host sync).
                  Row r uses the first ceil(seq_lens[r] / block_size) entries of its row.
    num_kv_indices: sum of ceil(seq_lens / block_size) when the caller knows it (e.g. from
                  CPU copies); then no host sync happens. If None, it is read back from the
                  device (one sync). A wrong value leaves kv_indices short or partly unset.
    Returns fresh tensors on block_tables' device; reads nothing past each row's used blocks.
    """
    _check_table(block_tables, block_size, seq_lens=seq_lens)
    device = block_tables.device
    num_rows, max_blocks = block_tables.shape
    num_blocks = (seq_lens + (block_size - 1)) // block_size  # [R] int32
    kv_indptr = torch.zeros(num_rows + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(num_blocks, 0, dtype=torch.int32)
    kv_last_page_len = seq_lens - (num_blocks - 1) * block_size
    if num_kv_indices is None:
        num_kv_indices = int(kv_indptr[-1].item())  # host sync
    kv_indices = torch.empty(num_kv_indices, dtype=torch.int32, device=device)
    if num_rows > 0 and num_kv_indices > 0:
        kernel = load_triton_module("_block_table_triton").kv_indices_kernel
        kernel[(num_rows,)](
            block_tables,
            seq_lens,
            kv_indptr,
            kv_indices,
            block_tables.stride(0),
            block_tables.stride(1),
            max_blocks,
            num_kv_indices,
            block_size,
            BLOCK=_BLOCK,
        )
    return KVMetadata(kv_indptr, kv_indices, kv_last_page_len)


def build_token_metadata(
    block_tables: torch.Tensor,
    start_pos: torch.Tensor,
    num_new: torch.Tensor,
    qo_indptr: torch.Tensor,
    num_tokens: int,
    block_size: int,
) -> TokenMetadata:
    """Positions and KV slots of a batch's new tokens, one program per row.

    block_tables: [R, max_blocks] int32, any device (any strides): padded block table.
    start_pos:    [R] int32, same device: tokens of the row already in KV (cached prefix).
    num_new:      [R] int32, same device: new tokens of the row (0 allowed).
    qo_indptr:    [R + 1] int32, same device: row r's new tokens are [qo_indptr[r],
                  qo_indptr[r+1]) of the flattened batch; qo_indptr[r+1] - qo_indptr[r] must
                  equal num_new[r] and qo_indptr[R] must equal num_tokens.
    num_tokens:   T, a host int (no sync).
    Token j of row r gets position p = start_pos[r] + j and slot
    block_tables[r, p // B] * B + p % B; every p // B must be < max_blocks. None of the
    "must"s is checked here (each needs a host sync); `build_token_metadata_reference`
    checks them.
    Returns fresh [T] int64 tensors on block_tables' device.
    """
    _check_table(
        block_tables, block_size, start_pos=start_pos, num_new=num_new, qo_indptr=qo_indptr
    )
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    device = block_tables.device
    positions = torch.empty(num_tokens, dtype=torch.int64, device=device)
    slot_mapping = torch.empty(num_tokens, dtype=torch.int64, device=device)
    num_rows, max_blocks = block_tables.shape
    if num_rows > 0 and num_tokens > 0:
        kernel = load_triton_module("_block_table_triton").token_metadata_kernel
        kernel[(num_rows,)](
            block_tables,
            start_pos,
            num_new,
            qo_indptr,
            positions,
            slot_mapping,
            block_tables.stride(0),
            block_tables.stride(1),
            max_blocks,
            num_tokens,
            block_size,
            BLOCK=_BLOCK,
        )
    return TokenMetadata(positions, slot_mapping)


def build_block_table(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, out: torch.Tensor, num_rows: int
) -> torch.Tensor:
    """Rows [0, num_rows) of `out` from concatenated block ids (the inverse of
    `build_kv_metadata`): out[r, j] = kv_indices[kv_indptr[r] + j] for
    j < min(kv_indptr[r + 1] - kv_indptr[r], out.shape[1]); the other entries are left as
    they are. Decode kernels that take a padded block table read it (FlashInfer's XQA).

    kv_indptr: [>= num_rows + 1] int32 or int64; kv_indices: int32; out: [>= num_rows, W]
    int32 with unit column stride; all on one device. No host sync. Returns out[:num_rows].
    """
    if out.dim() != 2 or out.dtype != torch.int32 or (out.shape[1] > 1 and out.stride(1) != 1):
        raise ValueError(
            f"out must be [rows, W] int32 with unit column stride, got {tuple(out.shape)} "
            f"{out.dtype} strides {out.stride()}"
        )
    if kv_indptr.dtype not in (torch.int32, torch.int64) or kv_indices.dtype != torch.int32:
        raise ValueError(
            f"kv_indptr must be int32/int64 and kv_indices int32, got {kv_indptr.dtype} and "
            f"{kv_indices.dtype}"
        )
    if not 0 <= num_rows <= out.shape[0] or kv_indptr.numel() < num_rows + 1:
        raise ValueError(
            f"num_rows = {num_rows} needs out of >= {num_rows} rows (has {out.shape[0]}) and "
            f"kv_indptr of >= {num_rows + 1} entries (has {kv_indptr.numel()})"
        )
    if len({t.device for t in (kv_indptr, kv_indices, out)}) != 1:
        raise ValueError("kv_indptr, kv_indices and out must share one device")
    if num_rows > 0 and out.shape[1] > 0 and kv_indices.numel() > 0:
        kernel = load_triton_module("_block_table_triton").block_table_kernel
        kernel[(num_rows,)](kv_indptr, kv_indices, out, out.stride(0), out.shape[1], BLOCK=_BLOCK)
    return out[:num_rows]


def build_block_table_reference(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, out: torch.Tensor, num_rows: int
) -> torch.Tensor:
    """Torch version of `build_block_table` (writes `out` the same way)."""
    indptr = kv_indptr.tolist()
    width = out.shape[1]
    for row in range(num_rows):
        n = min(indptr[row + 1] - indptr[row], width)
        out[row, :n] = kv_indices[indptr[row] : indptr[row] + n]
    return out[:num_rows]


def build_kv_metadata_reference(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    num_kv_indices: int | None = None,
) -> KVMetadata:
    """Torch version of `build_kv_metadata` (loops over rows; checks seq_lens' range)."""
    _check_table(block_tables, block_size, seq_lens=seq_lens)
    max_blocks = block_tables.shape[1]
    indptr, indices, last_page_len = [0], [], []
    for row, seq_len in enumerate(seq_lens.tolist()):
        if not 1 <= seq_len <= max_blocks * block_size:
            raise ValueError(f"seq_lens[{row}] = {seq_len} not in 1..{max_blocks * block_size}")
        num_blocks = -(-seq_len // block_size)
        indices.append(block_tables[row, :num_blocks])
        indptr.append(indptr[-1] + num_blocks)
        last_page_len.append(seq_len - (num_blocks - 1) * block_size)
    if num_kv_indices is not None and num_kv_indices != indptr[-1]:
        raise ValueError(f"num_kv_indices = {num_kv_indices} but the rows use {indptr[-1]}")
    device = block_tables.device
    return KVMetadata(
        torch.tensor(indptr, dtype=torch.int32, device=device),
        torch.cat(indices) if indices else block_tables.new_empty(0),
        torch.tensor(last_page_len, dtype=torch.int32, device=device),
    )


def build_token_metadata_reference(
    block_tables: torch.Tensor,
    start_pos: torch.Tensor,
    num_new: torch.Tensor,
    qo_indptr: torch.Tensor,
    num_tokens: int,
    block_size: int,
) -> TokenMetadata:
    """Torch version of `build_token_metadata` (loops over rows; checks the "must"s)."""
    _check_table(
        block_tables, block_size, start_pos=start_pos, num_new=num_new, qo_indptr=qo_indptr
    )
    indptr = qo_indptr.tolist()
    if indptr[0] != 0 or indptr[-1] != num_tokens:
        raise ValueError(f"qo_indptr must run from 0 to num_tokens = {num_tokens}, got {indptr}")
    max_blocks = block_tables.shape[1]
    positions, slots = [], []
    for row, (start, count) in enumerate(zip(start_pos.tolist(), num_new.tolist())):
        if start < 0 or count < 0:
            raise ValueError(f"row {row}: start_pos {start} and num_new {count} must be >= 0")
        if indptr[row + 1] - indptr[row] != count:
            raise ValueError(f"qo_indptr and num_new disagree on row {row}")
        if count and (start + count - 1) // block_size >= max_blocks:
            raise ValueError(f"row {row} reaches past its {max_blocks} blocks")
        pos = torch.arange(start, start + count, device=block_tables.device)
        positions.append(pos)
        slots.append(block_tables[row, pos // block_size].long() * block_size + pos % block_size)
    empty = torch.empty(0, dtype=torch.int64, device=block_tables.device)
    return TokenMetadata(
        torch.cat(positions) if positions else empty, torch.cat(slots) if slots else empty
    )
