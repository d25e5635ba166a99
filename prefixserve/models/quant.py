"""4-bit weights for decode rows: GGUF Q4_0 / Q4_1 / Q8_0 codes run by torch's int4 CPU kernel.

Decode is memory-bound: a bf16 step streams 270 MB of SmolLM2 weights and pads every matmul to
16 rows for invariance. torch's `_weight_int4pack_mm_for_cpu` reads the GGUF codes directly (a
quarter of the bytes) and its per-output reduction over K is a fixed loop, so a row's bits do not
depend on how many rows share the call (checked for 1..64 rows, every offset, in tests/runner).
Its arithmetic differs from the dense bf16 matmul, so a token decoded this way has other bits
than the same token prefilled; the engine therefore never offers decode-produced KV to the cache
(see `Decoder.decode_matches_prefill`). Prefill stays dense and split-invariant.

Layout of the kernel's dequantisation: w = (code - 8) * scale + zero, per group of 32 along K.
- Q4_1 (d, m, 4-bit q): w = d*q + m  ->  scale = d, zero = m + 8d
- Q4_0 (d, 4-bit q):    w = d*(q-8)  ->  scale = d, zero = 0
- Q8_0 (d, int8 q):     w = d*q = d*(16h + l - 128) with h, l the nibbles of q + 128, run as two
  4-bit matrices: (h - 8) * 16d  +  ((l - 8) * d + 8d); their outputs are added.
Scales and zeros are rounded to bf16 (the kernel's requirement), like the dense bf16 weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from prefixserve.models.threads import KERNEL_THREADS

GROUP = 32  # GGUF's block size, and the kernel's group size
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass(slots=True)
class Codes:
    """One 4-bit matrix: codes [N, K] in 0..15, scale and zero [N, K / GROUP] (fp32)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


@dataclass(slots=True)
class Int4Weight:
    """A linear layer's weight as one or two packed 4-bit matrices whose outputs are summed."""

    parts: list[tuple[torch.Tensor, torch.Tensor]]  # (packed codes, scales_and_zeros [K/G, N_pad, 2] bf16)
    out_features: int

    @property
    def in_features(self) -> int:
        return int(self.parts[0][1].shape[0]) * GROUP


def available(dtype: torch.dtype, device: str) -> bool:
    return dtype == torch.bfloat16 and device == "cpu" and hasattr(torch, "_weight_int4pack_mm_for_cpu")


def codes_from_gguf(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> list[Codes] | None:
    """GGUF block data of an [N, K] tensor -> one (Q4_0, Q4_1) or two (Q8_0) code matrices; None
    for other types or shapes the kernel cannot take."""
    n, k = shape
    if qtype not in _BLOCK_BYTES or k % GROUP:
        return None
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // GROUP, _BLOCK_BYTES[qtype])
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if qtype == "Q8_0":
        q8 = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).astype(np.int32)) + 128  # [n, k/G, 32]
        hi, lo = (q8 >> 4).reshape(n, k), (q8 & 15).reshape(n, k)
        return [Codes(hi, 16 * d, torch.zeros_like(d)), Codes(lo, d, 8 * d)]
    off = 4 if qtype == "Q4_1" else 2
    qs = torch.from_numpy(blocks[..., off:].astype(np.int32))  # [n, k/G, 16]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k)  # low nibbles are weights 0..15 of the block
    if qtype == "Q4_1":
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        return [Codes(q, d, m + 8 * d)]
    return [Codes(q, d, torch.zeros_like(d))]


def permute_rows(codes: list[Codes], perm: torch.Tensor) -> list[Codes]:
    return [Codes(c.q[perm], c.scale[perm], c.zero[perm]) for c in codes]


def dequantize(codes: list[Codes]) -> torch.Tensor:
    """fp32 [N, K] weight the codes stand for (tests compare it with the gguf package's)."""
    out = None
    for c in codes:
        n, k = c.q.shape
        w = ((c.q.float() - 8).view(n, k // GROUP, GROUP) * c.scale.unsqueeze(-1) + c.zero.unsqueeze(-1)).view(n, k)
        out = w if out is None else out + w
    assert out is not None
    return out


def pack(pieces: list[list[Codes]]) -> Int4Weight | None:
    """Stack the row blocks of a fused weight (q, k, v or gate, up) and pack them for the kernel.
    None when the pieces do not have the same number of parts (mixed Q4 and Q8_0)."""
    num_parts = {len(p) for p in pieces}
    if len(num_parts) != 1:
        return None
    n = sum(p[0].q.shape[0] for p in pieces)
    pad = -n % 16  # the kernel packs 16 output rows at a time; padded rows are zero
    parts = []
    for i in range(num_parts.pop()):
        q = torch.cat([p[i].q for p in pieces])
        scale = torch.cat([p[i].scale for p in pieces])
        zero = torch.cat([p[i].zero for p in pieces])
        if pad:
            q = torch.cat([q, q.new_full((pad, q.shape[1]), 8)])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
        packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        parts.append((packed, sz))
    return Int4Weight(parts, n)


def int4_linear(
    x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x: [rows, K] bf16 -> [rows, out] (x's dtype unless out_dtype). Two-part (Q8_0) outputs are
    added in fp32. Each row's bits are independent of the other rows (and, as the self-test checks
    before allowing it, of the thread count: models/threads.py)."""
    x = x.contiguous()

    def call() -> list[torch.Tensor]:
        return [torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz) for packed, sz in w.parts]

    outs = KERNEL_THREADS.run("int4", (id(w), x.shape[0]), call)
    y = outs[0] if len(outs) == 1 else outs[0].float() + outs[1].float()
    if y.shape[1] != w.out_features:
        y = y[:, : w.out_features]
    if bias is not None:
        y = y + bias
    return y.to(out_dtype or x.dtype)
