"""A node of the radix tree (`radixrt.cache.radix`): one edge and its KV blocks on each tier;
the device-leaf test and the reference-counter drop that the tree's layers share; and
`TreeObserver`, the hook through which the tree reports what it holds (KV events)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from radixrt.cache.namespace import CacheNamespace


class RadixNode:
    """One edge of the tree. Fields are written by `RadixCache`; `host_blocks` and
    `in_host_lru` by its host-tier layer (`radixrt.cache.radix_host.HostRadixCache`);
    `block_hashes` by the tree's observer."""

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
        # start // B .. end // B - 1); filled only by an observer that records KV events
        # (radixrt.cache.radix_events)
        self.block_hashes: list[bytes] | None = None
        self.priority = 0  # of the request that inserted it last (device eviction order)

    @property
    def end(self) -> int:
        """Absolute position one past the edge's last token (= depth of the node)."""
        return self.start + len(self.key)


class TreeObserver(Protocol):
    """What the radix tree and its tier layers report, as it happens (the KV event recorder,
    `radixrt.cache.radix_events.RadixEventRecorder`, is one). `medium` names a tier
    (`radixrt.cache.kv_events.MEDIUM_GPU` / `MEDIUM_CPU`)."""

    def added(self, node: RadixNode, namespace: CacheNamespace) -> None:
        """`node` entered the tree on the device (a new leaf of `namespace`'s subtree)."""

    def stored(self, node: RadixNode, medium: str) -> None:
        """`node`'s KV is now on `medium` (it was not)."""

    def removed(self, node: RadixNode, medium: str) -> None:
        """`node`'s KV left `medium` (the node may be leaving the tree)."""

    def trimmed(self, node: RadixNode, keep: int) -> None:
        """`node`, a device leaf, keeps only its first `keep` blocks (its tail left)."""

    def split(self, upper: RadixNode, lower: RadixNode) -> None:
        """`lower`'s edge was cut: `upper` took its first tokens."""

    def reset_started(self) -> None:
        """A `reset` begins (its removals follow)."""

    def reset_done(self) -> None:
        """The `reset` ended."""

    def check_integrity(self, roots: list[RadixNode]) -> None:
        """Assert the observer's view matches the tree under `roots`."""


class NoObserver:
    """The observer of a tree whose changes nobody records."""

    def added(self, node: RadixNode, namespace: CacheNamespace) -> None:
        pass

    def stored(self, node: RadixNode, medium: str) -> None:
        pass

    def removed(self, node: RadixNode, medium: str) -> None:
        pass

    def trimmed(self, node: RadixNode, keep: int) -> None:
        pass

    def split(self, upper: RadixNode, lower: RadixNode) -> None:
        pass

    def reset_started(self) -> None:
        pass

    def reset_done(self) -> None:
        pass

    def check_integrity(self, roots: list[RadixNode]) -> None:
        pass


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
