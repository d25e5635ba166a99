"""A cached state as bytes, for the lower cache tiers (prefixserve/cache/disk.py, cache/shared.py):
the raw bits of each KV piece and of the logits, with the shapes and dtype in `meta`; a hybrid
snapshot (runner/hybrid_state.py) adds its recurrent state and checkpoints after them. KV decoding
copies nothing on the CPU: the tensors view the loaded buffer (on a GPU they are copied to the model's
device, where the session states live). Never pickles. See docs/cache.md, docs/hybrid.md."""

from __future__ import annotations

from typing import Any

import torch

from prefixserve.models.hybrid.decoder import RecurrentState
from prefixserve.runner.hybrid_state import HybridSnapshot
from prefixserve.runner.state import KVPiece, KVSnapshot

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}
HYBRID = "hybrid"  # meta["kind"] of a hybrid snapshot; a KV snapshot's meta has no "kind"


class SnapshotCodec:
    """Implements cache.tier.Codec for KVSnapshot and HybridSnapshot. `device`: the model's, where
    decoded KV pieces and recurrent states go (logits stay on the CPU, as the runner keeps them)."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)

    def encode(self, state: KVSnapshot | HybridSnapshot) -> tuple[dict[str, Any], bytes]:
        """(meta, payload). Runs on the tier's writer thread: reads the immutable pieces only."""
        if isinstance(state, HybridSnapshot):
            meta, payload = self.encode(state.kv)
            recs = [state.recurrent, *state.checkpoints.values()]
            tensors = [t for r in recs for t in (r.conv, r.cell, r.delta)]
            meta.update(kind=HYBRID, points=list(state.checkpoints),
                        tensors=[[str(t.dtype), list(t.shape)] for t in tensors])
            return meta, payload + b"".join(_raw(t) for t in tensors)
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

    def decode(self, meta: dict[str, Any], payload: memoryview, num_tokens: int) -> KVSnapshot | HybridSnapshot:
        """The snapshot back, its pieces private (the engine shares them again when it re-inserts).
        Raises ValueError when meta and payload disagree."""
        kind = meta.get("kind")
        if kind not in (None, HYBRID):
            raise ValueError(f"unknown snapshot kind {kind!r}")
        buf: bytearray | memoryview = payload
        if payload.readonly or torch.frombuffer(payload, dtype=torch.uint8, count=1).data_ptr() % 64:
            buf = bytearray(payload)  # torch.frombuffer wants writable, and the kernels aligned, memory
        kvs, offset = _decode_kv(meta, buf, self.device)
        if kvs.num_tokens != num_tokens:
            raise ValueError("payload does not match its meta")
        if kind is None:
            if offset != memoryview(buf).nbytes:
                raise ValueError("payload does not match its meta")
            return kvs
        tensors = []
        for dtype_name, shape in meta["tensors"]:
            t, offset = _tensor(buf, offset, dtype_name, shape)
            # own memory: the storage keys (cache budget) and the buffer's life
            tensors.append(t.clone() if self.device.type == "cpu" else t.to(self.device))
        points = [int(p) for p in meta["points"]]
        if offset != memoryview(buf).nbytes or len(tensors) != 3 * (1 + len(points)):
            raise ValueError("payload does not match its meta")
        if points != sorted(set(points)) or (points and (points[0] <= 0 or points[-1] >= num_tokens)):
            raise ValueError(f"checkpoint positions {points} out of order or range")
        recs = [RecurrentState(*tensors[i : i + 3]) for i in range(0, len(tensors), 3)]
        return HybridSnapshot.from_kv(kvs, recs[0], dict(zip(points, recs[1:], strict=True)))


def _decode_kv(meta: dict[str, Any], buf: bytearray | memoryview, device: torch.device) -> tuple[KVSnapshot, int]:
    """The KV snapshot at the start of `buf` and the offset after it (its logits included)."""
    dtype = _DTYPES.get(meta["dtype"])
    if dtype is None:
        raise ValueError(f"unknown dtype {meta['dtype']!r}")
    layers, two, heads, head_dim = (int(x) for x in meta["shape"])
    size = torch.empty((), dtype=dtype).element_size()
    offset = 0
    pieces = []
    for start, end in meta["pieces"]:
        n = layers * two * heads * (end - start) * head_dim
        kv = torch.frombuffer(buf, dtype=dtype, count=n, offset=offset) if n else torch.empty(0, dtype=dtype)
        kv = kv.view(layers, two, heads, end - start, head_dim)
        if device.type != "cpu":
            kv = kv.to(device)
        pieces.append(KVPiece(start, end, ("loaded", id(buf), start), kv))
        offset += n * size
    logits = None
    if meta["logits"]:
        logits = torch.frombuffer(buf, dtype=torch.float32, count=int(meta["logits"]), offset=offset)
        offset += 4 * int(meta["logits"])
    if not pieces or offset > memoryview(buf).nbytes:
        raise ValueError("payload does not match its meta")
    return KVSnapshot.from_pieces(pieces, logits), offset


def _tensor(buf: bytearray | memoryview, offset: int, dtype_name: str, shape: list[int]) -> tuple[torch.Tensor, int]:
    dtype = _DTYPES.get(dtype_name)
    if dtype is None:
        raise ValueError(f"unknown dtype {dtype_name!r}")
    n = 1
    for d in shape:
        n *= int(d)
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if n < 0 or offset + nbytes > memoryview(buf).nbytes:
        raise ValueError("payload does not match its meta")
    t = torch.frombuffer(buf, dtype=dtype, count=n, offset=offset) if n else torch.empty(0, dtype=dtype)
    return t.view(*(int(d) for d in shape)), offset + nbytes


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()
