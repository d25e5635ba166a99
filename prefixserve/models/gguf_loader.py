"""GGUF files (llama.cpp's format): metadata -> ArchConfig, tensors dequantised with the `gguf` package."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from prefixserve.models.arch import ArchConfig, ModelLoadError
from prefixserve.models.quant import Codes, codes_from_gguf, permute_rows

# Types we have tested; the gguf package dequantises more, which we accept and name in errors if it fails.
TESTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
_ARCH_MAP = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


class GGUFModel:
    """Opened GGUF file: `arch` and `tensor(hf_name)` returning fp32 tensors in HF layout."""

    def __init__(self, path: str) -> None:
        import gguf

        if not os.path.isfile(path):
            raise ModelLoadError(f"model file not found: {path}")
        try:
            self._reader = gguf.GGUFReader(path, "r")
        except Exception as e:  # the gguf package raises assorted errors on corrupt files
            raise ModelLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from e
        self.path = path
        self._gguf = gguf
        self.meta = {k: _field_value(f) for k, f in self._reader.fields.items() if not k.startswith("tokenizer.ggml.")}
        self._tensors = {}
        for t in self._reader.tensors:
            self._tensors[_hf_name(t.name)] = t
        self.arch = self._arch_config()

    def tensor(self, hf_name: str) -> torch.Tensor | None:
        t = self._tensors.get(hf_name)
        if t is None:
            return None
        qtype = self._gguf.GGMLQuantizationType(t.tensor_type)
        try:
            data = self._gguf.quants.dequantize(t.data, qtype)
        except NotImplementedError as e:
            raise ModelLoadError(
                f"tensor {t.name!r} uses quantisation type {qtype.name}, which cannot be dequantised "
                f"(supported and tested: {', '.join(TESTED_TYPES)})"
            ) from e
        w = torch.from_numpy(np.array(data, dtype=np.float32, copy=True))
        if self._permuted and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.arch.num_heads if hf_name.endswith("q_proj.weight") else self.arch.num_kv_heads
            w = _unpermute(w, heads)
        return w

    def codes(self, hf_name: str) -> list[Codes] | None:
        """The tensor's raw 4-bit codes for the int4 decode kernel (models/quant.py), in HF row
        order; None when absent or not Q4_0 / Q4_1 / Q8_0."""
        t = self._tensors.get(hf_name)
        if t is None or len(t.shape) != 2:
            return None
        qtype = self._gguf.GGMLQuantizationType(t.tensor_type).name
        codes = codes_from_gguf(np.asarray(t.data), qtype, (int(t.shape[1]), int(t.shape[0])))
        if codes is not None and self._permuted and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.arch.num_heads if hf_name.endswith("q_proj.weight") else self.arch.num_kv_heads
            codes = permute_rows(codes, _unpermute(torch.arange(codes[0].q.shape[0]), heads))
        return codes

    def _arch_config(self) -> ArchConfig:
        name = self.meta.get("general.architecture")
        if name not in _ARCH_MAP:
            raise ModelLoadError(f"GGUF architecture {name!r} is not supported (supported: {', '.join(_ARCH_MAP)})")
        # llama.cpp's converter permutes q/k rows of llama-style models for its interleaved RoPE.
        self._permuted = name in ("llama", "mistral")

        def m(key: str, default: Any = None) -> Any:
            v = self.meta.get(f"{name}.{key}", default)
            if v is None:
                raise ModelLoadError(f"GGUF metadata {name}.{key} is missing")
            return v

        embed = self._tensors.get("model.embed_tokens.weight")
        if embed is None:
            raise ModelLoadError("GGUF file has no token_embd.weight tensor")
        hidden = int(m("embedding_length"))
        heads = int(m("attention.head_count"))
        return ArchConfig(
            arch=_ARCH_MAP[name],
            vocab_size=int(embed.shape[1]) if len(embed.shape) > 1 else int(m("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(m("feed_forward_length")),
            num_layers=int(m("block_count")),
            num_heads=heads,
            num_kv_heads=int(m("attention.head_count_kv", heads)),
            head_dim=int(m("attention.key_length", hidden // heads)),
            rope_theta=float(m("rope.freq_base", 10000.0)),
            rms_eps=float(m("attention.layer_norm_rms_epsilon", 1e-6)),
            max_position=int(m("context_length", 4096)),
            tie_embeddings="lm_head.weight" not in self._tensors,
            qkv_bias="model.layers.0.self_attn.q_proj.bias" in self._tensors,
            qk_norm="model.layers.0.self_attn.q_norm.weight" in self._tensors,
        )


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"model.layers.{idx}.{_LAYER_NAMES[rest]}"
    return gguf_name


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert-time permutation: back to the rotate-half row order."""
    rows = w.shape[0]
    return w.view(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _field_value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - a metadata field gguf cannot decode is left out, not fatal
        return None
