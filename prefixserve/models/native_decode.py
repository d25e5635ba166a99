"""Decode rows in one native call (decode.c): every layer, the final norm and the logits of a step's
decoded tokens, on a team of threads, instead of ~30 torch ops a layer.

Used by models/decoder.py for the 4-bit decode rows where the native kernels build and every linear
weight of the model is packed for them (models/quant.py). Like the torch formulation it replaces,
it is row-local and thread-count invariant (decode.c), and its bits differ from prefill's, so the
engine never caches decode-produced KV (`Decoder.decode_matches_prefill`). The residual stream stays
in fp32 through the layers; K and V are written to the session's cache in bf16.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from prefixserve.models import native
from prefixserve.models.quant import Int4Weight
from prefixserve.models.threads import KERNEL_THREADS

if TYPE_CHECKING:
    from prefixserve.models.decoder import Decoder, Segment

MAX_REP = 32  # decode.c: query heads per kv head


@dataclass(slots=True)
class DecodePlan:
    dims: list[int]  # hidden, heads, kv_heads, head_dim, intermediate, layers, vocab_pad, head kind
    weights: torch.Tensor  # int64 [layers, 10]: decode.c's W_* addresses
    keep: list[torch.Tensor]  # the fp32 vectors those addresses point into
    final_norm: torch.Tensor
    head: torch.Tensor
    vocab: int
    eps: float
    scale: float


def _pack(w: Int4Weight | None, rows: int) -> tuple[int, int] | None:
    """(address, kind) of a weight's native pack holding exactly `rows` outputs, else None."""
    if w is None or w.native is None or not w.rows == rows == w.out_features:
        return None
    return w.native.data_ptr(), w.native_kind


def plan_for(dec: Decoder) -> DecodePlan | None:
    """The plan of `dec`'s native decode step, or None where it cannot run one (no native build, a
    weight without a native 4-bit pack, shapes decode.c does not take)."""
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
            head.native_kind]
    final = dec.final_norm.detach().float().contiguous()
    return DecodePlan(dims, torch.tensor(rows, dtype=torch.int64), keep, final, head.native, a.vocab_size,
                      a.rms_eps, a.head_dim**-0.5)


def decode_rows(dec: Decoder, plan: DecodePlan, token_ids: torch.Tensor, segments: list[Segment],
                ways: int | None = None) -> torch.Tensor | None:
    """Run the decode step of `segments` (one new token each, `token_ids`): writes each one's K/V
    at its position in every layer and returns fp32 logits [n, vocab]. None when a session's KV
    is not laid out as decode.c reads it (the caller runs the torch formulation). `ways`: the team's
    thread count (default: what KERNEL_THREADS allows "int4" calls)."""
    a = dec.arch
    n = len(segments)
    hd = a.head_dim
    for s in segments:
        kv = s.kv
        if (kv.dtype != torch.bfloat16 or kv.dim() != 5 or kv.stride(4) != 1 or kv.stride(3) != hd
                or kv.shape[3] <= s.start or s.num_new != 1):
            return None
    h = dec.embed[token_ids].float().contiguous()
    pos = torch.tensor([s.start for s in segments], dtype=torch.int64)
    cos, sin = dec.rope.lookup32(pos)
    kv_desc = torch.tensor([[s.kv.data_ptr(), s.kv.stride(0), s.kv.stride(1), s.kv.stride(2), s.kv.shape[3]]
                            for s in segments],
                           dtype=torch.int64)
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
