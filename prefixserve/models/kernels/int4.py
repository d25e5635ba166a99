"""4-bit weights for decode rows: GGUF Q4_0 / Q4_1 / Q8_0 codes run by torch's int4 CPU kernel.

Decode is memory-bound: a bf16 step streams 270 MB of SmolLM2 weights and pads every matmul to
16 rows for invariance. torch's `_weight_int4pack_mm_for_cpu` reads the GGUF codes directly (a
quarter of the bytes) and its per-output reduction over K is a fixed loop, so a row's bits do not
depend on how many rows share the call (checked for 1..64 rows, every offset, in tests/runner).
Its arithmetic differs from the dense bf16 matmul, so a token decoded this way has other bits
than the same token prefilled; the engine therefore never offers decode-produced KV to the cache
(see `Decoder.decode_matches_prefill`). Prefill stays split-invariant: dense tiles, or, on CPUs
without bf16 arithmetic, qmatmul.c on these packs (`Decoder.prefill_q4`, row-local by construction).

Layout of the kernel's dequantisation: w = (code - 8) * scale + zero, per group of 32 along K.
- Q4_1 (d, m, 4-bit q): w = d*q + m  ->  scale = d, zero = m + 8d
- Q4_0 (d, 4-bit q):    w = d*(q-8)  ->  scale = d, zero = 0
- Q8_0 (d, int8 q):     w = d*q = d*(16h + l - 128) with h, l the nibbles of q + 128, run as two
  4-bit matrices: (h - 8) * 16d  +  ((l - 8) * d + 8d); their outputs are added.
Scales and zeros are rounded to bf16 (the kernel's requirement), like the dense bf16 weights.

Where the native kernels build (models/kernels/native.py), the weights are packed for qmatmul.c instead:
the GGUF codes as they are (Q4: nibbles with fp32 scale and bias per group, w = scale * code + bias;
Q8_0: one int8 matrix with its fp32 scales, one pass instead of two 4-bit ones), interleaved by
blocks of 4 outputs so that a block streams from one place. Each output is one fixed loop in fp32
(qmatmul.c), its threads split the outputs: a row's bits depend on nothing but the row. On the
Ice Lake machine a decode step's 30 layers of 4-bit matmuls took ~9 ms on one thread (~5.5 on two)
against torch's kernel's ~18 on one; it is the only one the one-call decode step (decode.c) uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from prefixserve.models.kernels import native
from prefixserve.models.kernels.threads import KERNEL_THREADS

GROUP = 32  # GGUF's block size, and the kernel's group size
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass(slots=True)
class Codes:
    """One 4-bit matrix: codes [N, K] in 0..15 (any integer dtype; uint8 from a GGUF file), scale and
    zero [N, K / GROUP] (fp32)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


@dataclass(slots=True)
class Int4Weight:
    """A linear layer's weight: one or two packed 4-bit matrices for torch's kernel whose outputs are
    summed, or (`native`) one matrix in qmatmul.c's layout."""

    parts: list[tuple[torch.Tensor, torch.Tensor]]  # (packed codes, scales_and_zeros [K/G, N_pad, 2] bf16)
    out_features: int
    native: torch.Tensor | None = None  # uint8 [N_pad / 4, K / GROUP, 96 (Q4) or 144 (Q8)]; parts then empty
    native_kind: int = 0  # 0: Q4, 1: Q8

    @property
    def in_features(self) -> int:
        if self.native is not None:
            return int(self.native.shape[1]) * GROUP
        return int(self.parts[0][1].shape[0]) * GROUP

    @property
    def rows(self) -> int:
        """Output rows qmatmul.c computes (out_features padded to 16); out_features for torch's packs."""
        return int(self.native.shape[0]) * 4 if self.native is not None else self.out_features


def native_available(dtype: torch.dtype, device: str) -> bool:
    """Whether 4-bit weights are packed for qmatmul.c (PREFIXSERVE_NATIVE=0 or no compiler: torch's kernel);
    while a first start's build is in flight, whether they are expected to build (`native.expected`)."""
    return dtype == torch.bfloat16 and device == "cpu" and native.expected()


def available(dtype: torch.dtype, device: str) -> bool:
    return dtype == torch.bfloat16 and device == "cpu" and hasattr(torch, "_weight_int4pack_mm_for_cpu")


