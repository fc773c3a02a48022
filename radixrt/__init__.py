"""radixrt: an LLM serving runtime built around prefix sharing."""

import os as _os

# A source checkout (PYTHONPATH) maps the top-level kernels/ and frontend/ folders to
# radixrt.kernels / radixrt.frontend, as the installed package does.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_root, "kernels")):
    __path__.append(_root)

from radixrt.engine import Engine, RequestOutput, StreamDelta  # noqa: E402
from radixrt.sampling import SamplingParams  # noqa: E402

__all__ = ["Engine", "RequestOutput", "SamplingParams", "StreamDelta"]
