"""A node of the radix tree (`radixrt.cache.radix`): one edge, its KV blocks on each tier; and
the two helpers the tree's owners share: the device-leaf test and the reference-counter drop."""

from __future__ import annotations

from collections import Counter


class RadixNode:
    """One edge of the tree. Fields are written only by `RadixCache` and, for `host_blocks` and
    `in_host_lru`, by its host-tier component (`radixrt.cache.radix_host.RadixHostTier`)."""

    __slots__ = (
        "id",
        "key",
        "start",
        "blocks",
        "host_blocks",
        "children",
        "parent",
        "lock_ref",
        "last_access",
        "in_lru",
        "in_host_lru",
        "block_hashes",
        "priority",
    )

    def __init__(self, node_id: int, key: list[int], start: int, blocks: list[int]) -> None:
        self.id = node_id  # unique, breaks ties between equal access times
        self.key = key  # token ids of the edge (empty only for the root)
        self.start = start  # absolute position of key[0]
        self.blocks = blocks  # device block per block index start // B .. (end - 1) // B
        # ([] when the node's KV is not on the device)
        self.host_blocks: list[int] = []  # host copy, per block index likewise ([]: none)
        self.children: dict[int, RadixNode] = {}  # by first token of the child's key
        self.parent: RadixNode | None = None  # None for the root and for evicted nodes
        self.lock_ref = 0  # lock() calls whose handle is this node or a descendant
        self.last_access = 0  # cache clock at the last match/insert through this node
        self.in_lru = False  # listed as a device eviction candidate
        self.in_host_lru = False  # listed as a host eviction candidate
        # vLLM hashes of the full blocks whose last token is on the edge (block indices
        # start // B .. end // B - 1); filled only when KV events are on
        # (radixrt.cache.radix_events)
        self.block_hashes: list[bytes] | None = None
        self.priority = 0  # of the request that inserted it last (device eviction order)

    @property
    def end(self) -> int:
        """Absolute position one past the edge's last token (= depth of the node)."""
        return self.start + len(self.key)

    def block_at(self, pos: int, block_size: int) -> int:
        """Block recorded for absolute position `pos` (start <= pos < end)."""
        assert self.start <= pos < self.end
        return self.blocks[pos // block_size - self.start // block_size]


def is_device_leaf(node: RadixNode) -> bool:
    """A device eviction candidate: unlocked, on the device, no child on the device."""
    return (
        bool(node.key)
        and node.lock_ref == 0
        and bool(node.blocks)
        and not any(c.blocks for c in node.children.values())
    )


def drop_ref(counter: Counter[int], block: int) -> None:
    """Take one reference on `block` out of a block -> references counter."""
    if counter[block] == 1:
        del counter[block]
    else:
        counter[block] -= 1
