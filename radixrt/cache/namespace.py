"""The cache key's namespace: which cached KV a request may reuse.

Two requests share cached KV only when their namespaces are equal. Every key the caches make
derives from it, in one place:
- the radix tree keeps one root per namespace (`RadixCache`), so a walk never leaves it;
- the block-hash cache seeds its hash chain with `chain_seed`;
- KV events put `event_salt` into the first block's extra keys, as vLLM puts `cache_salt`.
A field that changes K/V or who may read it (a LoRA adapter) belongs here, and each derivation
above takes it in; what is fixed per process (the model, its dtype and layout) belongs to the
tier that keeps KV beyond the process, not to every request's namespace.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CacheNamespace:
    """A request's prefix-cache namespace (hashable; equal namespaces share entries)."""

    salt: str | None = None  # the tenant's cache salt (None: the shared, unsalted cache)
    lora: str | None = None  # the LoRA adapter's key (`LoraRef.key`; None: the base model)

    def chain_seed(self, base: bytes) -> bytes:
        """The first parent of a block-hash chain in this namespace: `base` for the default
        namespace, else a digest of `base` and the fields (no other namespace shares it)."""
        if self.salt is None and self.lora is None:
            return base
        data = base
        if self.salt is not None:
            data += b"salt" + self.salt.encode()
        if self.lora is not None:
            data += b"\0lora" + self.lora.encode()
        return hashlib.sha256(data).digest()

    @property
    def event_salt(self) -> str | None:
        """What KV events hash into a sequence's first block (vLLM's `cache_salt`; an
        adapter's key joins it, so no block hash of an adapter equals the base model's)."""
        if self.lora is None:
            return self.salt
        return f"{self.salt or ''}\0lora:{self.lora}"


DEFAULT_NAMESPACE = CacheNamespace()  # requests without a salt
