"""The disk tier's file format (docs/cache.md): pure functions, no IO beyond the file handed in.

    offset 0        MAGIC (8 bytes)
    8               header length H (u32, little endian)
    12              header: UTF-8 JSON object (format, runtime, fingerprint, digests, token ids,
                    has_logits, the codec's meta, payload_len, truncatable and resume points;
                    the last two may be absent: a truncatable KV state)
    12 + H          payload (payload_len bytes, the codec's); H is padded with blanks so that 12 + H
                    is a multiple of 64
    end - 32        BLAKE2b-256 of every byte before it

A file is whole or it is rejected: a torn, truncated or bit-flipped file fails the size or the
digest check (`read_file` raises CorruptFile); `read_header` checks only what the start-up scan
needs (magic, sizes, JSON) and leaves the digest to the load.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

MAGIC = b"PSKV\x00\x01\r\n"
FORMAT = 1
DIGEST_BYTES = 32
MAX_HEADER_BYTES = 64 << 20


class CorruptFile(ValueError):
    """The file is not a whole, intact cache file."""


@dataclass(frozen=True, slots=True)
class FileHeader:
    runtime: str  # prefixserve's version
    fingerprint: str  # model identity + the runtime's identity (engine.tier_fingerprint)
    model_digest: str  # the three keyed digests of the namespace (cache/tier.py, TierKeys)
    tenant_digest: str
    salt_digest: str
    token_ids: tuple[int, ...]
    has_logits: bool
    meta: dict[str, Any]  # the codec's: shapes, dtype
    payload_len: int
    truncatable: bool = True  # False: a snapshot-only (hybrid) state, serving only its length and `points`
    points: tuple[int, ...] = ()  # its resume points (CachedState.resume_points); () when truncatable


def encode_file(header: FileHeader, payload: bytes) -> bytes:
    """The whole file's bytes. Pure."""
    assert header.payload_len == len(payload)
    fields: dict[str, Any] = {
        "format": FORMAT, "runtime": header.runtime, "fingerprint": header.fingerprint,
        "model": header.model_digest, "tenant": header.tenant_digest, "salt": header.salt_digest,
        "token_ids": list(header.token_ids), "has_logits": header.has_logits, "meta": header.meta,
        "payload_len": header.payload_len,
    }
    if not header.truncatable:  # a KV state's header stays as it was
        fields.update(truncatable=False, points=list(header.points))
    head = json.dumps(fields, separators=(",", ":")).encode("utf-8")
    head += b" " * (-(12 + len(head)) % 64)  # JSON allows trailing blanks: the payload starts 64-aligned
    body = MAGIC + struct.pack("<I", len(head)) + head + payload
    return body + hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest()


def read_header(f: BinaryIO, file_size: int) -> FileHeader:
    """The header of an open file, checking magic, sizes and JSON (not the digest). Raises CorruptFile."""
    start = f.read(12)
    if len(start) < 12 or start[:8] != MAGIC:
        raise CorruptFile("bad magic or truncated")
    (head_len,) = struct.unpack("<I", start[8:])
    if head_len > MAX_HEADER_BYTES or 12 + head_len + DIGEST_BYTES > file_size:
        raise CorruptFile("header length out of range")
    header = _parse_header(f.read(head_len))
    if 12 + head_len + header.payload_len + DIGEST_BYTES != file_size:
        raise CorruptFile(f"file is {file_size} bytes, the header promises another size")
    return header


def read_file(data: bytes | bytearray | memoryview) -> tuple[FileHeader, memoryview]:
    """Header and payload of a whole file's bytes, digest checked; the payload is a view of `data`
    (no copy; writable when `data` is a bytearray). Raises CorruptFile."""
    if len(data) < 12 + DIGEST_BYTES:
        raise CorruptFile("truncated")
    view = memoryview(data)
    body, digest = view[:-DIGEST_BYTES], bytes(view[-DIGEST_BYTES:])
    if hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() != digest:
        raise CorruptFile("checksum mismatch")
    if bytes(body[:8]) != MAGIC:
        raise CorruptFile("bad magic")
    (head_len,) = struct.unpack("<I", body[8:12])
    header = _parse_header(bytes(body[12 : 12 + head_len]))
    payload = body[12 + head_len :]
    if len(payload) != header.payload_len:
        raise CorruptFile("payload length mismatch")
    return header, payload


def _parse_header(raw: bytes) -> FileHeader:
    try:
        d = json.loads(raw.decode("utf-8"))
        if d["format"] != FORMAT:
            raise CorruptFile(f"format {d['format']!r}, expected {FORMAT}")
        header = FileHeader(
            runtime=str(d["runtime"]), fingerprint=str(d["fingerprint"]), model_digest=str(d["model"]),
            tenant_digest=str(d["tenant"]), salt_digest=str(d["salt"]),
            token_ids=tuple(int(t) for t in d["token_ids"]), has_logits=bool(d["has_logits"]),
            meta=dict(d["meta"]), payload_len=int(d["payload_len"]),
            truncatable=bool(d.get("truncatable", True)), points=tuple(int(p) for p in d.get("points", ())),
        )
    except CorruptFile:
        raise
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CorruptFile(f"unreadable header: {type(e).__name__}") from None
    if not header.token_ids or header.payload_len < 0:
        raise CorruptFile("empty key or negative payload")
    p = header.points
    if p and (header.truncatable or list(p) != sorted(set(p)) or p[0] <= 0 or p[-1] >= len(header.token_ids)):
        raise CorruptFile("resume points out of order or range")
    return header
