"""Hybrid (Gated DeltaNet + gated attention) architecture: the Qwen3.5 dense family's config.

Plain data, validated on construction; `from_hf_config` reads a Hugging Face config.json dict and
raises ModelLoadError naming what is unsupported (the MoE sibling, qwen3_next, other variants).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixserve.models.arch import ModelLoadError

HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
UNSUPPORTED_HYBRIDS = {
    "qwen3_5_moe": "the Qwen3.5 MoE sibling (mixture-of-experts MLP) is not supported; only the dense qwen3_5 is",
    "qwen3_5_moe_text": "the Qwen3.5 MoE sibling (mixture-of-experts MLP) is not supported; only the dense qwen3_5 is",
    "qwen3_next": "qwen3_next (Qwen3-Next: MoE, other attention gate layout) is not supported; only the dense qwen3_5 is",
}


@dataclass(frozen=True, slots=True)
class HybridConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention" per layer
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # the first rotary_dim dims of each head are rotated (partial RoPE)
    rope_theta: float
    rms_eps: float
    max_position: int
    conv_kernel: int
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for t in self.layer_types:
            if t not in ("linear_attention", "full_attention"):
                raise ModelLoadError(f"model config: layer type {t!r} is not supported")
        if self.num_heads % self.num_kv_heads or self.lin_v_heads % self.lin_k_heads:
            raise ModelLoadError("model config: head counts must divide (num_heads / num_kv_heads, linear v / k heads)")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ModelLoadError(f"model config: rotary dim {self.rotary_dim} must be even and <= head_dim")
        if self.conv_kernel < 1:
            raise ModelLoadError("model config: linear_conv_kernel_dim must be >= 1")

    # what the generic runner code reads (runner.py state_shape): attention layers only carry KV
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def lin_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def lin_key_size(self) -> int:
        return self.lin_k_heads * self.lin_k_dim

    @property
    def lin_value_size(self) -> int:
        return self.lin_v_heads * self.lin_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.lin_key_size + self.lin_value_size

    @classmethod
    def from_hf_config(cls, c: dict[str, Any]) -> HybridConfig:
        mt = c.get("model_type")
        if mt in UNSUPPORTED_HYBRIDS:
            raise ModelLoadError(f"model_type {mt!r}: {UNSUPPORTED_HYBRIDS[mt]}")
        if mt == "qwen3_5":
            c = c.get("text_config") or {}
            if c.get("model_type", "qwen3_5_text") != "qwen3_5_text":
                raise ModelLoadError(f"qwen3_5 text_config model_type {c.get('model_type')!r} is not supported")
        elif mt != "qwen3_5_text":
            raise ModelLoadError(f"model_type {mt!r} is not a supported hybrid ({', '.join(HYBRID_MODEL_TYPES)})")
        if c.get("attn_output_gate", True) is False:
            raise ModelLoadError("qwen3_5 without the attention output gate is not supported")
        if c.get("num_experts") or c.get("num_local_experts"):
            raise ModelLoadError("a qwen3_5 config with experts (MoE) is not supported; only the dense qwen3_5 is")
        params = c.get("rope_parameters") or c.get("rope_scaling") or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", None):
            raise ModelLoadError(f"rope type {rope_type!r} is not supported")
        # M-RoPE (mrope_section): for text every section sees the same position, i.e. plain RoPE
        try:
            heads = int(c["num_attention_heads"])
            hidden = int(c["hidden_size"])
            head_dim = int(c.get("head_dim") or hidden // heads)
            partial = float(params.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25)))
            n = int(c["num_hidden_layers"])
            types = c.get("layer_types") or [
                "full_attention" if (i + 1) % int(c.get("full_attention_interval", 4)) == 0 else "linear_attention"
                for i in range(n)
            ]
            return cls(
                arch="qwen3_5",
                vocab_size=int(c["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(c["intermediate_size"]),
                layer_types=tuple(types[:n]),
                num_heads=heads,
                num_kv_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rotary_dim=int(head_dim * partial),
                rope_theta=float(params.get("rope_theta", c.get("rope_theta", 10000.0))),
                rms_eps=float(c.get("rms_norm_eps", 1e-6)),
                max_position=int(c.get("max_position_embeddings", 32768)),
                conv_kernel=int(c.get("linear_conv_kernel_dim", 4)),
                lin_k_heads=int(c["linear_num_key_heads"]),
                lin_v_heads=int(c["linear_num_value_heads"]),
                lin_k_dim=int(c["linear_key_head_dim"]),
                lin_v_dim=int(c["linear_value_head_dim"]),
                tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks {e.args[0]!r}") from e
