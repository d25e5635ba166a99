"""Llama-family decoders and their loaders (GGUF, HF safetensors folders).

The names below are imported on first use (they import torch, seconds): `native` and `native_build`
import without torch, so `prefixserve serve` starts compiling the kernels before torch is imported."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixserve.models.arch import ArchConfig, ModelLoadError
    from prefixserve.models.decoder import Decoder, Segment
    from prefixserve.models.loader import LoadedModel, load_model, resolve_device, resolve_dtype

__all__ = ["ArchConfig", "Decoder", "LoadedModel", "ModelLoadError", "Segment", "load_model",
           "resolve_device", "resolve_dtype"]

_HOMES = {"ArchConfig": "arch", "ModelLoadError": "arch", "Decoder": "decoder", "Segment": "decoder",
          "LoadedModel": "loader", "load_model": "loader", "resolve_device": "loader", "resolve_dtype": "loader"}


def __getattr__(name: str) -> Any:
    """The package's names from their modules, imported on first use."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
