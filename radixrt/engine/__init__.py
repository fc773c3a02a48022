"""The engine: ForwardBatch, ModelRunner, EngineCore and the in-process Engine."""

__all__ = ["Engine", "RequestOutput", "StreamDelta", "resolve_config"]


def __getattr__(name: str):
    # Lazy, so that radixrt.engine.forward_batch imports without the whole engine
    # (the model imports it; the engine imports the model).
    if name in __all__:
        from radixrt.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'radixrt.engine' has no attribute {name!r}")
