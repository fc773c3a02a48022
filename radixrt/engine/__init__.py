from radixrt.engine.engine import Engine, RequestOutput, StreamDelta, resolve_config

__all__ = ["Engine", "RequestOutput", "StreamDelta", "resolve_config"]
