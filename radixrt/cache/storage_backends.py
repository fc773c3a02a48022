"""Which storage backend a `kv_storage` option names (imports the chosen one only)."""

from __future__ import annotations

from radixrt.cache.kv_events import MEDIUM_DISK, MEDIUM_EXTERNAL
from radixrt.cache.storage import StorageBackend

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")  # a `kv_storage` naming a Redis server


def open_backend(spec: str, page_bytes: int, max_bytes: int) -> StorageBackend:
    """The backend `spec` names: a Redis URL (`REDIS_SCHEMES`; the server bounds its memory
    itself) or a directory bounded at `max_bytes`."""
    if spec.startswith(REDIS_SCHEMES):
        try:
            from radixrt.cache.storage_redis import RedisBackend
        except ImportError as e:
            raise ImportError(f"kv_storage {spec!r} needs `pip install 'radixrt[redis]'`") from e
        return RedisBackend(spec, page_bytes)
    from radixrt.cache.storage_local import LocalDirBackend

    return LocalDirBackend(spec, page_bytes, max_bytes)


def storage_medium(spec: str) -> str:
    """What KV events call the store a `kv_storage` option names."""
    return MEDIUM_EXTERNAL if spec.startswith(REDIS_SCHEMES) else MEDIUM_DISK
