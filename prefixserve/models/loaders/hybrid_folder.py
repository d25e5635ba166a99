"""Hugging Face folders of the dense Qwen3.5 family (config.json + *.safetensors) -> HybridDecoder.

Weight names as transformers' `Qwen3_5ForCausalLM` saves them (`model.layers.N...`), or under
`model.language_model.` as the multimodal `Qwen3_5ForConditionalGeneration` checkpoints store the
text model (the vision tower and MTP head are ignored).
"""

from __future__ import annotations

import json
import os

import torch

from prefixserve.models.arch import ModelLoadError
from prefixserve.models.hybrid.config import HYBRID_MODEL_TYPES, UNSUPPORTED_HYBRIDS, HybridConfig
from prefixserve.models.hybrid.decoder import HybridDecoder, HybridLayer
from prefixserve.models.layers import TilePlan
from prefixserve.models.loaders.hf_folder import HFModel


def folder_model_type(folder: str) -> str | None:
    """The config.json model_type of an HF folder, None when unreadable (the generic loader reports that)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            mt = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return mt if isinstance(mt, str) else None


def is_hybrid_type(model_type: str | None) -> bool:
    """True for every model_type this module answers for (supported or refused with a clear error)."""
    return model_type in HYBRID_MODEL_TYPES or model_type in UNSUPPORTED_HYBRIDS


class HybridHFModel(HFModel):
    """An opened Qwen3.5 folder: `arch` (a HybridConfig) and `tensor(name)` (fp32, text-model names)."""

    def _arch_config(self) -> HybridConfig:  # type: ignore[override]
        return HybridConfig.from_hf_config(self.config)

    def tensor(self, hf_name: str) -> torch.Tensor | None:
        t = super().tensor(hf_name)
        if t is None and hf_name.startswith("model."):
            t = super().tensor("model.language_model." + hf_name[len("model."):])
        return t


def build_hybrid(hf: HybridHFModel, dtype: torch.dtype, device: str, tiles: TilePlan) -> HybridDecoder:
    """Assemble a HybridDecoder. Raises ModelLoadError naming a missing or misshapen tensor."""
    a: HybridConfig = hf.arch  # type: ignore[assignment]

    def need(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = hf.tensor(name)
        if t is None:
            raise ModelLoadError(f"model weights: tensor {name!r} is missing")
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"model weights: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    def zc(name: str, dim: int) -> torch.Tensor:  # zero-centred norm weight, as (1 + w) in fp32
        return (1.0 + cast(need(name, (dim,))).float()).contiguous()

    hid = a.hidden_size
    layers = []
    for i, kind in enumerate(a.layer_types):
        p = f"model.layers.{i}."
        lw = HybridLayer(
            kind=kind,
            in_norm=zc(p + "input_layernorm.weight", hid),
            post_norm=zc(p + "post_attention_layernorm.weight", hid),
            gate_up=cast(torch.cat([need(p + "mlp.gate_proj.weight", (a.intermediate_size, hid)),
                                    need(p + "mlp.up_proj.weight", (a.intermediate_size, hid))])),
            down=cast(need(p + "mlp.down_proj.weight", (hid, a.intermediate_size))),
        )
        if kind == "full_attention":
            s = p + "self_attn."
            lw.qkv = cast(torch.cat([need(s + "q_proj.weight", (2 * a.q_size, hid)),
                                     need(s + "k_proj.weight", (a.kv_size, hid)),
                                     need(s + "v_proj.weight", (a.kv_size, hid))]))
            lw.o_proj = cast(need(s + "o_proj.weight", (hid, a.q_size)))
            lw.q_norm = zc(s + "q_norm.weight", a.head_dim)
            lw.k_norm = zc(s + "k_norm.weight", a.head_dim)
        else:
            s = p + "linear_attn."
            hv = a.lin_v_heads
            lw.lin_in = cast(torch.cat([need(s + "in_proj_qkv.weight", (a.conv_dim, hid)),
                                        need(s + "in_proj_z.weight", (a.lin_value_size, hid)),
                                        need(s + "in_proj_b.weight", (hv, hid)),
                                        need(s + "in_proj_a.weight", (hv, hid))]))
            lw.conv_w = cast(need(s + "conv1d.weight", (a.conv_dim, 1, a.conv_kernel))[:, 0]).float().contiguous()
            lw.neg_a = (-cast(need(s + "A_log", (hv,))).float().exp()).contiguous()
            lw.dt_bias = cast(need(s + "dt_bias", (hv,))).float().contiguous()
            lw.lin_norm = cast(need(s + "norm.weight", (a.lin_v_dim,)))
            lw.out_proj = cast(need(s + "out_proj.weight", (hid, a.lin_value_size)))
        layers.append(lw)
    embed = cast(need("model.embed_tokens.weight", (a.vocab_size, hid)))
    head = hf.tensor("lm_head.weight")
    lm_head = embed if (a.tie_embeddings or head is None) else cast(need("lm_head.weight", (a.vocab_size, hid)))
    return HybridDecoder(a, embed, layers, zc("model.norm.weight", hid), lm_head, tiles)
