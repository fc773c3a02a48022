"""Triton, or a stand-in that raises ImportError when a kernel is first used.

Kernel modules import `triton` and `tl` from here, so `import radixrt.kernels` works on
machines without Triton (CPU-only installs); the torch references stay usable there.
"""

import importlib.util

HAS_TRITON = importlib.util.find_spec("triton") is not None

_MISSING = (
    "radixrt.kernels needs Triton to launch its kernels: pip install 'triton>=3.0' "
    "(or radixrt[gpu]); the *_reference functions work without it"
)


class _MissingKernel:
    """What `@triton.jit` yields without Triton: launching it raises ImportError."""

    def __init__(self, fn) -> None:
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    def __getitem__(self, grid):
        raise ImportError(_MISSING)


class _MissingTriton:
    @staticmethod
    def jit(fn):
        return _MissingKernel(fn)

    def __getattr__(self, name: str):
        raise ImportError(_MISSING)


class _MissingLanguage:
    constexpr = object  # only evaluated in kernel signatures' annotations


if HAS_TRITON:
    import triton
    import triton.language as tl
else:
    triton = _MissingTriton()
    tl = _MissingLanguage()

__all__ = ["HAS_TRITON", "tl", "triton"]
