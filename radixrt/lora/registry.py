"""The adapters an engine or a server serves, by name (torch-free: the front process keeps one)."""

from __future__ import annotations

from radixrt.config import ModelConfig
from radixrt.lora.adapter import AdapterInfo, LoraLoadError, read_adapter
from radixrt.sampling import LoraRef

MAX_NAME_CHARS = 256


class UnknownLora(LookupError):
    """A request or route named an adapter that is not loaded (the server answers 404)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"LoRA adapter {name!r} is not loaded")
        self.name = name


class LoraInUse(RuntimeError):
    """Unloading an adapter that running requests use (the server answers 409)."""

    def __init__(self, name: str, rids: list[str]) -> None:
        shown = ", ".join(rids[:8]) + (f" and {len(rids) - 8} more" if len(rids) > 8 else "")
        super().__init__(f"LoRA adapter {name!r} is in use by requests {shown}")
        self.name = name
        self.rids = rids


class LoraRegistry:
    """Loaded adapters by name: `load` reads and checks a directory (radixrt.lora.adapter),
    `resolve` turns a request's adapter name into the `LoraRef` its SamplingParams carry.
    Not thread-safe: its owner calls it from one thread (the engine's, the front's loop)."""

    def __init__(self, model: ModelConfig, max_rank: int) -> None:
        self.model = model
        self.max_rank = max_rank
        self._refs: dict[str, LoraRef] = {}
        self._infos: dict[str, AdapterInfo] = {}

    def load(self, name: str, path: str) -> LoraRef:
        """Serve the adapter at `path` as `name`. Loading the same files under the same name
        again is a no-op; another adapter under a taken name is refused (unload it first).
        Raises LoraLoadError naming the field at fault."""
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise LoraLoadError(
                f"lora_name={name!r}: must be 1..{MAX_NAME_CHARS} characters", "lora_name"
            )
        if not isinstance(path, str) or not path:
            raise LoraLoadError(f"lora_path={path!r}: must be a directory", "lora_path")
        info = read_adapter(path, self.model, self.max_rank)
        old = self._refs.get(name)
        if old is not None:
            if old.key == info.key:
                return old
            raise LoraLoadError(
                f"lora_name={name!r} is already loaded (from {old.path}); unload it first",
                "lora_name",
            )
        ref = LoraRef(name, info.key, info.path)
        self._refs[name] = ref
        self._infos[name] = info
        return ref

    def unload(self, name: str) -> LoraRef:
        """Stop serving `name` (UnknownLora if it is not loaded). Callers check first that no
        request uses it (`LoraInUse`)."""
        if name not in self._refs:
            raise UnknownLora(name)
        del self._infos[name]
        return self._refs.pop(name)

    def resolve(self, name: str) -> LoraRef:
        """The loaded adapter `name` (UnknownLora otherwise)."""
        ref = self._refs.get(name)
        if ref is None:
            raise UnknownLora(name)
        return ref

    def info(self, name: str) -> AdapterInfo:
        if name not in self._infos:
            raise UnknownLora(name)
        return self._infos[name]

    def __contains__(self, name: object) -> bool:
        return name in self._refs

    def names(self) -> list[str]:
        """Loaded adapter names, in load order."""
        return list(self._refs)
