"""Triton is imported on a kernel's first launch, never by `import radixrt.kernels`.

So CPU-only installs without Triton import the package (the *_reference functions are
their CPU path), and TRITON_INTERPRET=1 may be set any time before the first launch:
Triton reads it when `@triton.jit` runs, i.e. when a `_*_triton` module is imported.
"""

import importlib
import importlib.util
from types import ModuleType

HAS_TRITON = importlib.util.find_spec("triton") is not None


def load_triton_module(name: str) -> ModuleType:
    """The Triton kernel module `radixrt.kernels.<name>`, imported on first use.

    Raises ImportError naming the fix when Triton is not installed.
    """
    if not HAS_TRITON:
        raise ImportError(
            "radixrt.kernels needs Triton to launch its kernels: pip install 'triton>=3.0' "
            "(or radixrt[gpu]); the *_reference functions work without it"
        )
    return importlib.import_module(f"{__package__}.{name}")


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
