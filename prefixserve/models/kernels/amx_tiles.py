"""A bf16 model's dense matmuls on AMX tiles (amx.c), on Intel Xeons with AMX-BF16.

torch's bf16 matmul (oneDNN) uses the same tiles, but each call takes the weight as it is and picks
its blocking by the call's shape: at the 64-row tiles it ran at half this kernel's rate
(docs/architecture.md, "AMX"). Here each weight is
packed once at load (`native.amx_pack`, kept beside the bf16 weight as the attribute `amx_packed`)
and `layers.linear` (models/layers.py) multiplies it with amx.c, whose rows are row-local by construction: a row's
bits are those of its own products in one fixed order, whatever the call's row count, the other
rows or the threads (docs/exactness.md). Another kernel than torch's, so other bits: the decoder's
kernel fingerprint says "mm=amx" and the disk and Redis tiers keep the two apart.

PREFIXSERVE_DENSE_MATMUL=bf16 keeps torch's matmul; auto takes the tiles where `native.amx_ready`.
"""

from __future__ import annotations

import torch

from prefixserve.models.kernels import native

ATTR = "amx_packed"


def packable(w: torch.Tensor) -> bool:
    return w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2 and w.shape[0] % 16 == 0 \
        and w.shape[1] % 32 == 0


def pack(w: torch.Tensor) -> bool:
    """Give the weight its tile-layout copy (once); False where its shape has none (torch multiplies it)."""
    if getattr(w, ATTR, None) is not None:
        return True
    if not packable(w):
        return False
    setattr(w, ATTR, native.amx_pack(w))
    return True


def packed(w: torch.Tensor) -> torch.Tensor | None:
    return getattr(w, ATTR, None)


def linear(x: torch.Tensor, w: torch.Tensor, p: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bf16(x @ w.T + bias) on amx.c's tiles, on torch's current thread count (kernels/threads.py sets
    it for the calls it allows more threads): x [..., K] bf16."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = native.amx_linear(rows, p, None if bias is None else bias.float().contiguous(), torch.get_num_threads())
    return y.view(*x.shape[:-1], w.shape[0])



def unpack(w: torch.Tensor) -> None:
    """Drop the weight's tile-layout copy (torch multiplies it again)."""
    if packed(w) is not None:
        setattr(w, ATTR, None)
