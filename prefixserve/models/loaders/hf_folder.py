"""Hugging Face model folders: config.json + *.safetensors (+ tokenizer files)."""

from __future__ import annotations

import glob
import json
import os

import torch

from prefixserve.models.arch import ArchConfig, ModelLoadError

_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


class HFModel:
    """Opened HF folder: `arch` and `tensor(hf_name)` returning fp32 tensors."""

    def __init__(self, folder: str) -> None:
        from safetensors import safe_open

        cfg_path = os.path.join(folder, "config.json")
        if not os.path.isfile(cfg_path):
            raise ModelLoadError(f"model folder {folder} has no config.json")
        try:
            with open(cfg_path) as f:
                self.config = json.load(f)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {cfg_path}: {e}") from e
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        if not files:
            raise ModelLoadError(f"model folder {folder} has no *.safetensors files")
        self._where: dict[str, str] = {}
        self._handles = {}
        for fn in files:
            try:
                h = safe_open(fn, framework="pt")
            except Exception as e:
                raise ModelLoadError(f"cannot read safetensors file {fn}: {type(e).__name__}: {e}") from e
            self._handles[fn] = h
            for name in h.keys():  # noqa: SIM118 - a safetensors handle has keys(), no __iter__
                self._where[name] = fn
        self.arch = self._arch_config()

    def tensor(self, hf_name: str) -> torch.Tensor | None:
        fn = self._where.get(hf_name)
        if fn is None:
            return None
        try:
            return self._handles[fn].get_tensor(hf_name).float()
        except Exception as e:
            raise ModelLoadError(f"cannot read tensor {hf_name!r} from {fn}: {type(e).__name__}: {e}") from e

    def _arch_config(self) -> ArchConfig:
        c = self.config
        mt = c.get("model_type")
        if mt not in _MODEL_TYPES:
            raise ModelLoadError(f"model_type {mt!r} is not supported (supported: {', '.join(_MODEL_TYPES)})")
        try:
            heads = int(c["num_attention_heads"])
            hidden = int(c["hidden_size"])
            return ArchConfig(
                arch=_MODEL_TYPES[mt],
                vocab_size=int(c["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(c["intermediate_size"]),
                num_layers=int(c["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=int(c.get("head_dim") or hidden // heads),
                rope_theta=float(_rope_theta(c)),
                rms_eps=float(c.get("rms_norm_eps", 1e-6)),
                max_position=int(c.get("max_position_embeddings", 4096)),
                tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                qkv_bias=mt == "qwen2" or bool(c.get("attention_bias", False)),
                qk_norm=mt == "qwen3",
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks {e.args[0]!r}") from e


def _rope_theta(c: dict) -> float:
    scaling = c.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ModelLoadError(f"rope_scaling {scaling!r} is not supported")
    params = c.get("rope_parameters") or {}
    return c.get("rope_theta") or params.get("rope_theta") or 10000.0
