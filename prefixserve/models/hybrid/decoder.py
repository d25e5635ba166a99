"""Hybrid decoder: Gated DeltaNet layers + gated full-attention layers (the dense Qwen3.5 family).

Same contract as the Llama decoder's `Decoder.forward` (models/llama/decoder.py; docs/exactness.md,
docs/hybrid.md): rows in plan tiles, attention in 16-token query tiles over 32-key blocks (the
attention layers' KV lives in the segment's `kv`, indexed by attention layer), and the recurrent
layers' state in the segment's `rec` (a `RecurrentState`), evaluated one fixed-shape CELL-position
cell at a time (gated_delta.py). A decode row runs exactly the calls of a one-token prefill, so decoded
states equal prefilled ones and every position is a valid snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefixserve.models.final_rows import logit_rows, score_segments
from prefixserve.models.hybrid.config import HybridConfig
from prefixserve.models.hybrid.gated_delta import CELL, conv_silu, delta_cell, l2norm
from prefixserve.models.kernels import native
from prefixserve.models.layers import RopeTable, TilePlan, apply_rope, attend_segments, tiled
from prefixserve.models.segment import Segment


@dataclass(slots=True)
class RecurrentState:
    """Recurrent layers' state of one session at position p (the session's num_tokens).

    conv:  [lin_layers, K - 1, conv_dim] model dtype: the conv inputs of positions [p - K + 1, p)
    cell:  [lin_layers, CELL, conv_dim + 2 * v_heads] fp32: post-conv q|k|v, g, beta of the
           positions [p - p % CELL, p) of the current cell; rows from p % CELL on are ZERO
    delta: [lin_layers, v_heads, k_dim, v_dim] fp32: the delta state at position p - p % CELL
    """

    conv: torch.Tensor
    cell: torch.Tensor
    delta: torch.Tensor

    def clone(self) -> RecurrentState:
        return RecurrentState(self.conv.clone(), self.cell.clone(), self.delta.clone())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.cell, self.delta))


@dataclass(slots=True)
class HybridLayer:
    kind: str  # "linear_attention" | "full_attention"
    in_norm: torch.Tensor  # fp32 (1 + w): zero-centred RMSNorm weight
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor
    # full attention: q_proj rows are per head [query | gate]; qkv = [q_proj; k_proj; v_proj]
    qkv: torch.Tensor | None = None
    o_proj: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # fp32 (1 + w) over head_dim
    k_norm: torch.Tensor | None = None
    # Gated DeltaNet: lin_in = [in_proj_qkv; in_proj_z; in_proj_b; in_proj_a]
    lin_in: torch.Tensor | None = None
    conv_w: torch.Tensor | None = None  # fp32 [conv_dim, K]
    neg_a: torch.Tensor | None = None  # fp32 -exp(A_log) [v_heads]
    dt_bias: torch.Tensor | None = None  # fp32 [v_heads]
    lin_norm: torch.Tensor | None = None  # model dtype [v_dim] (gated RMSNorm, plain weight)
    out_proj: torch.Tensor | None = None


def rms_norm_zc(x: torch.Tensor, w1: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm as Qwen3.5 computes it: (norm(x) in fp32 * (1 + w)), cast to x's dtype."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w1).to(x.dtype)


class HybridDecoder:
    """Weights + fixed-shape forward of a hybrid model. Interface of `Decoder` where the runtime reads it."""

    hybrid = True
    int4_decode = False
    lm_head_q4 = None

    def __init__(self, arch: HybridConfig, embed: torch.Tensor, layers: list[HybridLayer], final_norm: torch.Tensor,
                 lm_head: torch.Tensor, tiles: TilePlan) -> None:
        self.arch = arch
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.tiles = tiles
        self.dtype = embed.dtype
        self.device = embed.device
        self.attn_index = {li: i for i, li in enumerate(arch.attn_layers)}
        self.lin_index = {li: i for i, li in enumerate(arch.lin_layers)}
        rot = arch.rotary_dim
        inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.int64, device=self.device).float() / rot))
        self.rope = RopeTable(inv_freq, self.dtype)
        # the attention layers run the Llama decoder's attention (layers.attend_segments), and so its
        # choice of kernel: attention.c where it builds, else block attention
        self.native_attention = native.attention_supported(arch.head_dim, self.dtype, self.device)

    decode_matches_prefill = True
    decode_kernel = "dense"

    @property
    def attention_kernel(self) -> str:
        return native.kernel_name(self.native_attention)

    def kernel_fingerprint(self) -> str:
        return (f"{self.dtype}|{self.device.type}|decode=dense|tiles={self.tiles}|attn={self.attention_kernel}"
                f"|delta=cell{CELL}")

    def drop_int4(self) -> None:
        pass

    def tile_weights(self) -> list[tuple[str, torch.Tensor]]:
        """One weight of every shape the row tiles multiply (for the start-up self-test)."""
        out: dict[str, torch.Tensor] = {}
        for lw in self.layers:
            for name in ("qkv", "o_proj", "lin_in", "out_proj", "gate_up", "down"):
                w = getattr(lw, name)
                if w is not None and name not in out:
                    out[name] = w
        return list(out.items())

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        """(attention layers, 2, kv heads, head dim): the KV part of a session state."""
        a = self.arch
        return (len(a.attn_layers), 2, a.num_kv_heads, a.head_dim)

    def new_recurrent(self) -> RecurrentState:
        a = self.arch
        n = len(a.lin_layers)
        return RecurrentState(
            torch.zeros(n, a.conv_kernel - 1, a.conv_dim, dtype=self.dtype, device=self.device),
            torch.zeros(n, CELL, a.conv_dim + 2 * a.lin_v_heads, dtype=torch.float32, device=self.device),
            torch.zeros(n, a.lin_v_heads, a.lin_k_dim, a.lin_v_dim, dtype=torch.float32, device=self.device),
        )

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """As `Decoder.forward`; every segment also carries `rec` (its RecurrentState, updated in place)."""
        a = self.arch
        num_rows = token_ids.shape[0]
        tiles = self.tiles.split(num_rows)
        total = sum(tiles)
        starts = [sum(tiles[:i]) for i in range(len(tiles))]
        positions = torch.zeros(total, dtype=torch.long, device=self.device)
        positions[:num_rows] = torch.cat([torch.arange(s.start, s.start + s.num_new, device=self.device) for s in segments])
        cos, sin = self.rope.lookup(positions)
        h = self.embed.new_zeros(total, a.hidden_size)
        h[:num_rows] = self.embed[token_ids]
        for li, lw in enumerate(self.layers):
            if lw.kind == "full_attention":
                self._attention_layer(li, lw, h, cos, sin, segments, starts)
            else:
                self._delta_layer(li, lw, h, segments, starts, num_rows)
            for g0 in starts:
                g1 = g0 + self.tiles.rows
                x = rms_norm_zc(h[g0:g1], lw.post_norm, a.rms_eps)
                gate, up = F.linear(x, lw.gate_up).split(a.intermediate_size, dim=-1)
                h[g0:g1] = h[g0:g1] + F.linear(F.silu(gate) * up, lw.down)
        score_segments(segments, h, self._logits)
        last_rows = logit_rows(segments)
        if not last_rows:
            return torch.empty(0, a.vocab_size, device=self.device)
        return self._logits(h[last_rows])

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden rows, in head tiles (batch-invariant)."""
        a = self.arch
        return tiled(rows, self.tiles.head,
                     lambda t: F.linear(rms_norm_zc(t, self.final_norm, a.rms_eps), self.lm_head).float())

    def _attention_layer(self, li: int, lw: HybridLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         segments: list[Segment], starts: list[int]) -> None:
        a = self.arch
        total, hd, rot = h.shape[0], a.head_dim, a.rotary_dim
        q = h.new_empty(total, a.num_heads, hd)
        k = h.new_empty(total, a.num_kv_heads, hd)
        v = h.new_empty(total, a.num_kv_heads, hd)
        gate = h.new_empty(total, a.q_size)
        for g0 in starts:
            g1 = g0 + self.tiles.rows
            y = F.linear(rms_norm_zc(h[g0:g1], lw.in_norm, a.rms_eps), lw.qkv)  # type: ignore[arg-type]
            qg = y[:, : 2 * a.q_size].view(-1, a.num_heads, 2 * hd)
            gate[g0:g1] = qg[..., hd:].reshape(-1, a.q_size)
            gq = rms_norm_zc(qg[..., :hd], lw.q_norm, a.rms_eps)  # type: ignore[arg-type]
            gk = rms_norm_zc(y[:, 2 * a.q_size : 2 * a.q_size + a.kv_size].view(-1, a.num_kv_heads, hd),
                             lw.k_norm, a.rms_eps)  # type: ignore[arg-type]
            v[g0:g1] = y[:, 2 * a.q_size + a.kv_size :].view(-1, a.num_kv_heads, hd)
            c, s = cos[g0:g1], sin[g0:g1]
            q[g0:g1] = torch.cat([apply_rope(gq[..., :rot], c, s), gq[..., rot:]], dim=-1)
            k[g0:g1] = torch.cat([apply_rope(gk[..., :rot], c, s), gk[..., rot:]], dim=-1)
        # the Llama decoder's attention, unchanged: native, or block attention / batched decode, over this layer's KV
        attn = attend_segments(self.attn_index[li], q, k, v, segments, total, self.native_attention)
        for g0 in starts:
            g1 = g0 + self.tiles.rows
            h[g0:g1] = h[g0:g1] + F.linear(attn[g0:g1] * torch.sigmoid(gate[g0:g1]), lw.o_proj)  # type: ignore[arg-type]

    def _delta_layer(self, li: int, lw: HybridLayer, h: torch.Tensor, segments: list[Segment], starts: list[int],
                     num_rows: int) -> None:
        a = self.arch
        total, cd, vs, hv = h.shape[0], a.conv_dim, a.lin_value_size, a.lin_v_heads
        mixed = h.new_zeros(total, cd)
        z = h.new_zeros(total, vs)
        gb = torch.zeros(total, 2 * hv, dtype=torch.float32, device=self.device)  # g | beta
        for g0 in starts:
            g1 = g0 + self.tiles.rows
            y = F.linear(rms_norm_zc(h[g0:g1], lw.in_norm, a.rms_eps), lw.lin_in)  # type: ignore[arg-type]
            mixed[g0:g1] = y[:, :cd]
            z[g0:g1] = y[:, cd : cd + vs]
            beta = y[:, cd + vs : cd + vs + hv].sigmoid()
            g = lw.neg_a * F.softplus(y[:, cd + vs + hv :].float() + lw.dt_bias)  # type: ignore[operator]
            gb[g0:g1] = torch.cat([g, beta.float()], dim=-1)
        core = h.new_zeros(total, vs)
        li_rec = self.lin_index[li]
        kern = a.conv_kernel
        offset = 0
        for s in segments:
            n = s.num_new
            rec = s.rec
            assert isinstance(rec, RecurrentState), "a hybrid segment carries its RecurrentState"
            ext = torch.cat([rec.conv[li_rec], mixed[offset : offset + n]])  # [K - 1 + n, cd]
            rec.conv[li_rec] = ext[n:]
            windows = ext.unfold(0, kern, 1).transpose(1, 2)  # [n, K, cd], oldest input first
            post = tiled(windows, self.tiles, lambda t: conv_silu(t, lw.conv_w).to(self.dtype)).float()  # type: ignore[arg-type]
            core[offset : offset + n] = self._delta_rows(li_rec, rec, s.start, post, gb[offset : offset + n])
            offset += n
        for g0 in starts:
            g1 = g0 + self.tiles.rows
            o = core[g0:g1].view(-1, hv, a.lin_v_dim).float()
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + a.rms_eps)
            o = lw.lin_norm * o.to(self.dtype)  # type: ignore[operator]
            o = (o * F.silu(z[g0:g1].view(-1, hv, a.lin_v_dim).float())).to(self.dtype)
            h[g0:g1] = h[g0:g1] + F.linear(o.reshape(-1, vs), lw.out_proj)  # type: ignore[arg-type]

    def _delta_rows(self, lin: int, rec: RecurrentState, start: int, post: torch.Tensor, gb: torch.Tensor) -> torch.Tensor:
        """Delta-rule outputs [n, v_size] (model dtype) of positions [start, start + n), one whole-cell
        `delta_cell` call per cell touched (gated_delta.py); advances `rec` to start + n."""
        outs = []
        pos, i, n = start, 0, post.shape[0]
        while i < n:
            c0 = pos % CELL
            take = min(n - i, CELL - c0)
            rec.cell[lin, c0 : c0 + take] = torch.cat([post[i : i + take], gb[i : i + take]], dim=-1)
            out, new_state = self._cell_call(rec.cell[lin], rec.delta[lin])
            outs.append(out[c0 : c0 + take])
            if c0 + take == CELL:  # the cell is complete: its end state is the next cell's start
                rec.delta[lin] = new_state
                rec.cell[lin].zero_()
            pos += take
            i += take
        return torch.cat(outs).to(self.dtype)

    def _cell_call(self, buf: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One fixed-shape evaluation of a cell buffer [CELL, conv_dim + 2 * v_heads] (zero rows after the
        real ones) from `state`. Returns (out [CELL, v_size] fp32, the state after the cell)."""
        a = self.arch
        ks, hk, hv, dk = a.lin_key_size, a.lin_k_heads, a.lin_v_heads, a.lin_k_dim
        q = buf[:, :ks].view(CELL, hk, dk)
        k = buf[:, ks : 2 * ks].view(CELL, hk, dk)
        v = buf[:, 2 * ks : a.conv_dim].view(CELL, hv, a.lin_v_dim)
        g = buf[:, a.conv_dim : a.conv_dim + hv]
        beta = buf[:, a.conv_dim + hv :]
        if hv != hk:
            q = q.repeat_interleave(hv // hk, dim=1)
            k = k.repeat_interleave(hv // hk, dim=1)
        q = l2norm(q) * dk**-0.5
        k = l2norm(k)
        out, new_state = delta_cell(state, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.t(), beta.t())
        return out.transpose(0, 1).reshape(CELL, a.lin_value_size), new_state
