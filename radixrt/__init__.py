"""radixrt: an LLM serving runtime built around prefix sharing."""

__all__ = [
    "BeamSearchOutput",
    "BeamSearchParams",
    "Engine",
    "RequestOptions",
    "RequestOutput",
    "SamplingParams",
    "StreamDelta",
]


def __getattr__(name: str):
    # Lazy: processes that never build an engine (the HTTP front) skip importing torch.
    if name in ("BeamSearchOutput", "Engine", "RequestOutput", "StreamDelta"):
        from radixrt import engine

        return getattr(engine, name)
    if name in ("SamplingParams", "BeamSearchParams", "RequestOptions"):
        from radixrt import sampling

        return getattr(sampling, name)
    raise AttributeError(f"module 'radixrt' has no attribute {name!r}")
