"""What `--model` (and `Engine(model)`) may name, turned into the local model dir that the
rest of radixrt reads: an HF dir as it is, a GGUF file (or a dir holding one and no
safetensors) as its prepared dir, a hub id `org/name` as its snapshot in the hub cache."""

from __future__ import annotations

import glob
import os

from radixrt.hf_dir.gguf_file import prepare_gguf_dir
from radixrt.hf_dir.hub import hub_snapshot, is_hub_id
from radixrt.hf_dir.local import gguf_weights


def resolve_model(spec: str, *, tokenizer: str | None = None, revision: str | None = None) -> str:
    """The local model dir for `spec` (see the module doc). `tokenizer` (a model dir) replaces
    a GGUF file's own tokenizer; `revision` picks a hub id's branch, tag or commit. Raises
    ValueError when an option does not apply to `spec`, FileNotFoundError when a hub id is not
    cached and cannot be downloaded; a path that does not exist is returned as it is (the
    model dir checks name it)."""
    if revision is not None and not is_hub_id(spec):
        raise ValueError(f"--revision applies to hub ids (org/name), not {spec!r}")
    if is_hub_id(spec):
        model_dir = hub_snapshot(spec, revision)
    else:
        model_dir = spec
    gguf_path = _gguf_file(model_dir)
    if gguf_path is not None:
        return prepare_gguf_dir(gguf_path, tokenizer)
    if tokenizer is not None:
        raise ValueError(f"--tokenizer applies to GGUF models only, not {spec!r}")
    return model_dir


def _gguf_file(spec: str) -> str | None:
    """The GGUF file `spec` names: the file itself, or the one .gguf of a dir that holds no
    safetensors and is no prepared GGUF dir. Raises ValueError for a dir holding several."""
    if os.path.isfile(spec) and spec.endswith(".gguf"):
        return spec
    if not os.path.isdir(spec) or gguf_weights(spec) is not None:
        return None
    if glob.glob(os.path.join(spec, "*.safetensors")):
        return None
    found = sorted(glob.glob(os.path.join(spec, "*.gguf")))
    if len(found) > 1:
        names = [os.path.basename(p) for p in found]
        raise ValueError(f"{spec!r} holds {len(found)} GGUF files {names[:4]}; name one")
    return found[0] if found else None
