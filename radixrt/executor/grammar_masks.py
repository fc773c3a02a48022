"""Applying grammar bitmasks to logits (the runner's side; imports torch, xgrammar lazily).

A mask is what `GrammarMatcher.next_mask()` returns: packed little-endian int32 words, bit set
= token allowed. Masked-out logits become -inf, before temperature / top-k / top-p.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)


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
    xgrammar's kernel (CUDA) or its CPU path. Should xgrammar's CUDA kernel fail to load (it
    is built on first use), a torch implementation takes over, with one warning."""
    global _xgrammar_cuda_failed
    bitmask = stack_masks(masks, pin=logits.is_cuda)
    vocab = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab:  # a mask narrower than the logits: the rest is banned
        logits[list(rows), bitmask.shape[1] * 32 :] = float("-inf")
    if logits.is_cuda:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    full = len(rows) == logits.shape[0] and list(rows) == list(range(len(rows)))
    index = None
    if not full:
        index = torch.tensor(list(rows), dtype=torch.int64).to(logits.device, non_blocking=True)
    target = logits if full else logits.index_select(0, index)
    if logits.is_cuda and _xgrammar_cuda_failed:
        _apply_torch(target, bitmask)
    else:
        import xgrammar as xgr

        try:
            if logits.is_cuda and (vocab, logits.dtype, logits.device) not in _warm:
                _warm_up(logits, bitmask.shape[1])
            xgr.apply_token_bitmask_inplace(target, bitmask, vocab_size=vocab)
        except Exception:
            if not logits.is_cuda:
                raise
            logger.warning("xgrammar's CUDA mask kernel failed: masking with torch", exc_info=True)
            _xgrammar_cuda_failed = True
            _apply_torch(target, bitmask)
    if not full:
        logits.index_copy_(0, index, target)


_xgrammar_cuda_failed = False
_warm: set[tuple] = set()  # (vocab, dtype, device) of logits whose variants are compiled


def _warm_up(logits: torch.Tensor, width: int) -> None:
    """Compile xgrammar's Triton mask kernel for every batch size at once, on scratch rows
    like `logits`'s: Triton compiles a variant for a row count of 1, one for multiples of 16
    and one for the rest, and a variant first met mid-serving stalls its step while it
    compiles."""
    vocab = logits.shape[1]
    import xgrammar as xgr

    scratch = torch.zeros((16, vocab), dtype=logits.dtype, device=logits.device)
    ones = torch.full((16, width), -1, dtype=torch.int32, device=logits.device)
    for n in (1, 2, 16):
        xgr.apply_token_bitmask_inplace(scratch[:n], ones[:n], vocab_size=vocab)
    _warm.add((vocab, logits.dtype, logits.device))


def _apply_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The same masking in torch ([n, V] logits, [n, W] int32 bitmask, one device)."""
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [n, W, 32]
    allowed = bits.flatten(1)[:, : logits.shape[1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))
