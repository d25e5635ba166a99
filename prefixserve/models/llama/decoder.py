"""Lean Llama-family decoder (llama, mistral, qwen2, qwen3) over a batch of sessions.

The decoder owns weights (`LayerWeights`, layer_weights.py) and the kernels it runs them on: its
4-bit decode rows (`Int4Rows`, int4_rows.py) and the native decode step's plan (native_decode.py).
Per-session KV lives in the runner; a forward call receives, for each session in the batch, a
`Segment` (models/segment.py): where its new tokens start and a view of its KV tensor. Every row's
arithmetic is batch- and split-invariant (models/layers.py), which is what makes cached prefixes
exact.
"""

from __future__ import annotations

from collections.abc import Generator

import torch
import torch.nn.functional as F

from prefixserve.models.arch import ArchConfig
from prefixserve.models.final_rows import logit_rows, score_segments
from prefixserve.models.kernels import amx_tiles, native
from prefixserve.models.kernels.int4 import Int4Weight, int4_linear
from prefixserve.models.layers import (
    RopeTable,
    TilePlan,
    apply_rope,
    attend_segments,
    dense,
    rms_norm,
    run_through,
    tiled,
)
from prefixserve.models.llama import native_decode
from prefixserve.models.llama.int4_rows import Int4Rows
from prefixserve.models.llama.layer_weights import LayerWeights
from prefixserve.models.segment import Segment


