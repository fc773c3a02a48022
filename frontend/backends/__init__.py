"""Backends: in-process (`EngineBackend`, `Runtime`) and HTTP (`RuntimeEndpoint`)."""

from .base import Backend, GenResult
from .engine import EngineBackend, Runtime
from .http import RuntimeEndpoint

__all__ = ["Backend", "EngineBackend", "GenResult", "Runtime", "RuntimeEndpoint"]
