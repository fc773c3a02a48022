"""KV memory: BlockAllocator (plain Python, reference counts) and KVPool (torch tensors).

KVPool is imported lazily so that the scheduler and the caches never import torch."""

from radixrt.kv.allocator import BlockAllocator, OutOfBlocks

__all__ = ["BlockAllocator", "KVPool", "OutOfBlocks"]


def __getattr__(name: str):
    if name == "KVPool":
        from radixrt.kv.pool import KVPool

        return KVPool
    raise AttributeError(f"module 'radixrt.kv' has no attribute {name!r}")
