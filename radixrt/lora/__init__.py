"""LoRA adapters over the base model: PEFT directories read and checked without torch
(`adapter`), named in a registry (`registry`), their weights in a device slot pool that one
forward mixes row by row (`slots`, torch). The package imports no torch itself: the server's
front process uses the registry."""

from radixrt.lora.adapter import SERVED_MODULES, AdapterInfo, LoraLoadError, read_adapter
from radixrt.lora.registry import LoraInUse, LoraRegistry, UnknownLora

__all__ = [
    "SERVED_MODULES",
    "AdapterInfo",
    "LoraInUse",
    "LoraLoadError",
    "LoraRegistry",
    "UnknownLora",
    "read_adapter",
]
