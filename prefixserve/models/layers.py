"""Batch-invariant building blocks (DESIGN.md §3).

Every function here gives each row the same bits whatever else is in the batch and however the
work was split: matmuls run on at least `min_rows` rows (zero rows appended, result sliced), and
attention runs over key blocks of `BLOCK` keys aligned to absolute positions, summed in a fixed
sequential order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 32  # keys per attention block, aligned to absolute positions
DEFAULT_MIN_ROWS = 16  # matmul rows at and above which MKL/oneDNN rows are bit-invariant here


def inv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int) -> torch.Tensor:
    """x: [num_rows, in] -> [num_rows, out]; rows padded to `min_rows` so every row's bits are invariant."""
    num_rows = x.shape[0]
    if num_rows < min_rows:
        x = torch.cat([x, x.new_zeros(min_rows - num_rows, x.shape[1])])
        return F.linear(x, weight, bias)[:num_rows]
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Row-wise RMSNorm computed in fp32 (as the reference implementation does), result in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [n] int64 -> cos, sin: [n, 1, head_dim] (rotate-half layout), computed in fp32."""
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [n, heads, head_dim]; elementwise per position, so trivially invariant."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def block_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, min_rows: int
) -> torch.Tensor:
    """Causal attention of `n` new query rows at absolute positions [start, start + n).

    q: [n, num_heads, head_dim] (unscaled). Computed in fp32 whatever the model dtype (bf16
    reductions and masked fills are slow on CPUs and lose precision); the result is in q's dtype.
    k_cache, v_cache: [num_kv_heads, capacity, head_dim]; keys [0, start + n) valid, the rest ZERO
    (finite), capacity a multiple of BLOCK and >= the block-rounded key length.
    Returns [n, num_heads * head_dim].

    Bits of a row depend only on its own query and keys: scores and P·V are matmuls over exactly
    BLOCK keys with >= min_rows rows, the row max is exact, exp and the division are elementwise,
    and the per-block partials are combined by `fixed_tree_sum`, whose result does not change when
    fully-masked (all-zero) blocks are appended.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    rep = num_heads // num_kv_heads
    key_len = start + n
    num_blocks = (key_len + BLOCK - 1) // BLOCK
    # q rows grouped by kv head: [kv_heads, rep * n, head_dim], row r = (head-in-group, token)
    out_dtype = q.dtype
    qg = (q.float() * head_dim**-0.5).view(n, num_kv_heads, rep, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, rep * n, head_dim)
    num_rows = rep * n
    if num_rows < min_rows:
        qg = torch.cat([qg, qg.new_zeros(num_kv_heads, min_rows - num_rows, head_dim)], dim=1)
    padded_rows = qg.shape[1]
    kb = k_cache[:, : num_blocks * BLOCK].float().view(num_kv_heads, num_blocks, BLOCK, head_dim)
    vb = v_cache[:, : num_blocks * BLOCK].float().view(num_kv_heads, num_blocks, BLOCK, head_dim)
    scores = torch.matmul(qg.unsqueeze(1), kb.transpose(-1, -2))  # [kv_heads, num_blocks, padded_rows, BLOCK]
    # only blocks at or after the first new position can hold keys in a row's future
    first = start // BLOCK
    q_pos = torch.arange(start, key_len).repeat(rep)
    if padded_rows > num_rows:
        q_pos = torch.cat([q_pos, q_pos.new_full((padded_rows - num_rows,), key_len - 1)])
    k_pos = torch.arange(first * BLOCK, num_blocks * BLOCK).view(num_blocks - first, 1, BLOCK)
    future = k_pos > q_pos.view(1, padded_rows, 1)  # [num_blocks - first, padded_rows, BLOCK]
    scores[:, first:].masked_fill_(future, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).amax(dim=1, keepdim=True)
    e = torch.exp(scores - row_max)
    den = fixed_tree_sum(e.sum(dim=-1))  # [kv_heads, padded_rows]
    out = fixed_tree_sum(torch.matmul(e, vb))  # [kv_heads, padded_rows, head_dim]
    out = out / den.unsqueeze(-1)
    out = out[:, :num_rows].view(num_kv_heads, rep, n, head_dim).permute(2, 0, 1, 3)
    return out.reshape(n, num_heads * head_dim).to(out_dtype)


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
    q: torch.Tensor, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], starts: list[int], min_rows: int
) -> torch.Tensor:
    """Attention of one new query row for each of S sessions, in one set of ops.

    q: [S, num_heads, head_dim]; k_caches[i], v_caches[i]: [num_kv_heads, capacity_i, head_dim] with
    keys [0, starts[i] + 1) valid and zeros after. Returns [S, num_heads * head_dim].

    Sessions are padded with zero blocks to the longest one; padded keys lie in every row's
    future, so they are masked, and `fixed_tree_sum` ignores the zero blocks. Each row therefore
    gets exactly the bits `block_attention` would give it alone.
    """
    num_sessions, num_heads, head_dim = q.shape
    num_kv_heads = k_caches[0].shape[0]
    rep = num_heads // num_kv_heads
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
    qg = (q.float() * head_dim**-0.5).view(num_sessions, num_kv_heads, rep, head_dim)
    rows = max(rep, min_rows)
    if rows > rep:
        qg = torch.cat([qg, qg.new_zeros(num_sessions, num_kv_heads, rows - rep, head_dim)], dim=2)
    scores = torch.matmul(qg.unsqueeze(2), kb.transpose(-1, -2))  # [S, kv_heads, num_blocks, rows, BLOCK]
    q_pos = torch.tensor(starts).view(num_sessions, 1, 1, 1, 1)
    k_pos = torch.arange(keys).view(1, 1, num_blocks, 1, BLOCK)
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).amax(dim=2, keepdim=True)
    e = torch.exp(scores - row_max)
    flat = num_sessions * num_kv_heads
    den = fixed_tree_sum(e.sum(dim=-1).view(flat, num_blocks, rows))  # [S * kv_heads, rows]
    out = fixed_tree_sum(torch.matmul(e, vb).view(flat, num_blocks, rows, head_dim))
    out = (out / den.unsqueeze(-1)).view(num_sessions, num_kv_heads, rows, head_dim)[:, :, :rep]
    return out.reshape(num_sessions, num_heads * head_dim).to(q.dtype)


def single_query_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length: int) -> torch.Tensor:
    """Attention of one query row over keys [0, length) of one session, in fp32, plain softmax.

    q: [num_heads, head_dim]; k_cache, v_cache: [num_kv_heads, capacity, head_dim]. Returns
    [1, num_heads * head_dim] in q's dtype. Its bits depend only on this session (one call per
    session, shapes set by `length`), so it is batch-invariant, but they differ from
    `block_attention`'s: only for rows whose KV is never cached (4-bit decode, models/quant.py).
    """
    num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    qg = q.float().view(num_kv_heads, num_heads // num_kv_heads, head_dim) * head_dim**-0.5
    scores = torch.bmm(qg, k_cache[:, :length].float().transpose(1, 2))
    out = torch.bmm(torch.softmax(scores, dim=-1), v_cache[:, :length].float())
    return out.view(1, num_heads * head_dim).to(q.dtype)