class Decoder:
    """A Llama-family model's weights and its fixed-shape forward (`forward_layers`), with the kernel
    choices the loader made for this CPU (`use_fp32_matmuls`, `use_amx_tiles`, `decode_int8`)."""

    def __init__(
        self,
        arch: ArchConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        tiles: TilePlan,
    ) -> None:
        self.arch = arch
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head  # [vocab, hidden]; the same tensor as embed when tied
        self.tiles = tiles  # row tiles of every dense matmul; chosen by the start-up self-test
        self.lm_head_q4: Int4Weight | None = None
        # set by loaders/llama_weights.attach_int4: decode rows run 4-bit matmuls and fused attention (`int4_rows`),
        # whose bits differ from prefill's (still batch-invariant); the engine re-derives the KV of
        # decoded tokens by prefill before it caches them
        self.int4_decode = False
        # 4-bit decode rows' matmuls on activations rounded to int8 per 32 inputs (qmatmul.c `qmatmul_x`,
        # llama.cpp's kind of dot product): faster where the CPU lacks AVX-512; chosen by timing
        # (kernel_choice.py; `reset_native_plan` after changing it)
        self.decode_int8 = False
        self.dtype = embed.dtype
        self.device = embed.device
        inv_freq = 1.0 / (
            arch.rope_theta
            ** (torch.arange(0, arch.head_dim, 2, dtype=torch.int64, device=self.device).float() / arch.head_dim)
        )
        self.rope = RopeTable(inv_freq, self.dtype)
        # attention of every prefill and dense decode row: the native kernel (kernels/native.py,
        # attention.c) where it builds, else block_attention; both row-local by construction
        self.native_attention = native.attention_supported(arch.head_dim, self.dtype, self.device)
        # 4-bit decode rows in torch ops (where the native decode step does not run them); their attention
        # is torch's fused SDPA, or the native kernel where bf16 SDPA is slow (CPUs without bf16
        # arithmetic: 0.78 ms vs ~0.05 ms a layer at 500 keys; `use_fp32_matmuls`)
        self.int4_rows = Int4Rows(arch)
        self.matmul_dtype = self.dtype  # what the dense tiles multiply in (`use_fp32_matmuls`)
        self.prefill_q4 = False  # prefill's matmuls on the 4-bit packs (`use_fp32_matmuls`)
        # ... multiplying the rows rounded to int8 (`use_int8_prefill`)
        self.prefill_int8 = False
        self.amx = False  # dense matmuls on AMX tiles (`use_amx_tiles`)
        self.kernel_choice = ""  # how the loader chose the kernels above, for logs and /health (kernel_choice.py)
        self._native_plan: native_decode.DecodePlan | None | bool = False  # False: not made yet

    @property
    def native_decode_attention(self) -> bool:
        """Whether the 4-bit decode rows' torch formulation attends with the native kernel."""
        return self.int4_rows.native_attention

    @property
    def decode_matches_prefill(self) -> bool:
        """True when a decoded token's KV and logits have the bits prefilling it would give (no
        4-bit decode path): decode rows then run exactly the prefill calls."""
        return not self.int4_decode

    @property
    def decode_kernel(self) -> str:
        """"int4" or "dense": what decode rows run (`--decode-kernel`, /health); `decode_int8` says
        whether the 4-bit step multiplies int8 activations."""
        return "int4" if self.int4_decode else "dense"

    def kernel_fingerprint(self) -> str:
        """Everything of the runtime's own choices that changes a state's bits (dtype, device, decode
        kernel, tile plan, matmul precision, attention tiling), for the disk cache tier's file
        fingerprint (docs/cache.md)."""
        mm = ("|mm=q4x8" if self.prefill_int8 else "|mm=q4") if self.prefill_q4 else "" if self.matmul_dtype == self.dtype else f"|mm={self.matmul_dtype}"
        mm += "|mm=amx" if self.amx else ""
        x8 = "-i8" if self.decode_int8 and self.int4_decode else ""
        return (f"{self.dtype}|{self.device.type}|decode={self.decode_kernel}{x8}|tiles={self.tiles}{mm}"
                f"|attn={self.attention_kernel}")

    def use_fp32_matmuls(self, q4: bool = True) -> None:
        """A bf16 model on a CPU without bf16 arithmetic (no AVX512-BF16, no AMX: bf16 matmuls there
        ran at 26 GFLOPS against fp32's 67 at 64 rows). Where every layer has native 4-bit packs,
        prefill's matmuls multiply those codes (`prefill_q4`: qmatmul.c, row-local by construction,
        only a tile's real rows); otherwise the dense tiles multiply fp32 copies of the weights
        (`_widen`). Either way 4-bit decode rows attend with the native kernel and take their norms in
        fp32. Activations, KV and the 4-bit path stay bf16 (docs/exactness.md). `q4=False`: the fp32
        copies even where the packs are there."""
        if self.dtype != torch.bfloat16 or self.device.type != "cpu":
            return
        self.prefill_q4 = q4 and bool(self.layers) and all(
            w is not None and w.native is not None for lw in self.layers for w in lw.int4)
        if not self.prefill_q4:
            self._widen()
        self.int4_rows = Int4Rows.widened(self.arch, self.layers, self.native_attention)

    def use_int8_prefill(self) -> bool:
        """With `prefill_q4`, prompt rows' matmuls multiply the 4-bit codes by the rows rounded to int8 per
        32 inputs (gemm.c X4: llama.cpp's kind of arithmetic, integer dot products, ~1.5x the fp32
        tile's speed on AVX2); only where the one-call native prefill runs them, which it then does for
        every prompt row (the torch-tiled path has no such kernel). Row-local, so cached prefixes stay
        exact; the kernel fingerprint says `mm=q4x8`. Returns whether it applies."""
        self.prefill_int8 = (self.prefill_q4 and self.int4_decode
                             and native_decode.plan_for(self, prompt_rows=False) is not None)
        self.reset_native_plan()
        return self.prefill_int8

    def use_amx_tiles(self) -> int:
        """Pack a bf16 decoder's dense weights (and its dense lm_head where logits use it) for amx.c's
        tiles (kernels/amx_tiles.py) and mark it (`amx`); returns how many were packed (0: AMX not usable
        here, nothing changes)."""
        if self.dtype != torch.bfloat16 or self.device.type != "cpu" or not native.amx_ready():
            return 0
        n = sum(amx_tiles.pack(w) for lw in self.layers for w in lw.dense)
        if self.lm_head_q4 is None:
            n += amx_tiles.pack(self.lm_head)
        self.amx = n > 0
        return n

    def _widen(self) -> None:
        """The dense tiles multiply fp32 copies of the weights (`layers.linear`), which replace the bf16
        ones (a dense lm_head only where logits use it)."""
        for lw in self.layers:
            lw.qkv, lw.o_proj, lw.gate_up, lw.down = (t.float() for t in (lw.qkv, lw.o_proj, lw.gate_up, lw.down))
            if lw.qkv_bias is not None:
                lw.qkv_bias = lw.qkv_bias.float()
        if self.lm_head_q4 is None:
            self.lm_head = self.lm_head.float()
        self.matmul_dtype = torch.float32

    @property
    def matmuls(self) -> str:
        """What prefill's matmuls multiply, for logs and /health."""
        if self.prefill_q4:
            how = "prefill one native call a layer" if self.native_decode_plan() is not None else "tiles"
            on = " on int8 activations" if self.prefill_int8 else ""
            return f"{self.dtype} model, matmuls on the 4-bit codes{on} ({how})"
        mm = self.matmul_dtype
        if self.amx:
            how = "prefill one native call a layer" if self.native_decode_plan() is not None else "tiles"
            return f"{self.dtype} matmuls on AMX tiles ({how})"
        return f"{self.dtype} matmuls" if mm == self.dtype else f"{self.dtype} model, {mm} matmuls"

    @property
    def attention_kernel(self) -> str:
        return native.kernel_name(self.native_attention)

    def drop_int4(self) -> None:
        """Decode rows fall back to the dense prefill path (the self-test refused the 4-bit rows)."""
        for lw in self.layers:
            lw.qkv_q4 = lw.o_q4 = lw.gate_up_q4 = lw.down_q4 = None
        self.lm_head_q4 = None
        self.int4_decode = self.decode_int8 = False
        self._native_plan = None
        if self.prefill_q4:  # prefill loses its 4-bit packs: fp32 copies of the dense weights instead
            self.prefill_q4 = self.prefill_int8 = False
            self._widen()
        elif self.matmul_dtype != self.dtype:
            self.lm_head = self.lm_head.to(self.matmul_dtype)  # the logits now use the dense lm_head
        elif self.amx:
            amx_tiles.pack(self.lm_head)

    def forward(self, token_ids: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """token_ids: [sum(num_new)] int64, segments in the same order; see `forward_layers`."""
        return run_through(self.forward_layers(token_ids, segments))

    @torch.inference_mode()
    def forward_layers(self, token_ids: torch.Tensor, segments: list[Segment]) -> Generator[None, None, torch.Tensor]:
        """The forward pass, pausing after each layer (a background refill runs a layer at a time
        between the engine's steps, engine/refill.py); the same calls whether paused or not.
        token_ids: [sum(num_new)] int64, segments in the same order.

        Writes each segment's new K/V into its kv tensor. Returns fp32 logits [num_wanted, vocab],
        one row per segment with want_logits (its last new position), in segment order.

        Rows are processed in groups of fixed shape (docs/exactness.md):
        # [0, nd)          4-bit decode rows (int4 mode only): one group, every op row-local
        # [nd, nd + P)     the other rows in plan tiles (P = sum of tiles; rows past the real
        #                  ones are zero padding, never attended and never returned)
        """
        a = self.arch
        leading = 0  # decode segments lead the batch
        while leading < len(segments) and segments[leading].decode:
            leading += 1
        if any(s.decode for s in segments[leading:]):
            raise ValueError("decode segments must precede prefill segments")
        nd = sum(s.num_new for s in segments[:leading]) if self.int4_decode else 0
        num_rows = token_ids.shape[0]
        tiles: list[tuple[int, int]] = []  # (start, rows) of each plan tile after the decode rows
        offset = nd
        for t in self.tiles.split(num_rows - nd):
            tiles.append((offset, t))
            offset += t
        total = offset
        decoded = None  # decode rows' logits from the native decode step (models/llama/native_decode.py)
        plan = self.native_decode_plan() if nd or self.prefill_q4 or self.amx else None
        if nd and plan is not None:
            decoded = native_decode.decode_rows(self, plan, token_ids[:nd], segments[:leading])
            if decoded is not None and num_rows == nd:  # every row decoded in one call: the loop below would do nothing
                return decoded[[i for i, s in enumerate(segments) if s.want_logits]]
        positions = torch.zeros(total, dtype=torch.long, device=self.device)
        positions[:num_rows] = torch.cat(
            [torch.arange(s.start, s.start + s.num_new, device=self.device) for s in segments]
        )
        cos, sin = self.rope.lookup(positions)
        if (plan is not None and (self.prefill_q4 or plan.prefill_weights is not None) and num_rows > nd and (decoded is not None or not nd)
                and (rows := native_decode.prefill_start(self, plan, token_ids[nd:], segments[leading:])) is not None):
            return (yield from native_decode.prefill_layers(self, plan, rows, decoded, segments, nd))
        h = self.embed.new_zeros(total, a.hidden_size)
        h[:num_rows] = self.embed[token_ids]
        q = h.new_empty(total, a.num_heads, a.head_dim)
        k = h.new_empty(total, a.num_kv_heads, a.head_dim)
        v = h.new_empty(total, a.num_kv_heads, a.head_dim)
        for li, lw in enumerate(self.layers):
            if nd and decoded is None:  # 4-bit decode rows: their own short path (own sessions only)
                h[:nd] = self.int4_rows.layer(self.tiles, li, lw, h[:nd], cos[:nd], sin[:nd], segments[:leading])
            for g0, gn in tiles:
                g1 = g0 + gn
                x = rms_norm(h[g0:g1], lw.attn_norm, a.rms_eps)
                qkv = self._matmul("qkv", x, lw.qkv, lw.qkv_bias, lw.qkv_q4, num_rows - g0)
                gq = qkv[:, : a.q_size].view(-1, a.num_heads, a.head_dim)
                gk = qkv[:, a.q_size : a.q_size + a.kv_size].view(-1, a.num_kv_heads, a.head_dim)
                v[g0:g1] = qkv[:, a.q_size + a.kv_size :].view(-1, a.num_kv_heads, a.head_dim)
                if lw.q_norm is not None and lw.k_norm is not None:
                    gq = rms_norm(gq, lw.q_norm, a.rms_eps)
                    gk = rms_norm(gk, lw.k_norm, a.rms_eps)
                q[g0:g1] = apply_rope(gq, cos[g0:g1], sin[g0:g1])
                k[g0:g1] = apply_rope(gk, cos[g0:g1], sin[g0:g1])
            attn = attend_segments(li, q, k, v, segments, total, self.native_attention, skip=leading if nd else 0)
            for g0, gn in tiles:
                g1 = g0 + gn
                real = num_rows - g0
                hg = h[g0:g1] + self._matmul("o_proj", attn[g0:g1], lw.o_proj, None, lw.o_q4, real)
                x = rms_norm(hg, lw.mlp_norm, a.rms_eps)
                gu = self._matmul("gate_up", x, lw.gate_up, None, lw.gate_up_q4, real)
                gate, up = gu.split(a.intermediate_size, dim=-1)
                h[g0:g1] = hg + self._matmul("down", F.silu(gate) * up, lw.down, None, lw.down_q4, real)
            yield
        score_segments(segments, h, self._logits)
        last_rows = logit_rows(segments)
        if decoded is not None:  # decode rows lead: row i is segment i
            rest = [r for r in last_rows if r >= nd]
            mine = decoded[[r for r in last_rows if r < nd]]
            return torch.cat([mine, self._logits(h[rest])]) if rest else mine
        if not last_rows:
            return torch.empty(0, a.vocab_size, device=self.device)
        return self._logits(h[last_rows])

    def _matmul(self, site: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                q4: Int4Weight | None, real: int) -> torch.Tensor:
        """A tile's matmul: the dense tile (`dense`), or with `prefill_q4` the 4-bit codes for its first
        `real` rows only (qmatmul.c: a row's bits are its own), the padding rows zero."""
        if not self.prefill_q4 or q4 is None:
            return dense(site, x, w, bias)
        real = min(real, x.shape[0])
        if real == x.shape[0]:
            return int4_linear(x, q4, bias)
        y = x.new_zeros(x.shape[0], q4.out_features)
        y[:real] = int4_linear(x[:real], q4, bias)
        return y

    def native_decode_plan(self) -> native_decode.DecodePlan | None:
        """The one-call native decode step's plan where it runs (made once; `drop_int4` ends it)."""
        if self._native_plan is False:
            self._native_plan = native_decode.plan_for(self)
        return self._native_plan  # type: ignore[return-value]

    def reset_native_plan(self) -> None:
        """Make the native decode step's plan again at its next use (the kernel choices changed)."""
        self._native_plan = False

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden rows (batch-invariant: plan tiles, or the 4-bit head)."""
        a = self.arch
        if self.lm_head_q4 is not None:
            # every logits row, prefill's too: no KV depends on it, and its rows are batch-invariant,
            # so cached and recomputed logits still agree; it saves a dense vocab matmul per prefill
            head = self.lm_head_q4
            x = tiled(rows, self.tiles.head, lambda t: rms_norm(t, self.final_norm, a.rms_eps))
            return int4_linear(x, head, out_dtype=torch.float32)
        return tiled(rows, self.tiles.head,
                     lambda t: dense("lm_head", rms_norm(t, self.final_norm, a.rms_eps), self.lm_head).float())
