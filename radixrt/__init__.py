"""radixrt: an LLM serving runtime built around prefix sharing."""

import os as _os

# A source checkout (PYTHONPATH) maps the top-level kernels/ and frontend/ folders to
# radixrt.kernels / radixrt.frontend, as the installed package does.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_root, "kernels")):
    __path__.append(_root)

__all__ = [
    "BeamSearchOutput",
    "BeamSearchParams",
    "Engine",
    "RequestOutput",
    "SamplingParams",
    "StreamDelta",
]


def __getattr__(name: str):
    # Lazy: processes that never build an engine (the HTTP front) skip importing torch.
    if name in ("BeamSearchOutput", "Engine", "RequestOutput", "StreamDelta"):
        from radixrt import engine

        return getattr(engine, name)
    if name in ("SamplingParams", "BeamSearchParams"):
        from radixrt import sampling

        return getattr(sampling, name)
    raise AttributeError(f"module 'radixrt' has no attribute {name!r}")
