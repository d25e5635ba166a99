"""Llama-family decoders and their loaders (GGUF, HF safetensors folders)."""

from prefixserve.models.arch import ArchConfig, ModelLoadError
from prefixserve.models.decoder import Decoder, Segment
from prefixserve.models.loader import LoadedModel, load_model, resolve_device, resolve_dtype

__all__ = ["ArchConfig", "Decoder", "LoadedModel", "ModelLoadError", "Segment", "load_model",
           "resolve_device", "resolve_dtype"]
