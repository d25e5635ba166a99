"""Gated DeltaNet's token mixer at fixed shapes: the short causal conv and the gated delta rule.

The exactness rule (docs/exactness.md, docs/hybrid.md) for recurrent layers:
- The sequence is cut into cells of CELL positions aligned to absolute positions. The delta
  state `S` [v_heads, k_dim, v_dim] (fp32) is kept at the start of the current cell; the inputs of
  the cell's tokens seen so far (post-conv q/k/v, decay g, beta) are kept beside it.
- Every evaluation of the rule is one `delta_cell` call over one whole cell, real rows first and
  zero rows after: always the same shapes. Within that shape a row's output depends only on the
  rows before it (every op is causal: masked products are exact zeros, the triangular solve and
  the cumulative sum read earlier rows only), so a row gets the same bits whether the rows after
  it are real tokens or padding. Hence computing tokens [p, e) of a cell later (a resumed
  snapshot, a decode step) gives exactly the bits a one-pass prefill gives; the state at the next
  cell start is taken only from a call with all CELL rows real.
- The conv and the elementwise gating run on plan-sized row tiles, like every row-local op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CELL = 16  # positions per delta-rule cell, aligned to absolute positions (docs/hybrid.md: why 16)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Row-wise x / sqrt(sum(x^2) + eps) over the last dim, as the reference computes it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def conv_silu(windows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """windows: [rows, K, channels] (the K inputs ending at each row, oldest first); weight: [channels, K]
    fp32. Returns silu(sum_j windows[:, j] * weight[:, j]) in fp32, accumulated in the fixed order j =
    0..K-1, elementwise only (row-local)."""
    acc = windows[:, 0].float() * weight[:, 0]
    for j in range(1, windows.shape[1]):
        acc = acc + windows[:, j].float() * weight[:, j]
    return F.silu(acc)


def delta_cell(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one cell, chunked form (one chunk = the cell).

    state: [H, dk, dv] fp32, the delta state before the cell's first row.
    q, k: [H, CELL, dk] fp32, L2-normalised (q also scaled by dk^-0.5); v: [H, CELL, dv] fp32;
    g: [H, CELL] log decay (<= 0); beta: [H, CELL]. Rows past the real ones are all zero.
    Returns (out [H, CELL, dv], state after all CELL rows). The returned state is the true state
    at the cell's end only when every row is real (zero rows keep it, but the caller must not use
    a padded call's state: see the module docstring).

    Math: with c = cumsum(g), D[i, j] = exp(c_i - c_j) for j <= i (0 above), the within-cell
    system (I + strict_lower(beta k k^T * D)) U = [beta v | beta k exp(c)] gives the corrected
    values U_v and decayed keys U_k; v' = U_v - U_k S; out = (q exp(c)) S + ((q k^T) * D) v';
    S' = exp(c_last) S + (k exp(c_last - c))^T v'.
    """
    cell = q.shape[1]
    c = g.cumsum(dim=1)  # [H, C]
    upper = torch.ones(cell, cell, dtype=torch.bool, device=q.device).triu(1)
    decay = (c.unsqueeze(2) - c.unsqueeze(1)).masked_fill(upper, float("-inf")).exp()  # [H, C, C]
    kb = k * beta.unsqueeze(-1)
    vb = v * beta.unsqueeze(-1)
    system = (kb @ k.transpose(-1, -2)) * decay
    ec = c.exp().unsqueeze(-1)  # [H, C, 1]
    u_v = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    u_k = torch.linalg.solve_triangular(system, kb * ec, upper=False, unitriangular=True)
    v_new = u_v - u_k @ state
    inner = (q @ k.transpose(-1, -2)) * decay
    out = (q * ec) @ state + inner @ v_new
    last = c[:, -1:]  # [H, 1]
    k_to_end = k * (last - c).exp().unsqueeze(-1)
    new_state = state * last.exp().unsqueeze(-1) + k_to_end.transpose(-1, -2) @ v_new
    return out, new_state
