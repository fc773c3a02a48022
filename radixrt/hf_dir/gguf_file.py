"""A GGUF file (llama.cpp's format, read with the `gguf` library) as a model dir radixrt
reads: config.json from the file's metadata, the tokenizer and chat template from the file's
metadata (transformers' GGUF tokenizer conversion) or from another model dir, and a link to
the GGUF file itself with a table of its tensors, which `radixrt.model.gguf_loader`
dequantizes at load.

The dir is prepared once per file (keyed by its path, size and modification time) under
~/.cache/radixrt/gguf/. Architectures other than llama (Llama, Mistral), qwen2 and qwen3 and
tensor types other than `SUPPORTED_TYPES` are refused here, before anything loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from radixrt.config import ModelConfig

# GGUF `general.architecture` -> the HF architecture whose weights it holds
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_TYPES = frozenset(
    ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
    + ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
LINK_NAME = "model.gguf"
# [{"name": HF name, "type": GGML type name, "shape": HF shape, "offset": byte offset,
#   "nbytes": bytes}]: where each tensor lies (gguf's reader parses every metadata string,
#   seconds for a real vocabulary; the loader reads this table instead)
TENSOR_INDEX = "gguf_tensors.json"
PREPARED_FORMAT = 2  # bump when the prepared dir's contents change
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`), or None for a tensor radixrt does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def read_gguf(path: str) -> Any:
    """A `gguf.GGUFReader` over `path` (memory-mapped: reads no tensor data yet)."""
    import gguf

    return gguf.GGUFReader(path)


def field(reader: Any, key: str, default: Any = None) -> Any:
    """The value of a metadata key of a GGUF file (`reader`: `read_gguf`), or `default`."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_architecture(reader: Any) -> str:
    """The file's `general.architecture`; raises ValueError unless radixrt serves it."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    return arch


def gguf_config(reader: Any) -> dict[str, Any]:
    """An HF config.json dict from a GGUF file's metadata. Raises ValueError naming the
    architecture, tensor type, tensor or metadata key that radixrt cannot serve."""
    arch = gguf_architecture(reader)
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise ValueError(
                f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which radixrt does not "
                f"dequantize; supported: {', '.join(sorted(SUPPORTED_TYPES))}"
            )
        if hf_tensor_name(t.name) is None:
            raise ValueError(f"GGUF tensor {t.name!r} ({arch}) is not supported")
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"GGUF {arch}.rope.scaling.type={scaling!r} is not supported")
    hidden = field(reader, f"{arch}.embedding_length")
    heads = field(reader, f"{arch}.attention.head_count")
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens else int(tensors["token_embd.weight"].shape[1])
    cfg = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": field(reader, f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": field(reader, f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": field(reader, f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "hidden_act": "silu",
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
    }
    ModelConfig.from_hf_dict(cfg)  # refuse here what the model code cannot run
    return cfg


def prepare_gguf_dir(gguf_path: str, tokenizer: str | None = None) -> str:
    """The model dir radixrt reads for the GGUF file `gguf_path` (config.json, tokenizer
    files, `model.gguf` linking to the file), written once into the cache, atomically. The
    tokenizer is `tokenizer`'s (a model dir holding tokenizer.json) when given, else built
    from the file's metadata. Raises ValueError (see `gguf_config`) or FileNotFoundError."""
    gguf_path = os.path.realpath(gguf_path)
    st = os.stat(gguf_path)
    key_parts = [gguf_path, st.st_size, st.st_mtime_ns, PREPARED_FORMAT]
    if tokenizer is not None:
        tokenizer = os.path.realpath(tokenizer)
        if not os.path.isfile(os.path.join(tokenizer, "tokenizer.json")):
            raise FileNotFoundError(f"--tokenizer {tokenizer!r} holds no tokenizer.json")
        key_parts.append(tokenizer)
    key = hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    out = os.path.join(os.path.expanduser("~/.cache/radixrt/gguf"), f"{stem}-{key}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    reader = read_gguf(gguf_path)
    cfg = gguf_config(reader)
    index = [
        {
            "name": hf_tensor_name(t.name),
            "type": t.tensor_type.name,
            "shape": [int(n) for n in reversed(t.shape)],  # GGUF lists dims innermost first
            "offset": int(t.data_offset),
            "nbytes": int(t.n_bytes),
        }
        for t in reader.tensors
    ]
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{stem}-", dir=os.path.dirname(out))
    try:
        if tokenizer is None:
            write_tokenizer(gguf_path, tmp)
        else:
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(tokenizer, name)):
                    shutil.copy(os.path.join(tokenizer, name), tmp)
        os.symlink(gguf_path, os.path.join(tmp, LINK_NAME))
        with open(os.path.join(tmp, TENSOR_INDEX), "w") as f:
            json.dump(index, f)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)  # written last: its presence marks a complete dir
        os.rename(tmp, out)
    except OSError:
        if not os.path.isfile(os.path.join(out, "config.json")):
            raise  # not a concurrent preparer's win
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def write_tokenizer(gguf_path: str, out_dir: str) -> None:
    """Save the tokenizer and chat template of a GGUF file's metadata into `out_dir`.
    transformers' GGUF reader imports torch, so a process without torch runs it in a child."""
    if "torch" in sys.modules:
        _convert_tokenizer(gguf_path, out_dir)
        return
    cmd = [sys.executable, "-m", "radixrt.hf_dir.gguf_file", gguf_path, out_dir]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["no output"]
        raise ValueError(f"cannot build the tokenizer of {gguf_path!r}: {lines[-1]}")


def _convert_tokenizer(gguf_path: str, out_dir: str) -> None:
    from transformers import AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    tok.save_pretrained(out_dir)


if __name__ == "__main__":
    _convert_tokenizer(sys.argv[1], sys.argv[2])
