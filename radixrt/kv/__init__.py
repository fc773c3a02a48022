from radixrt.kv.allocator import BlockAllocator, OutOfBlocks
from radixrt.kv.pool import KVPool

__all__ = ["BlockAllocator", "KVPool", "OutOfBlocks"]
