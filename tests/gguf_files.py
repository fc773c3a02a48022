"""GGUF files for tests, written with `gguf.GGUFWriter` the way llama.cpp's converter writes
them: gguf's own tensor name map, llama's q/k rows permuted, 2-D weights quantized with
`gguf.quants.quantize`, or K-quant tensors as random raw blocks."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
from gguf.quants import quantize
from safetensors.numpy import load_file

# a K-quant block's f16 scale fields (byte offsets), set to small finite values in random blocks
K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
}


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute` (HF rotate-half rows -> pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    hf_dir: str,
    out_path: str,
    arch: str,
    qtype: str = "F32",
    *,
    tokenizer_metadata: bool = False,
    arch_name: str | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]:
    """Write the HF checkpoint `hf_dir` (model.safetensors) as a GGUF file; 2-D weights in
    `qtype`, 1-D ones in F32. `tokenizer_metadata`: the dir's byte-level BPE tokenizer and
    chat template as gpt2 tokenizer metadata. `arch_name` overrides general.architecture;
    `extra_tensors` are written as they are (F32). Returns {gguf tensor name: (the array
    written, its type)}."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(out_path, arch_name or arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_value_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    eos = cfg["eos_token_id"]
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    if tokenizer_metadata:
        _add_tokenizer(w, hf_dir)
    names = gguf.get_tensor_name_map(ARCHS[arch], cfg["num_hidden_layers"])
    written = {}
    for hf_name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        t = t.astype(np.float32)
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            t = llama_permute(t, heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            t = llama_permute(t, kv_heads)
        kind = gguf.GGMLQuantizationType[qtype if t.ndim == 2 else "F32"]
        data = quantize(t, kind) if kind.name != "F32" else t
        w.add_tensor(name, data, raw_dtype=kind if kind.name != "F32" else None)
        written[name] = (data, kind)
    for name, t in (extra_tensors or {}).items():
        w.add_tensor(name, t)
    _finish(w)
    return written


def write_random_kquant_gguf(out_path: str, qtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    """A one-layer llama (hidden 256, 4 heads of 64, 2 KV heads, FFN 512, vocabulary 256) whose
    2-D weights are random raw `qtype` blocks (finite scales). Returns {gguf name: raw bytes}."""
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[qtype]
    block, nbytes = gguf.GGML_QUANT_SIZES[kind]
    w = gguf.GGUFWriter(out_path, "llama")
    for add, value in [
        (w.add_block_count, 1), (w.add_context_length, 512), (w.add_embedding_length, 256),
        (w.add_feed_forward_length, 512), (w.add_head_count, 4), (w.add_head_count_kv, 2),
        (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0),
        (w.add_bos_token_id, 1), (w.add_eos_token_id, 2),
    ]:  # fmt: skip
        add(value)
    shapes = {
        "token_embd.weight": (256, 256), "output.weight": (256, 256),
        "blk.0.attn_q.weight": (256, 256), "blk.0.attn_k.weight": (128, 256),
        "blk.0.attn_v.weight": (128, 256), "blk.0.attn_output.weight": (256, 256),
        "blk.0.ffn_gate.weight": (512, 256), "blk.0.ffn_up.weight": (512, 256),
        "blk.0.ffn_down.weight": (256, 512),
    }  # fmt: skip
    written = {}
    for name, (rows, cols) in shapes.items():
        raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
        for off in K_SCALE_OFFSETS[qtype]:
            scale = rng.uniform(1e-3, 2e-3, size=raw.shape[:2]).astype(np.float16)
            raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
        raw = raw.reshape(rows, -1)
        w.add_tensor(name, raw, raw_dtype=kind)
        written[name] = raw
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        w.add_tensor(name, rng.uniform(0.5, 1.5, 256).astype(np.float32))
    _finish(w)
    return written


def _add_tokenizer(w: gguf.GGUFWriter, hf_dir: str) -> None:
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    control, normal = gguf.TokenType.CONTROL, gguf.TokenType.NORMAL
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([control if i in special else normal for i in range(len(tokens))])
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_add_bos_token(False)
    with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
        template = json.load(f).get("chat_template")
    if template is None and os.path.isfile(os.path.join(hf_dir, "chat_template.jinja")):
        with open(os.path.join(hf_dir, "chat_template.jinja")) as f:
            template = f.read()
    if template:
        w.add_chat_template(template)


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
