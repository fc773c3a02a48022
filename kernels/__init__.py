"""Triton kernels (radixrt.kernels), each beside the torch reference it is tested against.

Importing this package never needs Triton: without it, calling a kernel launcher raises
ImportError, and the *_reference functions still work. On CPU, set TRITON_INTERPRET=1
before this package is first imported: Triton reads it when a kernel is defined.
"""

from ._triton import HAS_TRITON
from .block_table import (
    KVMetadata,
    TokenMetadata,
    build_kv_metadata,
    build_kv_metadata_reference,
    build_token_metadata,
    build_token_metadata_reference,
)
from .rmsnorm import RMSNormResult, rmsnorm, rmsnorm_reference
from .store_kv import store_kv, store_kv_reference

__all__ = [
    "HAS_TRITON",
    "KVMetadata",
    "RMSNormResult",
    "TokenMetadata",
    "build_kv_metadata",
    "build_kv_metadata_reference",
    "build_token_metadata",
    "build_token_metadata_reference",
    "rmsnorm",
    "rmsnorm_reference",
    "store_kv",
    "store_kv_reference",
]
