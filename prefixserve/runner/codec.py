"""A cached state as bytes, for the lower cache tiers (prefixserve/cache/disk.py): the raw bits of
each KV piece and of the logits, with the shapes and dtype in `meta`. Decoding copies nothing:
the tensors view the loaded buffer. Never pickles."""

from __future__ import annotations

from typing import Any

import torch

from prefixserve.runner.state import KVPiece, KVSnapshot

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


class SnapshotCodec:
    """Implements cache.tier.Codec for KVSnapshot."""

    def encode(self, state: KVSnapshot) -> tuple[dict[str, Any], bytes]:
        """(meta, payload). Runs on the tier's writer thread: reads the immutable pieces only."""
        kv0 = state.pieces[0].kv
        meta = {
            "dtype": str(kv0.dtype),
            "shape": [kv0.shape[0], kv0.shape[1], kv0.shape[2], kv0.shape[4]],  # layers, 2, kv heads, head dim
            "pieces": [[p.start, p.end] for p in state.pieces],
            "logits": 0 if state.logits is None else int(state.logits.numel()),
        }
        parts = [_raw(p.kv) for p in state.pieces]
        if state.logits is not None:
            parts.append(_raw(state.logits.float()))
        return meta, b"".join(parts)

    def decode(self, meta: dict[str, Any], payload: memoryview, num_tokens: int) -> KVSnapshot:
        """The snapshot back, its pieces private (the engine shares them again when it re-inserts).
        Raises ValueError when meta and payload disagree."""
        dtype = _DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ValueError(f"unknown dtype {meta['dtype']!r}")
        layers, two, heads, head_dim = (int(x) for x in meta["shape"])
        size = torch.empty((), dtype=dtype).element_size()
        buf: bytearray | memoryview = payload
        if payload.readonly or torch.frombuffer(payload, dtype=torch.uint8, count=1).data_ptr() % 64:
            buf = bytearray(payload)  # torch.frombuffer wants writable, and the kernels aligned, memory
        offset = 0
        pieces = []
        for start, end in meta["pieces"]:
            n = layers * two * heads * (end - start) * head_dim
            kv = torch.frombuffer(buf, dtype=dtype, count=n, offset=offset) if n else torch.empty(0, dtype=dtype)
            pieces.append(KVPiece(start, end, ("loaded", id(buf), start), kv.view(layers, two, heads, end - start, head_dim)))
            offset += n * size
        logits = None
        if meta["logits"]:
            logits = torch.frombuffer(buf, dtype=torch.float32, count=int(meta["logits"]), offset=offset)
            offset += 4 * int(meta["logits"])
        if offset != memoryview(buf).nbytes or not pieces or pieces[-1].end != num_tokens:
            raise ValueError("payload does not match its meta")
        return KVSnapshot.from_pieces(pieces, logits)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()
