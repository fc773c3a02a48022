"""Triton kernels (radixrt.kernels), each beside the torch reference it is tested against.

Importing this package never imports Triton: a launcher imports its `_*_triton` module on
first call (ImportError naming the fix where Triton is missing), and the *_reference
functions, the CPU path, never need it. To run kernels on CPU tensors, set
TRITON_INTERPRET=1 before the first launch and before anything imports triton.language:
Triton reads it when `@triton.jit` runs (tl.sum and friends are jit functions too).
"""

if __name__ != "radixrt.kernels":  # found by its bare name: radixrt/_top_level.py
    from radixrt._top_level import defer_to_installed

    defer_to_installed(__name__, __file__)
else:
    from ._triton import HAS_TRITON
    from .block_table import (
        KVMetadata,
        TokenMetadata,
        build_block_table,
        build_block_table_reference,
        build_kv_metadata,
        build_kv_metadata_reference,
        build_token_metadata,
        build_token_metadata_reference,
    )
    from .fp8_quant import (
        Fp8Activation,
        Fp8Product,
        dequantize_fp8,
        quantize_fp8,
        quantize_fp8_reference,
        rmsnorm_quantize_fp8,
        rmsnorm_quantize_fp8_reference,
        scale_product,
        scale_product_reference,
        silu_mul_quantize_fp8,
        silu_mul_quantize_fp8_reference,
    )
    from .rmsnorm import RMSNormResult, rmsnorm, rmsnorm_reference
    from .rope_store_kv import rope_reference, rope_store_kv, rope_store_kv_reference
    from .silu_mul import silu_mul, silu_mul_reference
    from .store_kv import store_kv, store_kv_reference

    __all__ = [
        "HAS_TRITON",
        "Fp8Activation",
        "Fp8Product",
        "KVMetadata",
        "RMSNormResult",
        "TokenMetadata",
        "build_block_table",
        "build_block_table_reference",
        "build_kv_metadata",
        "build_kv_metadata_reference",
        "build_token_metadata",
        "build_token_metadata_reference",
        "dequantize_fp8",
        "quantize_fp8",
        "quantize_fp8_reference",
        "rmsnorm",
        "rmsnorm_quantize_fp8",
        "rmsnorm_quantize_fp8_reference",
        "rmsnorm_reference",
        "rope_reference",
        "rope_store_kv",
        "rope_store_kv_reference",
        "scale_product",
        "scale_product_reference",
        "silu_mul",
        "silu_mul_quantize_fp8",
        "silu_mul_quantize_fp8_reference",
        "silu_mul_reference",
        "store_kv",
        "store_kv_reference",
    ]
