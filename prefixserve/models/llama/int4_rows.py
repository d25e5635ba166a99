"""4-bit decode rows in torch ops, a layer at a time: where the one-call native decode step
(native_decode.py) cannot run (no native build, a weight without a 4-bit copy, shapes it
does not take, a session's KV laid out otherwise).

These rows' KV is never cached (it is re-derived by prefill before a turn is cached), so their
arithmetic need not match prefill's, only be row-local: the 4-bit kernel, torch's fused RMSNorm,
one RoPE call for q and k together, and one fused attention call per session (its bits depend on
that session's keys only). Fewer, larger ops than the tile path: a decode step is mostly per-op
overhead at one row (docs/architecture.md, "Decode").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from prefixserve.models.arch import ArchConfig
from prefixserve.models.kernels import native
from prefixserve.models.kernels.int4 import Int4Weight, int4_linear
from prefixserve.models.layers import TilePlan, apply_rope, dense, tiled
from prefixserve.models.llama.layer_weights import LayerWeights
from prefixserve.models.segment import Segment


@dataclass(frozen=True, slots=True)
class Int4Rows:
    """The 4-bit decode rows' torch formulation for a model of `arch`, and how it runs them: its norms
    in fp32 where `norms32` holds the fp32 copies of the norm weights (by id of the model's weight),
    its attention on the native kernel where `native_attention` (CPUs without bf16 arithmetic:
    `Decoder.use_fp32_matmuls`), else torch's fused SDPA."""

    arch: ArchConfig
    norms32: dict[int, torch.Tensor] = field(default_factory=dict)
    native_attention: bool = False

    @classmethod
    def widened(cls, arch: ArchConfig, layers: list[LayerWeights], native_attention: bool) -> Int4Rows:
        """Norms in fp32 (torch's fused bf16 one took 64 us a call there, fp32 ~5) and attention as told."""
        norms = {id(w): w.float() for lw in layers for w in lw.norms if w is not None}
        return cls(arch, norms, native_attention)

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm of 4-bit decode rows over the last dim (row-local): torch's fused kernel, in fp32
        where `norms32` has the weight's fp32 copy."""
        w32 = self.norms32.get(id(w))
        if w32 is None:
            return F.rms_norm(x, (x.shape[-1],), w, self.arch.rms_eps)
        return F.rms_norm(x.float(), (x.shape[-1],), w32, self.arch.rms_eps).to(x.dtype)

    @staticmethod
    def linear(tiles: TilePlan, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               q4: Int4Weight | None) -> torch.Tensor:
        """A 4-bit decode row group's matmul: the 4-bit kernel (any row count), or plan tiles for a
        layer without 4-bit codes. (Tile groups call F.linear on exactly the tile's shape.)"""
        if q4 is not None:
            return int4_linear(x, q4, bias)
        return tiled(x, tiles, lambda t: dense(f"decode{tuple(weight.shape)}", t, weight, bias))

    def layer(self, tiles: TilePlan, li: int, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """Layer `li` for the 4-bit decode rows h: [nd, hidden] (one row per segment, in order); `tiles`:
        the decoder's plan, for a weight without 4-bit codes."""
        a = self.arch
        n = h.shape[0]
        x = self.norm(h, lw.attn_norm)
        qkv = self.linear(tiles, x, lw.qkv, lw.qkv_bias, lw.qkv_q4)
        heads = a.num_heads + a.num_kv_heads
        if lw.q_norm is not None and lw.k_norm is not None:
            qk = torch.cat([
                self.norm(qkv[:, : a.q_size].view(n, a.num_heads, a.head_dim), lw.q_norm),
                self.norm(qkv[:, a.q_size : a.q_size + a.kv_size].view(n, a.num_kv_heads, a.head_dim), lw.k_norm),
            ], dim=1)
        else:
            qk = qkv[:, : a.q_size + a.kv_size].view(n, heads, a.head_dim)
        qk = apply_rope(qk, cos, sin)
        v = qkv[:, a.q_size + a.kv_size :].view(n, a.num_kv_heads, a.head_dim)
        attn = h.new_empty(n, a.q_size)
        for i, s in enumerate(segments):
            kv = s.kv[li]  # [2, kv_heads, capacity, head_dim]
            kv[0, :, s.start] = qk[i, a.num_heads :]
            kv[1, :, s.start] = v[i]
            length = s.start + 1
            if self.native_attention:
                attn[i] = native.attention(qk[i : i + 1, : a.num_heads], kv[0], kv[1], s.start)[0]
                continue
            attn[i] = F.scaled_dot_product_attention(
                qk[i, : a.num_heads].view(1, a.num_heads, 1, a.head_dim), kv[0, :, :length].unsqueeze(0),
                kv[1, :, :length].unsqueeze(0), enable_gqa=True,
            ).view(a.q_size)
        h = h + self.linear(tiles, attn, lw.o_proj, None, lw.o_q4)
        x = self.norm(h, lw.mlp_norm)
        gu = self.linear(tiles, x, lw.gate_up, None, lw.gate_up_q4)
        act = F.silu(gu[:, : a.intermediate_size]) * gu[:, a.intermediate_size :]
        return h + self.linear(tiles, act, lw.down, None, lw.down_q4)
