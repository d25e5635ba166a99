"""Lean Llama-family decoder (llama, mistral, qwen2, qwen3) over a batch of sessions.

The decoder owns weights only. Per-session KV lives in the runner; a forward call receives, for
each session in the batch, a `Segment`: where its new tokens start and a view of its KV tensor.
Every row's arithmetic is batch- and split-invariant (see layers.py), which is what makes cached
prefixes exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefixserve.models.arch import ArchConfig
from prefixserve.models.layers import (
    apply_rope,
    batched_decode_attention,
    block_attention,
    inv_linear,
    rms_norm,
    rope_tables,
    single_query_attention,
)
from prefixserve.models.quant import Int4Weight, int4_linear


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
    # 4-bit copies for decode rows (models/quant.py); None = decode rows use the dense weight too
    qkv_q4: Int4Weight | None = None
    o_q4: Int4Weight | None = None
    gate_up_q4: Int4Weight | None = None
    down_q4: Int4Weight | None = None


@dataclass(slots=True)
class Segment:
    """One session's share of a batched forward.

    kv: [num_layers, 2, num_kv_heads, capacity, head_dim]; positions [0, start) hold the session's
    past keys/values, the forward writes [start, start + num_new), everything after stays zero.
    """

    start: int
    num_new: int
    kv: torch.Tensor
    want_logits: bool = True
    decode: bool = False  # a generated token: runs the decode kernels (must precede prefill segments)


class Decoder:
    def __init__(
        self,
        arch: ArchConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        min_rows: int,
    ) -> None:
        self.arch = arch
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head  # [vocab, hidden]; the same tensor as embed when tied
        self.min_rows = min_rows
        self.lm_head_q4: Int4Weight | None = None
        # set by weights.attach_int4: decode rows run 4-bit matmuls and `single_query_attention`,
        # whose bits differ from prefill's (still batch-invariant)
        self.int4_decode = False
        self.dtype = embed.dtype
        self.device = embed.device
        self.inv_freq = 1.0 / (
            arch.rope_theta
            ** (torch.arange(0, arch.head_dim, 2, dtype=torch.int64, device=self.device).float() / arch.head_dim)
        )

    @property
    def decode_matches_prefill(self) -> bool:
        """True when a decoded token's KV and logits have the bits prefilling it would give (no
        4-bit decode path), so decode-produced states may be cached."""
        return not self.int4_decode

    @property
    def decode_kernel(self) -> str:
        """"int4" or "dense": what decode rows run (`--decode-kernel`, /health)."""
        return "int4" if self.int4_decode else "dense"

    def kernel_fingerprint(self) -> str:
        """Everything of the runtime's own choices that changes a state's bits (dtype, decode kernel,
        row padding), for the disk cache tier's file fingerprint (docs/cache.md). Minimal version
        from issue 15; the exactness work owns its body."""
        return f"{self.dtype}|{self.decode_kernel}|min_rows={self.min_rows}|{self.device.type}"

    def _linear(
        self, x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None, q4: Int4Weight | None, nd: int
    ) -> torch.Tensor:
        """The first `nd` rows are decode rows (4-bit kernel when the layer has one), the rest prefill."""
        if q4 is None or nd == 0:
            return inv_linear(x, dense, bias, self.min_rows)
        y = int4_linear(x[:nd], q4, bias)
        if nd == x.shape[0]:
            return y
        return torch.cat([y, inv_linear(x[nd:], dense, bias, self.min_rows)])

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """token_ids: [sum(num_new)] int64, segments in the same order.

        Writes each segment's new K/V into its kv tensor. Returns fp32 logits [num_wanted, vocab],
        one row per segment with want_logits (its last new position), in segment order.
        """
        a = self.arch
        leading = 0  # decode segments lead the batch
        while leading < len(segments) and segments[leading].decode:
            leading += 1
        if any(s.decode for s in segments[leading:]):
            raise ValueError("decode segments must precede prefill segments")
        nd = sum(s.num_new for s in segments[:leading])
        positions = torch.cat(
            [torch.arange(s.start, s.start + s.num_new, device=self.device) for s in segments]
        )
        cos, sin = rope_tables(positions, self.inv_freq, self.dtype)
        h = self.embed[token_ids]  # [num_tokens, hidden]
        for li, lw in enumerate(self.layers):
            x = rms_norm(h, lw.attn_norm, a.rms_eps)
            qkv = self._linear(x, lw.qkv, lw.qkv_bias, lw.qkv_q4, nd)
            q = qkv[:, : a.q_size].view(-1, a.num_heads, a.head_dim)
            k = qkv[:, a.q_size : a.q_size + a.kv_size].view(-1, a.num_kv_heads, a.head_dim)
            v = qkv[:, a.q_size + a.kv_size :].view(-1, a.num_kv_heads, a.head_dim)
            if lw.q_norm is not None and lw.k_norm is not None:
                q = rms_norm(q, lw.q_norm, a.rms_eps)
                k = rms_norm(k, lw.k_norm, a.rms_eps)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            attn = self._attention(li, q, k, v, segments)
            h = h + self._linear(attn, lw.o_proj, None, lw.o_q4, nd)
            x = rms_norm(h, lw.mlp_norm, a.rms_eps)
            gu = self._linear(x, lw.gate_up, None, lw.gate_up_q4, nd)
            gate, up = gu.split(a.intermediate_size, dim=-1)
            h = h + self._linear(F.silu(gate) * up, lw.down, None, lw.down_q4, nd)
        last_rows: list[int] = []
        offset = 0
        for s in segments:
            offset += s.num_new
            if s.want_logits:
                last_rows.append(offset - 1)
        if not last_rows:
            return torch.empty(0, a.vocab_size)
        x = rms_norm(h[last_rows], self.final_norm, a.rms_eps)
        if self.lm_head_q4 is not None:
            # every logits row, prefill's too: no KV depends on it, and its rows are batch-invariant,
            # so cached and recomputed logits still agree; it saves a 16-row dense matmul per prefill
            return int4_linear(x, self.lm_head_q4, out_dtype=torch.float32)
        return inv_linear(x, self.lm_head, None, self.min_rows).float()

    def _attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[Segment]
    ) -> torch.Tensor:
        """Write new K/V, then attend: all single-token segments together, longer ones one by one.

        Both paths give a row the same bits (see layers.py), so which path a token takes never matters."""
        outs: list[torch.Tensor | None] = [None] * len(segments)
        singles: list[int] = []
        rows: list[tuple[int, int]] = []
        offset = 0
        for i, s in enumerate(segments):
            end = offset + s.num_new
            kv = s.kv[layer]  # [2, kv_heads, capacity, head_dim]
            kv[0, :, s.start : end - offset + s.start] = k[offset:end].transpose(0, 1)
            kv[1, :, s.start : end - offset + s.start] = v[offset:end].transpose(0, 1)
            rows.append((offset, end))
            if s.decode and self.int4_decode:
                outs[i] = single_query_attention(q[offset], kv[0], kv[1], s.start + 1)
            elif s.num_new == 1:
                singles.append(i)
            else:
                outs[i] = block_attention(q[offset:end], kv[0], kv[1], s.start, self.min_rows)
            offset = end
        if singles:
            idx = torch.tensor([rows[i][0] for i in singles])
            dec = batched_decode_attention(
                q[idx], [segments[i].kv[layer, 0] for i in singles], [segments[i].kv[layer, 1] for i in singles],
                [segments[i].start for i in singles], self.min_rows,
            )
            for j, i in enumerate(singles):
                outs[i] = dec[j : j + 1]
        return outs[0] if len(outs) == 1 else torch.cat(outs)  # type: ignore[arg-type]
