"""Tiny random HF-format checkpoints, made locally, for tests and CPU demos.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained on the
corpus shipped in `radixrt/model/data/corpus.txt`, and the weights are random.

- `make_tiny_model`: the default tiny Llama (tokenizer, chat template, config, weights).
- `ensure_tiny_model`: the same, built once into a shared cache dir, atomically.
- `make_hf_checkpoint`: tiny llama/qwen2/qwen3/mistral dirs (sharded, tied, rope scaling).

`config.json` is written in the layout of checkpoints on the Hub (top-level `rope_theta`,
`rope_scaling`, `torch_dtype`), which is what `radixrt.config.ModelConfig` parses; newer
transformers save `rope_parameters`/`dtype` instead, so it is rewritten after saving.
Everything is deterministic for a given seed (same bytes with the same transformers).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import shutil
import tempfile
from typing import Any

import torch

from radixrt.config import ModelConfig

CORPUS_PATH = os.path.join(os.path.dirname(__file__), "data", "corpus.txt")
TINY_MODEL_FORMAT = 1  # bump when the generator changes in a way the corpus hash misses
MARKER_FILE = "radixrt_tiny.json"  # written last by ensure_tiny_model: the dir is complete
INIT_STD = 0.02  # std of random biases (Qwen2 q/k/v)
NORM_NOISE = 0.1  # RMSNorm weights are 1 + NORM_NOISE * N(0, 1), so a loader must load them

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS, END_OF_TURN)  # ids 0..6 in this order
PAD_ID, BOS_ID, EOS_ID, END_OF_TURN_ID = 0, 1, 2, 6
EOS_IDS = [EOS_ID, END_OF_TURN_ID]  # generation stops at either

# "<|role|>\ncontent<|end|>\n" per message; add_generation_prompt appends "<|assistant|>\n".
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unsupported role ' + message['role']"
    " + '; allowed: system, user, assistant') }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)

# arch -> (transformers config class, model class)
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
CHECKPOINT_SHAPE = {  # make_hf_checkpoint defaults; head_dim None: hidden_size // num_heads
    "num_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": None,
    "max_position_embeddings": 512,
}


def default_tiny_model_dir() -> str:
    """`$RADIXRT_TINY_MODEL_DIR` if set, else `~/.cache/radixrt/tiny-llama`."""
    path = os.environ.get("RADIXRT_TINY_MODEL_DIR") or "~/.cache/radixrt/tiny-llama"
    return os.path.abspath(os.path.expanduser(path))


def ensure_tiny_model(path: str | None = None) -> str:
    """Return `path` (default: `default_tiny_model_dir()`) holding the seed-0 tiny model.

    Builds it if missing or made by an older generator. The model is built in a temp dir
    beside `path` and renamed into place, so concurrent callers (pytest workers) never see
    a half-written dir; when two race, both end up with identical files at `path`.
    Raises ValueError if `path` is a non-empty dir that is not a tiny model.
    """
    path = os.path.abspath(os.path.expanduser(path or default_tiny_model_dir()))
    marker = _marker()
    if _read_marker(path) == marker:
        return path
    if os.path.isdir(path) and os.listdir(path) and _read_marker(path) is None:
        raise ValueError(
            f"{path!r} exists and is not a radixrt tiny model (no {MARKER_FILE}); "
            "remove it or pass another path"
        )
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-model-new-", dir=parent)
    trash = tempfile.mkdtemp(prefix=".tiny-model-old-", dir=parent)
    try:
        make_tiny_model(tmp)
        with open(os.path.join(tmp, MARKER_FILE), "w") as f:
            json.dump(marker, f, indent=2, sort_keys=True)
        if os.path.isdir(path) and _read_marker(path) != marker:
            # Empty or stale: move it aside (another worker may have moved it already).
            with contextlib.suppress(FileNotFoundError):
                os.rename(path, os.path.join(trash, "old"))
        try:
            os.rename(tmp, path)
        except OSError:
            if _read_marker(path) != marker:  # not a racing worker's identical model
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(trash, ignore_errors=True)
    return path


def make_tiny_model(
    out_dir: str,
    *,
    seed: int = 0,
    num_layers: int = 4,
    hidden_size: int = 256,
    intermediate_size: int = 688,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    vocab_size: int = 2048,
    max_position_embeddings: int = 2048,
) -> str:
    """Write a random float32 LlamaForCausalLM HF dir into `out_dir` (created; must be empty).

    Files: config.json, generation_config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json (with the chat template). `vocab_size` is the BPE training target;
    config.json gets the trained tokenizer's exact size. Returns `out_dir`.
    """
    return make_hf_checkpoint(
        out_dir,
        "llama",
        seed=seed,
        vocab_size=vocab_size,
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
    )


def make_hf_checkpoint(
    out_dir: str,
    arch: str,
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    vocab_size: int = 2048,
    **shape: int | None,
) -> str:
    """Write a random float32 HF model dir for `arch` (llama | mistral | qwen2 | qwen3).

    `shape` overrides `CHECKPOINT_SHAPE` keys (num_layers, hidden_size, intermediate_size,
    num_heads, num_kv_heads, head_dim, max_position_embeddings). qwen3 defaults head_dim to
    2 * hidden_size // num_heads (q_size != hidden_size, like Qwen3-0.6B) and has q/k norms;
    qwen2 has q/k/v biases. `max_shard_size` (e.g. "200KB") saves a sharded checkpoint with
    model.safetensors.index.json. `rope_scaling` is written as-is, e.g. {"rope_type":
    "linear", "factor": 2.0} or a llama3 dict. `out_dir` is created and must be empty.
    Returns `out_dir`.
    """
    if arch not in HF_CLASSES:
        raise ValueError(f"unknown arch {arch!r}; allowed: {', '.join(HF_CLASSES)}")
    unknown = sorted(set(shape) - set(CHECKPOINT_SHAPE))
    if unknown:
        raise ValueError(f"unknown shape keys {unknown}; allowed: {', '.join(CHECKPOINT_SHAPE)}")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ValueError(f"output dir {out_dir!r} is not empty")
    import transformers

    dims: dict[str, Any] = {**CHECKPOINT_SHAPE, **shape}
    if dims["head_dim"] is None:
        factor = 2 if arch == "qwen3" else 1
        dims["head_dim"] = factor * dims["hidden_size"] // dims["num_heads"]
    os.makedirs(out_dir, exist_ok=True)
    actual_vocab = write_tiny_tokenizer(
        out_dir, vocab_size=vocab_size, model_max_length=dims["max_position_embeddings"]
    )
    config_cls, model_cls = (getattr(transformers, name) for name in HF_CLASSES[arch])
    extra = {"sliding_window": None} if arch in ("mistral", "qwen2", "qwen3") else {}
    config = config_cls(
        vocab_size=actual_vocab,
        hidden_size=dims["hidden_size"],
        intermediate_size=dims["intermediate_size"],
        num_hidden_layers=dims["num_layers"],
        num_attention_heads=dims["num_heads"],
        num_key_value_heads=dims["num_kv_heads"],
        head_dim=dims["head_dim"],
        max_position_embeddings=dims["max_position_embeddings"],
        rms_norm_eps=1e-5,
        rope_theta=rope_theta,
        rope_scaling=None if rope_scaling is None else dict(rope_scaling),  # HF mutates it
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_IDS,
        pad_token_id=PAD_ID,
        **extra,
    )
    model = model_cls(config).to(torch.float32)
    _randomize(model, seed, tied=tie_word_embeddings)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_IDS, pad_token_id=PAD_ID
    )
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **kwargs)
    _rewrite_config_hub_layout(os.path.join(out_dir, "config.json"))
    ModelConfig.from_pretrained(out_dir)  # fail here, not in a caller, if unparsable
    return out_dir


def write_tiny_tokenizer(
    out_dir: str, *, vocab_size: int = 2048, model_max_length: int = 2048
) -> int:
    """Write tokenizer.json and tokenizer_config.json into `out_dir`; return the vocab size.

    Byte-level BPE (any UTF-8 text round-trips through encode/decode), no normalizer, no
    BOS added by `encode`; special tokens `SPECIAL_TOKENS` take ids 0..6.
    """
    tokenizer_json, actual_vocab_size = _trained_tokenizer(vocab_size)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [*ROLE_TOKENS, END_OF_TURN],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, indent=2, sort_keys=True)
        f.write("\n")
    return actual_vocab_size


@functools.cache
def _trained_tokenizer(vocab_size: int) -> tuple[str, int]:
    """Train the byte-level BPE on the shipped corpus (deterministic, ~0.1 s).

    Returns (tokenizer.json text, vocab size including special tokens).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (256 bytes + special "
            f"tokens), got {vocab_size}"
        )
    with open(CORPUS_PATH, encoding="utf-8") as f:
        corpus = f.read()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([corpus], trainer)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, (token, tokenizer.token_to_id(token))
    return tokenizer.to_str(pretty=True), tokenizer.get_vocab_size()


