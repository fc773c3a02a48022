"""Hugging Face hub ids (`org/name`) as local model dirs, through `huggingface_hub`'s cache:
only the files radixrt reads are fetched (safetensors, config and tokenizer files), and
HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE and revisions work as they do for transformers."""

from __future__ import annotations

import os
import re

# the files of a hub repo that radixrt reads
HUB_FILES = [
    "*.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "hf_quant_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(spec: str) -> bool:
    """Whether `spec` names a hub repo (`org/name`) rather than a local path: it has that
    shape and no such path exists."""
    return _HUB_ID.fullmatch(spec) is not None and not os.path.exists(spec)


def hub_snapshot(repo_id: str, revision: str | None = None) -> str:
    """The local dir of `repo_id` at `revision` (default: main) in the hub cache, downloaded
    first unless cached (or HF_HUB_OFFLINE is set). Raises FileNotFoundError naming the id and
    the cache path when it is not cached and cannot be downloaded."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES)
    except (LocalEntryNotFoundError, HfHubHTTPError) as e:
        at = f" at revision {revision!r}" if revision else ""
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        raise FileNotFoundError(
            f"model {repo_id!r}{at} is not in the hub cache {constants.HF_HUB_CACHE} and could "
            f"not be downloaded{offline}: {str(e).splitlines()[0]}"
        ) from e
