"""Tiny HF-format checkpoints, made locally, for tests and CPU demos.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained on the text
shipped in `radixrt/model/data` (see tiny_data.py), and the weights are either trained on
that text for 1-2 minutes on one CPU thread (tiny_train.py, the default) or random.

- `make_tiny_model`: the default tiny Llama (tokenizer, chat template, config, weights);
  trained, or random with `random=True`.
- `ensure_tiny_model`: the same, built once into a shared cache dir, atomically.
- `make_hf_checkpoint`: tiny random llama/qwen2/qwen3/mistral dirs (sharded, tied, rope
  scaling).

`config.json` is written in the layout of checkpoints on the Hub (top-level `rope_theta`,
`rope_scaling`, `torch_dtype`), which is what `radixrt.config.ModelConfig` parses; newer
transformers save `rope_parameters`/`dtype` instead, so it is rewritten after saving.
Everything is deterministic for a given seed: random weights are the same bytes with the
same transformers; trained weights are the same bytes on the same torch build and CPU kind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
from typing import Any

import torch

from radixrt.config import ModelConfig
from radixrt.model import tiny_data
from radixrt.model.tiny_tokenizer import (  # noqa: F401  (re-exported: the tiny model's ids)
    BOS,
    BOS_ID,
    CHAT_TEMPLATE,
    END_OF_TURN,
    END_OF_TURN_ID,
    EOS,
    EOS_ID,
    EOS_IDS,
    PAD,
    PAD_ID,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    chat_template_sha256,
    copy_with_template,
    trained_tokenizer_json,
    write_tiny_tokenizer,
)
from radixrt.model.tiny_train import TrainResult, TrainSettings

TINY_MODEL_FORMAT = 2  # bump when the generator changes in a way the cache key misses
MARKER_FILE = "radixrt_tiny.json"  # written last by ensure_tiny_model: the dir is complete
TRAINING_FILE = "radixrt_training.json"  # settings and final loss of a trained model
INIT_STD = 0.02  # std of random biases (Qwen2 q/k/v)
NORM_NOISE = 0.1  # RMSNorm weights are 1 + NORM_NOISE * N(0, 1), so a loader must load them

# arch -> (transformers config class, model class)
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
TINY_SHAPE = {  # make_tiny_model defaults: 2.4M parameters, head_dim 32
    "num_layers": 4,
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_heads": 6,
    "num_kv_heads": 2,
    "max_position_embeddings": 2048,
}
TINY_VOCAB_SIZE = 2048
TRAIN_SETTINGS = TrainSettings()  # what ensure_tiny_model trains with
CHECKPOINT_SHAPE = {  # make_hf_checkpoint defaults; head_dim None: hidden_size // num_heads
    "num_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": None,
    "max_position_embeddings": 512,
}


def default_tiny_model_dir(random: bool = False) -> str:
    """`$RADIXRT_TINY_MODEL_DIR` if set (plus `-random` with `random`), else
    `~/.cache/radixrt/tiny-llama-{trained|random}-KEY`, KEY a short hash of the cache key:
    checkouts with other generator versions (other branches) never replace each other's
    model in the shared cache."""
    variant = "random" if random else "trained"
    env = os.environ.get("RADIXRT_TINY_MODEL_DIR")
    if env:
        return os.path.abspath(os.path.expanduser(env)) + ("-random" if random else "")
    return _cache_dir(variant, _marker(random))


def _cache_dir(variant: str, marker: dict[str, Any]) -> str:
    key = hashlib.sha256(json.dumps(marker, sort_keys=True).encode()).hexdigest()
    return os.path.expanduser(f"~/.cache/radixrt/tiny-llama-{variant}-{key[:12]}")


def _same_weights(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    """Markers that differ in the chat template at most."""
    drop = lambda m: {k: v for k, v in m.items() if k != "chat_template_sha256"}
    return a is not None and drop(a) == drop(b)


def _weights_source(path: str, marker: dict[str, Any], random: bool) -> str | None:
    """A built model with the same weights and another chat template: `path` itself, or
    (for the default dir) the dir a checkout whose key had no template uses."""
    candidates = [path]
    if path == default_tiny_model_dir(random) and not os.environ.get("RADIXRT_TINY_MODEL_DIR"):
        legacy = {k: v for k, v in marker.items() if k != "chat_template_sha256"}
        candidates.append(_cache_dir("random" if random else "trained", legacy))
    for c in candidates:
        if _same_weights(_read_marker(c), marker):
            return c
    return None


def ensure_tiny_model(path: str | None = None, *, random: bool = False) -> str:
    """Return `path` (default: `default_tiny_model_dir(random)`) holding the seed-0 tiny
    model: trained with `TRAIN_SETTINGS` (1-2 minutes on one CPU core), or random weights.

    Builds it if missing or made by other settings (the marker file holds the cache key:
    generator format, data hash, shape, training settings, chat template); a model that
    differs only in its chat template is copied with the new template, not trained again.
    The model is built in a temp dir beside `path` and renamed into place, so concurrent
    callers (pytest workers) never see a half-written dir; when two race, both end up with
    equivalent files at `path`.
    Raises ValueError if `path` is a non-empty dir that is not a tiny model.
    """
    path = os.path.abspath(os.path.expanduser(path or default_tiny_model_dir(random)))
    marker = _marker(random)
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
    source = _weights_source(path, marker, random)
    try:
        if source is not None:  # only the chat template changed: no training
            copy_with_template(source, tmp)
        else:
            make_tiny_model(tmp, random=random)
        with open(os.path.join(tmp, MARKER_FILE), "w") as f:
            json.dump(marker, f, indent=2, sort_keys=True)
        if os.path.isdir(path) and _read_marker(path) != marker:
            # Empty or stale: move it aside (another worker may have moved it already).
            with contextlib.suppress(FileNotFoundError):
                os.rename(path, os.path.join(trash, "old"))
        try:
            os.rename(tmp, path)
        except OSError:
            if _read_marker(path) != marker:  # not a racing worker's equivalent model
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(trash, ignore_errors=True)
    return path


def make_tiny_model(
    out_dir: str,
    *,
    random: bool = False,
    seed: int = 0,
    train_settings: TrainSettings = TRAIN_SETTINGS,
    progress: bool = True,
    vocab_size: int = TINY_VOCAB_SIZE,
    **shape: int,
) -> str:
    """Write a float32 LlamaForCausalLM HF dir into `out_dir` (created; must be empty).

    Trained on the shipped text with `train_settings` (deterministic for `seed`; a tqdm bar
    when `progress`), or random weights from `seed` when `random`. `shape` overrides
    `TINY_SHAPE` keys. Files: config.json, generation_config.json, model.safetensors,
    tokenizer.json, tokenizer_config.json (with the chat template), and for a trained model
    `TRAINING_FILE` (settings, final train loss, time). `vocab_size` is the BPE training
    target; config.json gets the trained tokenizer's exact size. Returns `out_dir`.
    """
    dims = {**TINY_SHAPE, **shape}
    if random:
        return make_hf_checkpoint(out_dir, "llama", seed=seed, vocab_size=vocab_size, **dims)
    from tokenizers import Tokenizer

    from radixrt.model import tiny_train

    model = _new_model(out_dir, "llama", vocab_size=vocab_size, **dims)
    tokenizer = Tokenizer.from_str(trained_tokenizer_json(vocab_size)[0])
    stream = tiny_train.training_stream(lambda text: tokenizer.encode(text).ids, EOS_ID, seed)
    result = tiny_train.train(model, stream, train_settings, seed=seed, progress=progress)
    if progress:
        print(
            f"tiny model: {train_settings.steps} steps on {result.num_tokens} tokens in "
            f"{result.seconds:.0f} s ({result.cpu_seconds:.0f} s CPU), "
            f"final train loss {result.final_loss:.3f}",
            flush=True,
        )
    _save(model, out_dir)
    _write_training_file(out_dir, seed, train_settings, result)
    return out_dir


def read_training_file(model_dir: str) -> dict[str, Any] | None:
    """The `TRAINING_FILE` of a trained tiny model dir, or None for other dirs."""
    path = os.path.join(model_dir, TRAINING_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


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
    model = _new_model(
        out_dir, arch, vocab_size=vocab_size, tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling, rope_theta=rope_theta, **shape,
    )  # fmt: skip
    _randomize(model, seed, tied=tie_word_embeddings)
    _save(model, out_dir, max_shard_size)
    return out_dir


def _new_model(
    out_dir: str,
    arch: str,
    *,
    vocab_size: int,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    **shape: int | None,
) -> torch.nn.Module:
    """Validate the arguments, write the tokenizer into `out_dir` (created; must be empty)
    and return the HF model (float32, cpu, HF's own init) of `arch` and `shape`."""
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
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_IDS, pad_token_id=PAD_ID
    )
    return model


