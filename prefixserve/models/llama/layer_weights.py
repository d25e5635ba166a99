"""One decoder layer's weights (`LayerWeights`): what the Llama-family decoder, its 4-bit decode rows,
its native decode step and the loaders share."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixserve.models.kernels.int4 import Int4Weight


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]  (q, k, v fused)
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor  # [hidden, q_size]
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]  (gate, up fused)
    down: torch.Tensor  # [hidden, intermediate]
    q_norm: torch.Tensor | None = None  # [head_dim] (qwen3)
    k_norm: torch.Tensor | None = None
    # 4-bit copies for decode rows (kernels/int4.py); None = decode rows use the dense weight too
    qkv_q4: Int4Weight | None = None
    o_q4: Int4Weight | None = None
    gate_up_q4: Int4Weight | None = None
    down_q4: Int4Weight | None = None

    @property
    def dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The four dense matmul weights: qkv, o_proj, gate_up, down."""
        return self.qkv, self.o_proj, self.gate_up, self.down

    @property
    def int4(self) -> tuple[Int4Weight | None, Int4Weight | None, Int4Weight | None, Int4Weight | None]:
        """Their 4-bit copies, in the same order."""
        return self.qkv_q4, self.o_q4, self.gate_up_q4, self.down_q4

    @property
    def norms(self) -> tuple[torch.Tensor | None, ...]:
        """The RMSNorm weights (q_norm, k_norm None where the model has none)."""
        return self.attn_norm, self.mlp_norm, self.q_norm, self.k_norm