def codes_from_gguf(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> list[Codes] | None:
    """GGUF block data of an [N, K] tensor -> one (Q4_0, Q4_1) or two (Q8_0) code matrices; None
    for other types or shapes the kernel cannot take."""
    n, k = shape
    if qtype not in _BLOCK_BYTES or k % GROUP:
        return None
    # codes as uint8 (0..15; a Q8_0 value + 128 before its split): a model's codes were int32, and the
    # tied 49k x 576 head's Q8_0 split alone then touched ~0.5 GB of new memory at a first start
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // GROUP, _BLOCK_BYTES[qtype])
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if qtype == "Q8_0":
        q8 = torch.from_numpy(blocks[..., 2:] ^ np.uint8(0x80))  # int8 v as the byte v + 128, [n, k/G, 32]
        hi, lo = (q8 >> 4).reshape(n, k), (q8 & 15).reshape(n, k)
        return [Codes(hi, 16 * d, torch.zeros_like(d)), Codes(lo, d, 8 * d)]
    off = 4 if qtype == "Q4_1" else 2
    qs = torch.from_numpy(blocks[..., off:].copy())  # [n, k/G, 16] bytes, two codes each
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


def pack(pieces: list[list[Codes]], native_layout: bool = False) -> Int4Weight | None:
    """Stack the row blocks of a fused weight (q, k, v or gate, up) and pack them for torch's kernel,
    or for qmatmul.c (`native_layout`). None when the pieces do not have the same number of parts
    (mixed Q4 and Q8_0)."""
    num_parts = {len(p) for p in pieces}
    if len(num_parts) != 1:
        return None
    if native_layout:
        return _pack_native(pieces)
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


def _pack_native(pieces: list[list[Codes]]) -> Int4Weight:
    """qmatmul.c's layout of the stacked pieces (see its header), outputs padded to 16 with zeros."""
    n = sum(p[0].q.shape[0] for p in pieces)
    pad = -n % 16
    k = pieces[0][0].q.shape[1]
    g = k // GROUP
    if len(pieces[0]) == 2:  # Q8_0 as codes_from_gguf split it: q = 16 hi + lo - 128, scale d (the low part's)
        q = torch.cat([16 * p[0].q.to(torch.int16) + p[1].q - 128 for p in pieces]).to(torch.int8)
        scale = torch.cat([p[1].scale for p in pieces])
        q = torch.cat([q, q.new_zeros(pad, k)]).view(torch.uint8).view(-1, 4, g, GROUP)
        codes = q.permute(0, 2, 1, 3).reshape(-1, g, 4 * GROUP)
        extras = [scale]
        kind = 1
    else:
        c = torch.cat([p[0].q for p in pieces]).view(n, g, 2, GROUP // 2)
        nibbles = (c[:, :, 0] | (c[:, :, 1] << 4)).to(torch.uint8)  # byte j: code j low, code j + 16 high
        scale = torch.cat([p[0].scale for p in pieces])
        bias = torch.cat([p[0].zero for p in pieces]) - 8 * scale  # w = scale * (code - 8) + zero
        nibbles = torch.cat([nibbles, nibbles.new_zeros(pad, g, GROUP // 2)]).view(-1, 4, g, GROUP // 2)
        codes = nibbles.permute(0, 2, 1, 3).reshape(-1, g, 2 * GROUP)
        extras = [scale, bias]
        kind = 0
    blocks = [codes]
    for e in extras:
        e = torch.cat([e.float(), e.new_zeros(pad, g).float()]).view(-1, 4, g).permute(0, 2, 1).contiguous()
        blocks.append(e.view(torch.uint8).view(-1, g, 16))
    return Int4Weight([], n, torch.cat(blocks, dim=-1).contiguous(), kind)


def int4_linear(
    x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
    ways: int | None = None,
) -> torch.Tensor:
    """x: [rows, K] bf16 -> [rows, out] (x's dtype unless out_dtype). Two-part (Q8_0) outputs are
    added in fp32. Each row's bits are independent of the other rows (and, as the self-test checks
    before allowing it, of the thread count: models/kernels/threads.py). `ways`: the native kernel's thread
    count (default: what KERNEL_THREADS allows "int4" calls)."""
    if w.native is not None:
        xf = x.float().contiguous()
        out = torch.empty(x.shape[0], w.rows)
        packed = w.native
        KERNEL_THREADS.team("int4", (id(w), x.shape[0]), lambda t: native.qmatmul(xf, packed, w.native_kind, out, t),
                            ways)
        y = out[:, : w.out_features]
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype or x.dtype)
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
