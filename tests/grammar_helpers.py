"""Reference readings of grammar bitmasks for tests: a plan row's masks and one mask's
allowed tokens, decoded independently of the runner's kernels. Torch-free to import (the
scheduler's tests run where torch and numpy cannot be imported)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixrt.plan import StepPlan

if TYPE_CHECKING:
    import torch


def row_bitmasks(plan: StepPlan, i: int) -> bytes | None:
    """Row i's grammar masks in `plan` (one per sample, back to back), None if it has none."""
    masks = plan.bitmasks
    if masks is None or i not in masks.rows:
        return None
    counts = [len(plan.rows[j].sample_offsets) for j in masks.rows]
    width = len(masks.data) // sum(counts)
    at = masks.rows.index(i)
    first = sum(counts[:at]) * width
    return masks.data[first : first + counts[at] * width]


def allowed_tokens(mask: bytes, vocab_size: int) -> torch.Tensor:
    """[vocab_size] bool: the tokens one packed little-endian mask allows."""
    import numpy as np
    import torch

    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
    out = np.zeros(vocab_size, dtype=bool)
    n = min(vocab_size, len(bits))
    out[:n] = bits[:n].astype(bool)
    return torch.from_numpy(out)
