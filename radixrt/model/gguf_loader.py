"""The weights of a GGUF model dir (`radixrt.hf_dir.gguf_file.prepare_gguf_dir`) as HF-named
torch tensors, dequantized at load with `gguf`'s own dequantizer (`gguf.quants.dequantize`,
float32), llama's Q/K row permutation undone. Which architectures and tensor types load is
decided when the dir is prepared."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import numpy as np
import torch

from radixrt.config import ModelConfig
from radixrt.hf_dir.gguf_file import LINK_NAME, TENSOR_INDEX

CHUNK_ROWS = 4096
PERMUTED = ("q_proj.weight", "k_proj.weight")


def iterate_gguf_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF parameter name, float32 CPU tensor in HF layout) for every tensor of the GGUF file
    of `model_dir`, in the file's order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    cfg = ModelConfig.from_pretrained(model_dir)
    with open(os.path.join(model_dir, TENSOR_INDEX)) as f:
        index = json.load(f)
    data = np.memmap(os.path.join(model_dir, LINK_NAME), dtype=np.uint8, mode="r")
    for t in index:
        name, shape = t["name"], t["shape"]
        rows = shape[0] if shape else 1
        raw = data[t["offset"] : t["offset"] + t["nbytes"]].reshape(rows, -1)
        out = torch.empty(shape, dtype=torch.float32)
        flat = out.view(rows, -1).numpy()
        kind = GGMLQuantizationType[t["type"]]
        for start in range(0, rows, CHUNK_ROWS):  # bounded temporaries: the process stays small
            flat[start : start + CHUNK_ROWS] = dequantize(raw[start : start + CHUNK_ROWS], kind)
        if cfg.architecture == "LlamaForCausalLM" and name.endswith(PERMUTED):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            out = torch.from_numpy(unpermute_rows(flat, heads))
        yield name, out


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which reorders each head's rows of a llama q/k projection
    from HF's rotate-half layout (first halves, then second halves) to interleaved pairs.
    `w`: [num_heads * head_dim, hidden]."""
    half = w.shape[0] // num_heads // 2
    out = w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(out).reshape(w.shape)
