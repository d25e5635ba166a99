"""Fixed-shape building blocks: the exactness rule (docs/exactness.md).

A kernel's bits may depend on the shape of its call (BLAS blocking, vectorised body vs scalar
tail, thread partitioning), in ways that change with the CPU, the BLAS build and the thread count.
So no shape-sensitive op is ever called with a shape that depends on batch composition, chunking
or the split point:
- dense matmuls and the row-local ops around them run on row tiles whose sizes come from a fixed
  `TilePlan` (the last tile zero-padded); within a fixed shape a row's bits do not depend on its
  position or its neighbours, and the start-up self-test verifies that for every tile size in use;
- attention runs over 32-key blocks aligned to absolute positions, one fixed-size query tile at
  a time, and combines per-block partials by a fixed tree, or on the native kernel (attention.c),
  row-local by construction (`attend_segments`, what both decoders' attention layers call).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from prefixserve.models.kernels import amx_tiles, native
from prefixserve.models.kernels.threads import KERNEL_THREADS
from prefixserve.models.segment import Segment

BLOCK = 32  # keys per attention block, aligned to absolute positions
ATTN_TILE_TOKENS = 16  # query tokens per attention call (the last tile padded)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TilePlan:
    """Every dense matmul (and the row-local ops around it) is called on exactly `rows` rows; the
    lm_head, which runs only on rows that need logits (usually one per session), on `head_rows`.

    One size per call site, not several: a row's bits within one call shape do not depend on its
    position or its neighbours (the self-test checks this), but across row counts they can, and
    rarely enough that a check on random data passed while real activations differed
    (docs/exactness.md)."""

    rows: int = 64
    head_rows: int = 16

    def __post_init__(self) -> None:
        if self.rows < 1 or self.head_rows < 1:
            raise ValueError(f"tile rows must be >= 1, not {self.rows} / {self.head_rows}")

    def split(self, num_rows: int) -> list[int]:
        """Tile sizes covering `num_rows` rows in order (the last one zero-padded). split(0) == []."""
        return [self.rows] * ((num_rows + self.rows - 1) // self.rows)

    @property
    def head(self) -> TilePlan:
        """The plan of the lm_head's call site."""
        return TilePlan(self.head_rows, self.head_rows)

    def __str__(self) -> str:
        return f"{self.rows} (lm_head {self.head_rows})"