def _save(model: torch.nn.Module, out_dir: str, max_shard_size: str | int | None = None) -> None:
    """save_pretrained into `out_dir`, config.json in the Hub layout, and check it parses."""
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **kwargs)
    _rewrite_config_hub_layout(os.path.join(out_dir, "config.json"))
    ModelConfig.from_pretrained(out_dir)  # fail here, not in a caller, if unparsable


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


def _write_training_file(
    out_dir: str, seed: int, settings: TrainSettings, result: TrainResult
) -> None:
    info = {
        "seed": seed,
        "settings": dataclasses.asdict(settings),
        "final_train_loss": round(result.final_loss, 4),
        "num_train_tokens": result.num_tokens,
        "train_seconds": round(result.seconds, 1),
        "train_cpu_seconds": round(result.cpu_seconds, 1),
        "torch": torch.__version__,
    }
    with open(os.path.join(out_dir, TRAINING_FILE), "w") as f:
        json.dump(info, f, indent=2, sort_keys=True)
        f.write("\n")


def _marker(random: bool) -> dict[str, Any]:
    """The cache key of ensure_tiny_model's model."""
    return {
        "format": TINY_MODEL_FORMAT,
        "data_sha256": tiny_data.data_sha256(),
        "seed": 0,
        "shape": TINY_SHAPE,
        "vocab_size": TINY_VOCAB_SIZE,
        "weights": "random" if random else "trained",
        "training": None if random else dataclasses.asdict(TRAIN_SETTINGS),
        "chat_template_sha256": chat_template_sha256(),
    }


def _read_marker(path: str) -> dict[str, Any] | None:
    marker_path = os.path.join(path, MARKER_FILE)
    if not os.path.isfile(marker_path):
        return None
    with open(marker_path) as f:
        return json.load(f)
