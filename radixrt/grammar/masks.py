"""Applying grammar bitmasks to logits (the runner's side; imports torch, xgrammar lazily).

A mask is what `GrammarMatcher.next_mask()` returns: packed little-endian int32 words, bit set
= token allowed. Masked-out logits become -inf, before temperature / top-k / top-p.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def stack_masks(masks: Sequence[bytes], pin: bool = False) -> torch.Tensor:
    """[len(masks), W] int32 (host; pinned if `pin`) from packed masks of equal length, with
    one copy."""
    width = len(masks[0]) // 4
    out = torch.empty((len(masks), width), dtype=torch.int32, pin_memory=pin)
    view = out.numpy()
    for i, m in enumerate(masks):
        view[i] = np.frombuffer(m, dtype=np.int32)
    return out


def apply_token_bitmasks(
    logits: torch.Tensor,  # [S, V] float32, modified in place
    masks: Sequence[bytes],  # one per masked sample
    rows: Sequence[int],  # the logits row of each mask, distinct
) -> None:
    """Set logits[rows[i], t] = -inf where mask i disallows t (and for t past the mask), with
    xgrammar's kernel (CUDA) or its CPU path."""
    import xgrammar as xgr

    bitmask = stack_masks(masks, pin=logits.is_cuda)
    vocab = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab:  # a mask narrower than the logits: the rest is banned
        logits[list(rows), bitmask.shape[1] * 32 :] = float("-inf")
    if logits.is_cuda:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
        return
    index = torch.tensor(list(rows), dtype=torch.int64).to(logits.device, non_blocking=True)
    sub = logits.index_select(0, index)
    xgr.apply_token_bitmask_inplace(sub, bitmask, vocab_size=vocab)
    logits.index_copy_(0, index, sub)


def allowed_tokens(mask: bytes, vocab_size: int) -> torch.Tensor:
    """[vocab_size] bool: the reference decoding of one mask (tests)."""
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
    out = np.zeros(vocab_size, dtype=bool)
    n = min(vocab_size, len(bits))
    out[:n] = bits[:n].astype(bool)
    return torch.from_numpy(out)
