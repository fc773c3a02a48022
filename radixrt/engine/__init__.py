"""The engine: ModelRunner, EngineCore and the in-process Engine."""

__all__ = ["BeamSearchOutput", "BeamSequence", "Engine", "RequestOutput", "StreamDelta"]


def __getattr__(name: str):
    # Lazy: importing radixrt.engine.<module> must not load the whole engine.
    if name in __all__:
        from radixrt.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'radixrt.engine' has no attribute {name!r}")
