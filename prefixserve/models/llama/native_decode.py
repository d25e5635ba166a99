"""Decode rows in one native call (decode.c): every layer, the final norm and the logits of a step's
decoded tokens, on a team of threads, instead of ~30 torch ops a layer.

Used by decoder.py for the 4-bit decode rows where the native kernels build and every linear
weight of the model is packed for them (kernels/int4.py). Like the torch formulation it replaces,
it is row-local and thread-count invariant (decode.c), and its bits differ from prefill's, so the
engine never caches decode-produced KV (`Decoder.decode_matches_prefill`). The residual stream stays
in fp32 through the layers; K and V are written to the session's cache in bf16.

Prompt rows run the same per-row arithmetic a layer per call (`prefill_layers`, where prefill
multiplies the 4-bit codes: `Decoder.prefill_q4`), with attention.c's attention instead of the decode
step's: every row's bits its own whatever the chunking, the batch or the thread count, so cached
prefixes stay exact (docs/exactness.md), and no torch op runs between the matmuls.
"""

from __future__ import annotations

import ctypes
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from prefixserve.models.arch import ArchConfig
from prefixserve.models.final_rows import logit_rows, score_segments
from prefixserve.models.kernels import amx_tiles, native
from prefixserve.models.kernels.int4 import Int4Weight
from prefixserve.models.kernels.threads import KERNEL_THREADS
from prefixserve.models.layers import RopeTable
from prefixserve.models.llama.layer_weights import LayerWeights
from prefixserve.models.segment import Segment

MAX_REP = 32  # decode.c: query heads per kv head
W_QKV, W_KINDS = 5, 9  # decode.c: a layer's first pack (qkv, o, gate_up, down follow) and its kinds


class DecodeModel(Protocol):
    """What the native step reads of a Llama-family decoder (`Decoder`): its weights and kernel choices."""

    arch: ArchConfig
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head_q4: Int4Weight | None
    rope: RopeTable
    int4_decode: bool
    decode_int8: bool
    amx: bool
    prefill_q4: bool
    prefill_int8: bool
    dtype: torch.dtype
    device: torch.device


@dataclass(slots=True)
class DecodePlan:
    # hidden, heads, kv_heads, head_dim, intermediate, layers, vocab_pad, head kind, decode rows on int8
    # activations (decode.c `q8x`)
    dims: list[int]
    weights: torch.Tensor  # int64 [layers, 10]: decode.c's W_* addresses
    keep: list[torch.Tensor]  # the fp32 vectors those addresses point into
    # prompt rows' weights where they differ from decode rows': the amx.c packs (models/kernels/amx_tiles.py),
    # or the Q4 packs' panel-ordered copies (`_panel_weights`: P4, or X4 with `prefill_int8`)
    prefill_weights: torch.Tensor | None
    final_norm: torch.Tensor
    head: torch.Tensor
    vocab: int
    eps: float
    scale: float
    panels: list[torch.Tensor] = field(default_factory=list)  # the P4 / X4 packs prefill_weights points to


def _pack(w: Int4Weight | None, rows: int) -> tuple[int, int] | None:
    """(address, kind) of a weight's native pack holding exactly `rows` outputs, else None."""
    if w is None or w.native is None or not w.rows == rows == w.out_features:
        return None
    return w.native.data_ptr(), w.native_kind


