"""KV cache events in vLLM's schema and vLLM's block hashes (plain Python, no torch).

Wire format (vLLM v0.11.0, `vllm/distributed/kv_events.py`): a `KVEventBatch` is a msgspec
struct encoded as a msgpack array `[ts, events, data_parallel_rank]`; each event is an array
whose first element is its tag: `["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium]`, `["BlockRemoved", block_hashes, medium]`,
`["AllBlocksCleared"]`. Consumers decode them with vLLM's own structs.

Block hashes (vLLM `vllm/v1/core/kv_cache_utils.py`, `vllm/utils/hashing.py`): block i of a
sequence hashes to `sha256(cbor2.dumps((parent, tuple(tokens[i*B:(i+1)*B]), extra_keys),
canonical=True))` where `parent` is block i-1's hash, or `NONE_HASH = sha256_cbor(seed)` for
block 0. Events carry each hash as the integer of its last 8 bytes, big-endian (vLLM's
`maybe_convert_block_hash` with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, its default), and
the parent of block 0 as None. Only full blocks have hashes.

Mediums: "GPU" and "CPU" as vLLM's offloading connector names them; the storage tier uses
"DISK" (a local directory) and "EXTERNAL" (a shared store: Redis), the tier names Dynamo's and
llm-d's routers score besides GPU and CPU.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import msgspec

MEDIUM_GPU = "GPU"  # the device KV pool
MEDIUM_CPU = "CPU"  # the host KV tier
MEDIUM_DISK = "DISK"  # the storage tier in a local directory
MEDIUM_EXTERNAL = "EXTERNAL"  # the storage tier in a shared store (Redis)
VLLM_VERSION = "0.11.0"  # the vLLM release whose event schema and block hashes these follow


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the batch was made
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV cache events (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]  # consecutive full blocks of one sequence, root side first
    parent_block_hash: int | None  # the block before block_hashes[0]; None: they start at 0
    token_ids: list[int]  # block_size tokens per hash
    block_size: int
    lora_id: int | None
    medium: str | None  # MEDIUM_GPU | MEDIUM_CPU | MEDIUM_DISK | MEDIUM_EXTERNAL


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def sha256_cbor(value: Any) -> bytes:
    """vLLM's `sha256_cbor`: SHA-256 of the canonical CBOR encoding of `value`."""
    import cbor2  # only with KV events on

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def none_hash(seed: str | None) -> bytes:
    """The parent hash of a sequence's first block, as vLLM's `init_none_hash` makes it:
    sha256_cbor(seed); seed None: $PYTHONHASHSEED when set, else 32 random bytes (hashes then
    differ from every other process's)."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED")
    return os.urandom(32) if seed is None else sha256_cbor(seed)


def external_hash(block_hash: bytes) -> int:
    """The 64-bit integer events carry for `block_hash` (vLLM's `maybe_convert_block_hash`)."""
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF


class BlockHasher:
    """Chained full-block hashes of one configuration (seed, block size, extra keys).

    `extra_keys` goes into every block's hash as vLLM's per-block extra keys (a tuple, e.g.
    a tenant's cache salt); None for plain text, as vLLM hashes it."""

    def __init__(
        self, block_size: int, seed: str | None = None, extra_keys: tuple | None = None
    ) -> None:
        import cbor2  # only with KV events on

        self.block_size = block_size
        self.none_hash = none_hash(seed)
        self.extra_keys = extra_keys
        self._dumps = cbor2.dumps

    def chain(
        self, parent: bytes | None, token_ids: Sequence[int], salt: str | None = None
    ) -> list[bytes]:
        """Hashes of the full blocks of `token_ids` (len a multiple of block_size) that follow
        the block hashed `parent` (None: they start the sequence). A cache salt goes into the
        first block's extra keys, as vLLM puts `cache_salt` there (the chain carries it on)."""
        bs, extra, dumps, sha256 = self.block_size, self.extra_keys, self._dumps, hashlib.sha256
        assert len(token_ids) % bs == 0, f"{len(token_ids)} tokens are not whole blocks"
        prev = self.none_hash if parent is None else parent
        out = []
        for i in range(0, len(token_ids), bs):
            key = extra
            if parent is None and i == 0 and salt is not None:
                key = (*(extra or ()), salt)
            prev = sha256(dumps((prev, tuple(token_ids[i : i + bs]), key), canonical=True))
            prev = prev.digest()
            out.append(prev)
        return out


def without_token_ids(events: list) -> list:
    """`events` with every `BlockStored`'s token ids left out (`[]`): hashes only."""
    return [
        msgspec.structs.replace(e, token_ids=[]) if isinstance(e, BlockStored) else e
        for e in events
    ]