def _randomize(model: torch.nn.Module, seed: int, *, tied: bool) -> None:
    """Overwrite every parameter from one seeded generator (independent of HF init code).

    Scaled so that a random model's output depends on its context (not one token repeated)
    and logits have std ~1: matrices N(0, 1/fan_in); embeddings N(0, 1), or N(0, 1/hidden)
    when tied to lm_head; biases N(0, INIT_STD^2); RMSNorm weights 1 + NORM_NOISE * N(0, 1).
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied lm_head is listed once
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + NORM_NOISE * noise)
            elif "embed_tokens" in name and not tied:
                param.copy_(noise)
            elif param.dim() == 2:
                param.copy_(noise / math.sqrt(param.shape[1]))
            else:
                param.copy_(INIT_STD * noise)


def _rewrite_config_hub_layout(path: str) -> None:
    """Rewrite a saved config.json with top-level rope_theta/rope_scaling and torch_dtype."""
    with open(path) as f:
        cfg = json.load(f)
    rope = cfg.pop("rope_parameters", None)
    if rope is not None:
        rope = dict(rope)
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def _marker() -> dict[str, Any]:
    with open(CORPUS_PATH, "rb") as f:
        corpus_sha256 = hashlib.sha256(f.read()).hexdigest()
    return {"format": TINY_MODEL_FORMAT, "corpus_sha256": corpus_sha256, "seed": 0}


def _read_marker(path: str) -> dict[str, Any] | None:
    marker_path = os.path.join(path, MARKER_FILE)
    if not os.path.isfile(marker_path):
        return None
    with open(marker_path) as f:
        return json.load(f)