def plan_for(dec: DecodeModel, prompt_rows: bool = True) -> DecodePlan | None:
    """The plan of `dec`'s native decode step, or None where it cannot run one (no native build, a
    weight without a native 4-bit pack, shapes decode.c does not take). `prompt_rows=False`: a plan
    for decode rows only (no prompt rows' copies of the weights: `prefill_weights` None)."""
    a = dec.arch
    head = dec.lm_head_q4
    ok = (dec.int4_decode and dec.dtype == torch.bfloat16 and dec.device.type == "cpu" and native.library() is not None
          and a.hidden_size % 32 == 0 and a.q_size % 32 == 0
          and a.intermediate_size % 32 == 0 and a.head_dim % 16 == 0 and a.head_dim <= 512
          and a.num_heads % a.num_kv_heads == 0 and a.num_heads // a.num_kv_heads <= MAX_REP
          and (a.q_size + 2 * a.kv_size) % 16 == 0)
    if not ok or head is None or head.native is None:
        return None
    keep: list[torch.Tensor] = []
    rows = []

    def vec(t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        f = t.detach().float().contiguous()
        keep.append(f)
        return f.data_ptr()

    for lw in dec.layers:
        packs = [_pack(lw.qkv_q4, a.q_size + 2 * a.kv_size), _pack(lw.o_q4, a.hidden_size),
                 _pack(lw.gate_up_q4, 2 * a.intermediate_size), _pack(lw.down_q4, a.hidden_size)]
        got = [p for p in packs if p is not None]
        if len(got) != len(packs):
            return None
        kinds = sum(kind << i for i, (_, kind) in enumerate(got))
        rows.append([vec(lw.attn_norm), vec(lw.mlp_norm), vec(lw.q_norm), vec(lw.k_norm), vec(lw.qkv_bias),
                     *(address for address, _ in got), kinds])
    dims = [a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size, a.num_layers, head.rows,
            head.native_kind, int(dec.decode_int8)]
    final = dec.final_norm.detach().float().contiguous()
    weights = torch.tensor(rows, dtype=torch.int64)
    panels: list[torch.Tensor] = []
    prefill = _amx_weights(dec, weights) if prompt_rows else None
    if prefill is None and prompt_rows and dec.prefill_q4:
        prefill = _panel_weights(dec, weights, panels)
    return DecodePlan(dims, weights, keep, prefill, final, head.native, a.vocab_size, a.rms_eps, a.head_dim**-0.5,
                      panels)


def _panel_weights(dec: DecodeModel, weights: torch.Tensor, panels: list[torch.Tensor]) -> torch.Tensor:
    """`weights` with every Q4 pack's copy for prompt rows, appended to `panels` (the plan keeps them):
    gemm.c's P4 (decode.c W_KINDS bits 8-11: the same values, read without transposing, ~3x faster to
    turn into floats), or with `dec.prefill_int8` its X4 (bits 12-15: the same codes, multiplied by the
    rows rounded to int8). 80 MB more for the embedded model. Q8 packs stay."""
    out = weights.clone()
    pack, bit = (native.qx4_pack, 12) if dec.prefill_int8 else (native.qpanel_pack, 8)
    for li, lw in enumerate(dec.layers):
        for i, w in enumerate((lw.qkv_q4, lw.o_q4, lw.gate_up_q4, lw.down_q4)):
            if w is None or w.native is None or w.native_kind != 0:
                continue
            p = pack(w.native)
            panels.append(p)
            out[li, W_QKV + i] = p.data_ptr()
            out[li, W_KINDS] = int(out[li, W_KINDS]) | 1 << (bit + i)
    return out


def _amx_weights(dec: DecodeModel, weights: torch.Tensor) -> torch.Tensor | None:
    """`weights` with every pack an amx.c one (decode.c W_KINDS bits 4-7) where the decoder has them
    all (`Decoder.amx`), for prompt rows; else None."""
    if not dec.amx:
        return None
    out = weights.clone()
    for li, lw in enumerate(dec.layers):
        packs = [amx_tiles.packed(w) for w in lw.dense]
        if any(p is None for p in packs):
            return None
        for i, p in enumerate(packs):
            out[li, W_QKV + i] = p.data_ptr()  # type: ignore[union-attr]
        out[li, W_KINDS] = int(out[li, W_KINDS]) | 0xF0
    return out


def decode_rows(dec: DecodeModel, plan: DecodePlan, token_ids: torch.Tensor, segments: list[Segment],
                ways: int | None = None) -> torch.Tensor | None:
    """Run the decode step of `segments` (one new token each, `token_ids`): writes each one's K/V
    at its position in every layer and returns fp32 logits [n, vocab]. None when a session's KV
    is not laid out as decode.c reads it (the caller runs the torch formulation). `ways`: the team's
    thread count (default: what KERNEL_THREADS allows "int4" calls)."""
    a = dec.arch
    n = len(segments)
    hd = a.head_dim
    kv_desc = _kv_desc(segments, hd) if all(s.num_new == 1 for s in segments) else None
    if kv_desc is None:
        return None
    h = dec.embed[token_ids].float().contiguous()
    pos = torch.tensor([s.start for s in segments], dtype=torch.int64)
    cos, sin = dec.rope.lookup32(pos)
    y = torch.empty(n, plan.dims[6])
    dims = torch.tensor([n, *plan.dims], dtype=torch.int64)
    lib = native.library()
    assert lib is not None

    def call(t: int) -> int:
        rc = lib.decode_step(dims.data_ptr(), ctypes.c_float(plan.eps), ctypes.c_float(plan.scale),
                             plan.weights.data_ptr(), plan.final_norm.data_ptr(), plan.head.data_ptr(), h.data_ptr(),
                             pos.data_ptr(), cos.data_ptr(), sin.data_ptr(), kv_desc.data_ptr(), y.data_ptr(), t)
        if rc < 0:
            raise MemoryError("native decode step: out of memory")
        return int(rc)

    KERNEL_THREADS.team("int4", ("decode", n, int(pos.max()) // 512), call, ways)
    return y[:, : plan.vocab]


@dataclass(slots=True)
class PrefillRows:
    """A step's prompt rows on their way through `prefill_layer`: h, the residual stream [n, hidden] in
    fp32, and what decode.c reads of the rows."""

    h: torch.Tensor
    dims: torch.Tensor
    pos: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    kv_desc: torch.Tensor
    segs: torch.Tensor
    scratch: torch.Tensor


def _kv_desc(segments: list[Segment], hd: int) -> torch.Tensor | None:
    """decode.c's view of each row's session KV (one row per new token), or None where a session's KV
    is not laid out as it reads it."""
    rows = []
    for s in segments:
        kv = s.kv
        if (kv.dtype != torch.bfloat16 or kv.dim() != 5 or kv.stride(4) != 1 or kv.stride(3) != hd
                or kv.shape[3] < s.start + s.num_new):
            return None
        rows += [[kv.data_ptr(), kv.stride(0), kv.stride(1), kv.stride(2), kv.shape[3]]] * s.num_new
    return torch.tensor(rows, dtype=torch.int64)


def prefill_start(dec: DecodeModel, plan: DecodePlan, token_ids: torch.Tensor,
                  segments: list[Segment]) -> PrefillRows | None:
    """The prompt rows of `segments` (token_ids in order) ready for `prefill_layer`; None where a
    session's KV is not laid out as decode.c reads it (the caller runs the tile path)."""
    kv_desc = _kv_desc(segments, dec.arch.head_dim)
    if kv_desc is None:
        return None
    lib = native.library()
    assert lib is not None
    n = token_ids.shape[0]
    pos = torch.cat([torch.arange(s.start, s.start + s.num_new) for s in segments])
    cos, sin = dec.rope.lookup32(pos)
    firsts = torch.tensor([0, *(s.num_new for s in segments)]).cumsum(0)[:-1]
    segs = torch.stack([firsts, torch.tensor([s.num_new for s in segments])], dim=1).contiguous()
    dims = torch.tensor([n, *plan.dims], dtype=torch.int64)
    scratch = torch.empty(int(lib.prefill_scratch(dims.data_ptr(), KERNEL_THREADS.threads)))
    return PrefillRows(dec.embed[token_ids].float().contiguous(), dims, pos, cos, sin, kv_desc, segs, scratch)


def prefill_layer(plan: DecodePlan, rows: PrefillRows, layer: int, ways: int | None = None) -> None:
    """Layer `layer` for the prompt rows (decode.c `prefill_layer`): writes their K/V, advances rows.h.
    Each row's bits are its own, whatever the batch, chunking or thread count."""
    lib = native.library()
    assert lib is not None
    h = rows.h

    def call(t: int) -> int:
        weights = plan.weights if plan.prefill_weights is None else plan.prefill_weights
        rc = lib.prefill_layer(rows.dims.data_ptr(), ctypes.c_float(plan.eps), ctypes.c_float(plan.scale),
                               weights.data_ptr(), layer, h.data_ptr(), rows.pos.data_ptr(), rows.cos.data_ptr(),
                               rows.sin.data_ptr(), rows.kv_desc.data_ptr(), rows.segs.data_ptr(), rows.segs.shape[0],
                               rows.scratch.data_ptr(), min(t, KERNEL_THREADS.threads))
        if rc < 0:
            raise MemoryError("native prefill: out of memory")
        return int(rc)

    KERNEL_THREADS.team("int4", ("prefill", h.shape[0], int(rows.pos.max()) // 512), call, ways)


def rows_logits(plan: DecodePlan, h: torch.Tensor, ways: int | None = None) -> torch.Tensor:
    """fp32 logits [n, vocab] of residual rows h [n, hidden] fp32: the final norm and the head as a
    decode step computes them (decode.c `logits`)."""
    lib = native.library()
    assert lib is not None
    h = h.contiguous()
    dims = torch.tensor([h.shape[0], *plan.dims], dtype=torch.int64)
    y = torch.empty(h.shape[0], plan.dims[6])

    def call(t: int) -> int:
        rc = lib.rows_logits(dims.data_ptr(), ctypes.c_float(plan.eps), plan.final_norm.data_ptr(),
                             plan.head.data_ptr(), h.data_ptr(), y.data_ptr(), t)
        if rc < 0:
            raise MemoryError("native logits: out of memory")
        return int(rc)

    KERNEL_THREADS.team("int4", ("logits", h.shape[0]), call, ways)
    return y[:, : plan.vocab]


def prefill_layers(dec: DecodeModel, plan: DecodePlan, rows: PrefillRows, decoded: torch.Tensor | None,
                   segments: list[Segment], nd: int) -> Generator[None, None, torch.Tensor]:
    """`Decoder.forward_layers` with the prompt rows in one native call a layer (`prefill_layer`) and the
    first `nd` rows, decode rows, already done (`decoded`: their logits, or None when nd is 0); pauses
    after each layer and returns what forward_layers returns."""
    for layer in range(len(dec.layers)):
        prefill_layer(plan, rows, layer)
        yield
    score_segments(segments, rows.h, lambda x: rows_logits(plan, x), skip=nd)
    wanted = logit_rows(segments)
    mine = [r - nd for r in wanted if r >= nd]
    out = rows_logits(plan, rows.h[mine]) if mine else torch.empty(0, dec.arch.vocab_size)
    if decoded is not None:
        out = torch.cat([decoded[[r for r in wanted if r < nd]], out])
    return out
