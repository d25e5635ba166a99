"""Decoders and their loaders, by role:

- `llama/`: the Llama-family decoder (llama, mistral, qwen2, qwen3) and its kernel choices;
- `hybrid/`: the hybrid decoder (Gated DeltaNet + gated attention: the dense Qwen3.5 family);
- `kernels/`: the native kernels (C sources, their build and ctypes calls), 4-bit weights, AMX tiles
  and the thread team of the big calls;
- `loaders/`: model files (GGUF, HF safetensors folders) into decoders, and the prepared-model cache;
- here, what they share: `arch` (ArchConfig, ModelLoadError), `segment` (a forward's per-session
  input), `layers` (fixed-shape building blocks), `final_rows` (a forward's outputs), `tokenizer` and
  `thinking`.

The names below are imported on first use (they import torch, seconds): `kernels.native` and
`kernels.native_build` import without torch, so `prefixserve serve` starts compiling the kernels
before torch is imported."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixserve.models.arch import ArchConfig, ModelLoadError
    from prefixserve.models.llama.decoder import Decoder
    from prefixserve.models.loaders.load import LoadedModel, load_model, resolve_device, resolve_dtype
    from prefixserve.models.segment import Segment

__all__ = ["ArchConfig", "Decoder", "LoadedModel", "ModelLoadError", "Segment", "load_model",
           "resolve_device", "resolve_dtype"]

_HOMES = {"ArchConfig": "arch", "ModelLoadError": "arch", "Decoder": "llama.decoder", "Segment": "segment",
          "LoadedModel": "loaders.load", "load_model": "loaders.load", "resolve_device": "loaders.load",
          "resolve_dtype": "loaders.load"}


def __getattr__(name: str) -> Any:
    """The package's names from their modules, imported on first use."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