def tiled(x: torch.Tensor, plan: TilePlan, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Apply the row-local `fn` to x: [num_rows, ...] one plan tile at a time (zero rows padded) and
    return the real rows. Every call of `fn` sees one of the plan's fixed shapes."""
    num_rows = x.shape[0]
    tiles = plan.split(num_rows)
    padded = sum(tiles)
    if padded > num_rows:
        x = torch.cat([x, x.new_zeros(padded - num_rows, *x.shape[1:])])
    outs = []
    offset = 0
    for t in tiles:
        outs.append(fn(x[offset : offset + t]))
        offset += t
    y = outs[0] if len(outs) == 1 else torch.cat(outs)
    return y[:num_rows]


def run_through(steps: Generator[None, None, T]) -> T:
    """The value of a computation that pauses between its steps (`Decoder.forward_layers`,
    `PieceStore.snapshot_steps`), run without pausing."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, ways: int = 1) -> torch.Tensor:
    """A dense tile's matmul: F.linear in the weight's dtype, the result in x's. A bf16 model on a CPU
    without bf16 arithmetic keeps fp32 weights (`Decoder.use_fp32_matmuls`): x is widened (exact),
    multiplied in fp32 and rounded back to bf16, always as two calls, one per half of the outputs
    (cut at `half_rows`), each on torch's one thread; `ways` > 1 runs them at once (KERNEL_THREADS.parallel).
    The calls are the same either way, so the bits are: MKL's sgemm on two threads was not thread-count
    invariant on a loaded machine (docs/architecture.md, "CPUs without bf16 arithmetic"). A weight
    packed for AMX tiles (kernels/amx_tiles.py) is multiplied there, row-local at any row count."""
    if (p := amx_tiles.packed(w)) is not None and x.dtype == w.dtype:
        return amx_tiles.linear(x, w, p, bias)
    if w.dtype == x.dtype:
        return F.linear(x, w, bias)
    xw = x.to(w.dtype)
    cut = half_rows(w.shape[0])
    parts = [(w[:cut], None if bias is None else bias[:cut]), (w[cut:], None if bias is None else bias[cut:])]
    outs: list[torch.Tensor] = [xw, xw]

    def call(i: int) -> None:
        outs[i] = F.linear(xw, *parts[i])

    if ways > 1:
        KERNEL_THREADS.parallel([lambda: call(0), lambda: call(1)])
    else:
        call(0)
        call(1)
    return torch.cat(outs, dim=-1).to(x.dtype)


def half_rows(n: int) -> int:
    """Where a widened weight's outputs are cut in two (a multiple of 16 rows: aligned halves)."""
    return max(16, n // 32 * 16) if n > 16 else n


def dense(site: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A dense tile's matmul, on the threads kernels/threads.py allows for it (same bits on any count):
    torch's threads for the call, or the two halves of a widened weight's call at once (`linear`)."""
    if w.dtype != x.dtype:
        return linear(x, w, bias, min(2, KERNEL_THREADS.parallel_ways("dense")))
    return KERNEL_THREADS.run("dense", (site, x.shape[0]), lambda: linear(x, w, bias))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Row-wise RMSNorm computed in fp32 (as the reference implementation does), result in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RopeTable:
    """cos/sin of every position, computed in fixed blocks of ROPE_BLOCK positions (fp32, then cast), so
    a position's values never depend on which other positions a call asked for."""

    ROPE_BLOCK = 1024

    def __init__(self, inv_freq: torch.Tensor, dtype: torch.dtype) -> None:
        self.inv_freq = inv_freq
        self.dtype = dtype
        self.cos32 = torch.empty(0, inv_freq.shape[0] * 2, dtype=torch.float32, device=inv_freq.device)
        self.sin32 = self.cos32
        self.cos = self.cos32.to(dtype)
        self.sin = self.cos

    def _grow(self, positions: torch.Tensor) -> None:
        need = int(positions.max()) + 1 if positions.numel() else 0
        while self.cos.shape[0] < need:
            start = self.cos.shape[0]
            pos = torch.arange(start, start + self.ROPE_BLOCK, device=self.inv_freq.device).float()
            freqs = torch.outer(pos, self.inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)
            cos, sin = emb.cos(), emb.sin()
            self.cos32 = torch.cat([self.cos32, cos])
            self.sin32 = torch.cat([self.sin32, sin])
            self.cos = torch.cat([self.cos, cos.to(self.dtype)])
            self.sin = torch.cat([self.sin, sin.to(self.dtype)])

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [n] int64 -> cos, sin: [n, 1, head_dim] (rotate-half layout)."""
        self._grow(positions)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def lookup32(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same in fp32 before rounding: [n, head_dim] each (decode.c's RoPE)."""
        self._grow(positions)
        return self.cos32[positions].contiguous(), self.sin32[positions].contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [n, heads, head_dim]; multiplies and adds only (correctly rounded, so row-local)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def block_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of `n` new query rows at absolute positions [start, start + n).

    q: [n, num_heads, head_dim] (unscaled). Computed in fp32 whatever the model dtype (bf16
    reductions and masked fills are slow on CPUs and lose precision); the result is in q's dtype.
    k_cache, v_cache: [num_kv_heads, capacity, head_dim]; keys [0, start + n) valid, the rest ZERO
    (finite), capacity a multiple of BLOCK and >= the block-rounded key length.
    Returns [n, num_heads * head_dim].

    Queries go in tiles of exactly ATTN_TILE_TOKENS tokens (the last padded with copies of its last
    real query), so every score and P·V matmul has the same row count; keys go in BLOCK-key blocks
    aligned to absolute positions; the row max is exact and per-block partials are combined by
    `fixed_tree_sum`, whose result does not change when fully-masked (all-zero) blocks are appended.
    So a row's bits depend only on its own query and keys.
    """
    n = q.shape[0]
    # keys and values in fp32 once for every tile of the call (the cast is exact, so a tile sees the
    # values it would cast itself); casting them per tile made long prompts quadratic in the cast
    keys = (start + n + BLOCK - 1) // BLOCK * BLOCK
    k32 = k_cache[:, :keys].float()
    v32 = v_cache[:, :keys].float()
    outs = []
    for t0 in range(0, n, ATTN_TILE_TOKENS):
        t1 = min(n, t0 + ATTN_TILE_TOKENS)
        outs.append(_attention_tile(q[t0:t1], k32, v32, start + t0))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attention_tile(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int) -> torch.Tensor:
    """One query tile of <= ATTN_TILE_TOKENS tokens; see block_attention. k_cache, v_cache in fp32."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    rep = num_heads // num_kv_heads
    tile = ATTN_TILE_TOKENS
    key_len = start + n
    num_blocks = (key_len + BLOCK - 1) // BLOCK
    if n < tile:  # padded queries repeat the last real one (same position, so no all-masked row)
        q = torch.cat([q, q[n - 1 :].expand(tile - n, num_heads, head_dim)])
    # q rows grouped by kv head: [kv_heads, rep * tile, head_dim], row r = (head-in-group, token)
    qg = (q.float() * head_dim**-0.5).view(tile, num_kv_heads, rep, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, rep * tile, head_dim)
    kb = k_cache[:, : num_blocks * BLOCK].view(num_kv_heads, num_blocks, BLOCK, head_dim)
    vb = v_cache[:, : num_blocks * BLOCK].view(num_kv_heads, num_blocks, BLOCK, head_dim)
    scores = torch.matmul(qg.unsqueeze(1), kb.transpose(-1, -2))  # [kv_heads, num_blocks, rep * tile, BLOCK]
    # only blocks at or after the tile's first position can hold keys in a row's future
    first = start // BLOCK
    q_pos = (torch.arange(start, start + tile, device=q.device).clamp(max=key_len - 1)).repeat(rep)
    k_pos = torch.arange(first * BLOCK, num_blocks * BLOCK, device=q.device).view(num_blocks - first, 1, BLOCK)
    future = k_pos > q_pos.view(1, rep * tile, 1)  # [num_blocks - first, rep * tile, BLOCK]
    scores[:, first:].masked_fill_(future, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).amax(dim=1, keepdim=True)
    e = torch.exp(scores - row_max)
    den = fixed_tree_sum(e.sum(dim=-1))  # [kv_heads, rep * tile]
    out = fixed_tree_sum(torch.matmul(e, vb))  # [kv_heads, rep * tile, head_dim]
    out = out / den.unsqueeze(-1)
    out = out.view(num_kv_heads, rep, tile, head_dim)[:, :, :n].permute(2, 0, 1, 3)
    return out.reshape(n, num_heads * head_dim).to(q.dtype)


def fixed_tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 1 by a pairwise tree aligned to index 0: (0+1), (2+3), ... level by level.

    Appending zero slices never changes the result (a pair with a zero partner passes its value
    through unchanged, and all-zero pairs stay zero), so a query row's sum is the same whatever
    the total key length of the call. An odd last slice is passed through as it is (the value
    adding a zero partner would give), written into the level's output rather than concatenated:
    the concatenation copied the whole tensor at every odd level (30 of 207 ms in a 23-token
    prefill at 2,000 tokens of context).
    """
    while x.shape[1] > 1:
        n = x.shape[1]
        half = n // 2
        y = x.new_empty(x.shape[0], n - half, *x.shape[2:])
        torch.add(x[:, 0 : 2 * half : 2], x[:, 1 : 2 * half : 2], out=y[:, :half])
        if n % 2:
            y[:, half] = x[:, n - 1]
        x = y
    return x[:, 0]


def batched_decode_attention(
    q: torch.Tensor, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], starts: list[int]
) -> torch.Tensor:
    """One new query row for each of S sessions, in one set of ops, with for every session the same
    matrices `block_attention` would multiply for that row alone: its query tile (the row and 15
    copies), its key blocks, zero blocks appended up to the longest session. Padded keys lie in
    every row's future (masked, exp gives 0, and P·V over zero values is 0), and `fixed_tree_sum`
    ignores zero blocks, so each row gets exactly `block_attention`'s bits.

    q: [S, num_heads, head_dim]; k_caches[i], v_caches[i]: [num_kv_heads, capacity_i, head_dim] with
    keys [0, starts[i] + 1) valid and zeros after. Returns [S, num_heads * head_dim].
    """
    num_sessions, num_heads, head_dim = q.shape
    num_kv_heads = k_caches[0].shape[0]
    rep = num_heads // num_kv_heads
    tile = ATTN_TILE_TOKENS
    num_blocks = max((s + 1 + BLOCK - 1) // BLOCK for s in starts)
    keys = num_blocks * BLOCK
    kb = q.new_zeros(num_sessions, num_kv_heads, keys, head_dim, dtype=torch.float32)
    vb = q.new_zeros(num_sessions, num_kv_heads, keys, head_dim, dtype=torch.float32)
    for i, (k, v, s) in enumerate(zip(k_caches, v_caches, starts)):
        own = (s + 1 + BLOCK - 1) // BLOCK * BLOCK
        kb[i, :, :own] = k[:, :own]
        vb[i, :, :own] = v[:, :own]
    kb = kb.view(num_sessions, num_kv_heads, num_blocks, BLOCK, head_dim)
    vb = vb.view(num_sessions, num_kv_heads, num_blocks, BLOCK, head_dim)
    qg = (q.float() * head_dim**-0.5).view(num_sessions, num_kv_heads, rep, 1, head_dim)
    qg = qg.expand(num_sessions, num_kv_heads, rep, tile, head_dim).reshape(num_sessions, num_kv_heads, rep * tile, head_dim)
    scores = torch.matmul(qg.unsqueeze(2), kb.transpose(-1, -2))  # [S, kv_heads, num_blocks, rep * tile, BLOCK]
    q_pos = torch.tensor(starts, device=q.device).view(num_sessions, 1, 1, 1, 1)
    k_pos = torch.arange(keys, device=q.device).view(1, 1, num_blocks, 1, BLOCK)
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).amax(dim=2, keepdim=True)
    e = torch.exp(scores - row_max)
    flat = num_sessions * num_kv_heads
    den = fixed_tree_sum(e.sum(dim=-1).view(flat, num_blocks, rep * tile))  # [S * kv_heads, rows]
    out = fixed_tree_sum(torch.matmul(e, vb).view(flat, num_blocks, rep * tile, head_dim))
    out = (out / den.unsqueeze(-1)).view(num_sessions, num_kv_heads, rep, tile, head_dim)[:, :, :, 0]
    return out.reshape(num_sessions, num_heads * head_dim).to(q.dtype)


def attend_segments(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[Segment],
                    total: int, native_attention: bool, skip: int = 0) -> torch.Tensor:
    """Write new K/V into each segment's KV of `layer`, then attend. Returns [total, q_size]; padding
    rows zero. The first `skip` segments (a Llama decoder's 4-bit decode rows, models/llama/int4_rows.py)
    are left alone.

    With the native kernel (`native_attention`) every segment is one call (a row's bits depend on its
    own query and keys only, attention.c). Otherwise single-token segments attend together
    (`batched_decode_attention`), longer ones one by one (`block_attention`). Either way a dense
    decode row gets exactly what a one-token prefill would, and decode states equal prefill
    states by construction."""
    out = q.new_zeros(total, q.shape[1] * q.shape[2])
    singles: list[tuple[int, Segment]] = []
    offset = sum(s.num_new for s in segments[:skip])
    for s in segments[skip:]:
        end = offset + s.num_new
        kv = s.kv[layer]  # [2, kv_heads, capacity, head_dim]
        kv[0, :, s.start : s.start + s.num_new] = k[offset:end].transpose(0, 1)
        kv[1, :, s.start : s.start + s.num_new] = v[offset:end].transpose(0, 1)
        if native_attention:
            out[offset:end] = native.attention(q[offset:end], kv[0], kv[1], s.start,
                                               KERNEL_THREADS.parallel_ways("attention"), KERNEL_THREADS.parallel)
        elif s.num_new == 1:
            singles.append((offset, s))
        else:
            out[offset:end] = block_attention(q[offset:end], kv[0], kv[1], s.start)
        offset = end
    if singles:
        rows = torch.tensor([o for o, _ in singles])
        out[rows] = batched_decode_attention(
            q[rows], [s.kv[layer, 0] for _, s in singles], [s.kv[layer, 1] for _, s in singles],
            [s.start for _, s in singles],
        )
    return out
