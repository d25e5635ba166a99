"""KV stored once along the prefix tree: snapshots made of pieces shared between cache entries.

A piece is the KV of tokens [start, end) of one exact token prefix in one scope (the cache
namespace). Its key is (scope, digest of the prefix's first `end` tokens, start): the KV of those
tokens depends only on them (the runtime is split- and batch-invariant, docs/cache.md), so every
snapshot that covers the same range of the same prefix can hold the same tensor. Piece edges sit on
multiples of `piece_tokens` and on the lengths the caller names (the cache entries on the key's
path), so N users of one system prompt share its pieces up to the boundary entry and each owns only
its own suffix. A reused piece is compared bit for bit with the session's KV first: a mismatch
(a state built some other way) is logged and stored as a private piece, never shared.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import weakref
from array import array
from collections.abc import Generator, Hashable, Iterable, Sequence
from typing import TypeVar

import torch

from prefixserve.models.layers import run_through
from prefixserve.runner.hybrid_state import HybridSnapshot
from prefixserve.runner.state import KVPiece, KVSnapshot, SessionState

log = logging.getLogger("prefixserve.runner")

PIECE_TOKENS = 64  # a multiple of the attention BLOCK (32); see docs/cache.md for the measurement

_private = itertools.count()
S = TypeVar("S", KVSnapshot, HybridSnapshot)


class PieceStore:
    """Finds the live piece for a key. Holds pieces weakly: a piece lives exactly as long as some
    snapshot (a cache entry, or a session's pending copy) holds it, so freeing is the cache's
    business alone. One thread (the engine's) uses it."""

    def __init__(self, piece_tokens: int = PIECE_TOKENS) -> None:
        assert piece_tokens > 0 and piece_tokens % 32 == 0
        self.piece_tokens = piece_tokens
        self._live: weakref.WeakValueDictionary[Hashable, torch.Tensor] = weakref.WeakValueDictionary()
        self.num_shared = 0  # pieces reused instead of copied (tests, bench)
        self.num_mismatched = 0  # reuse refused because the bits differed

    def snapshot(self, state: SessionState, token_ids: Sequence[int], scope: Hashable,
                 splits: Iterable[int] = (), with_logits: bool = True) -> KVSnapshot:
        """A snapshot of the first len(token_ids) tokens of `state` (which must hold at least that many
        and have computed them from exactly `token_ids`), sharing every piece already live. Extra
        piece edges at `splits` (those outside (0, n) are ignored). Logits only at the state's end.
        Does not mutate `state`. A state that is not truncatable is snapshotted at its own length only:
        its KV as shared pieces if it offers `snapshot_of` (runner/hybrid_state.py), else whole."""
        return run_through(self.snapshot_steps(state, token_ids, scope, splits, with_logits))

    def snapshot_steps(self, state: SessionState, token_ids: Sequence[int], scope: Hashable,
                       splits: Iterable[int] = (), with_logits: bool = True) -> Generator[None, None, KVSnapshot]:
        """`snapshot`, pausing after each piece (a compare or a copy, ~1 ms for 64 tokens of the
        embedded model's KV): a background turn refill stores its turn this way between the engine's
        steps (engine/refill.py). `state` must not change until it returns. Pieces made before a
        pause are live (held by this generator) and may be shared meanwhile; closing it early
        drops them."""
        n = len(token_ids)
        assert 0 < n <= state.num_tokens
        snapshot_of = getattr(state, "snapshot_of", None)
        if not state.truncatable and (snapshot_of is None or n != state.num_tokens):
            return state.snapshot(n, with_logits)  # raises for a length the state does not describe
        pieces: list[KVPiece] = []
        for start, end, digest in _edges(token_ids, self.piece_tokens, splits):
            if pieces:
                yield
            pieces.append(self._piece(state, (scope, digest, start), start, end))
        logits = state.logits.clone() if (with_logits and n == state.num_tokens and state.logits is not None) else None
        if not state.truncatable:
            return snapshot_of(KVSnapshot.from_pieces(pieces, logits))  # type: ignore[no-any-return,misc]
        return KVSnapshot.from_pieces(pieces, logits)

    def adopt(self, snap: S, token_ids: Sequence[int], scope: Hashable) -> S:
        """A snapshot with `snap`'s pieces (e.g. read from disk, viewing a file buffer) turned into
        store pieces: shared where live, else copied into their own memory; a hybrid snapshot keeps
        its recurrent part (the codec gave it its own memory). `token_ids` are the exact tokens
        `snap` was computed from. Does not mutate `snap`."""
        if isinstance(snap, HybridSnapshot):
            return snap.with_kv(self.adopt(snap.kv, token_ids, scope))  # type: ignore[return-value]
        assert len(token_ids) == snap.num_tokens
        ends = [p.end for p in snap.pieces]
        pieces = []
        for (start, end, digest), p in zip(_edges(token_ids, 1 << 62, ends), snap.pieces, strict=True):
            pieces.append(self._piece_of(p.kv, (scope, digest, start), start, end))
        logits = None if snap.logits is None else snap.logits.clone()
        return KVSnapshot.from_pieces(pieces, logits)

    def _piece(self, state: SessionState, key: Hashable, start: int, end: int) -> KVPiece:
        return self._piece_of(state.kv[:, :, :, start:end], key, start, end)

    def _piece_of(self, src: torch.Tensor, key: Hashable, start: int, end: int) -> KVPiece:
        live = self._live.get(key)
        if live is not None:
            if same_bits(live, src):
                self.num_shared += 1
                return KVPiece(start, end, key, live)
            self.num_mismatched += 1
            log.warning("KV piece [%d, %d) differs from the cached one for the same prefix: not shared", start, end)
            return KVPiece(start, end, ("private", next(_private)), src.clone())
        kv = src.clone()
        self._live[key] = kv
        return KVPiece(start, end, key, kv)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (unlike torch.equal on floats: -0.0 vs 0.0 and NaNs differ here), compared as
    integers of the same width, which is also ~1.7x faster than a bf16 torch.equal on this CPU."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = _INT_OF_SIZE[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def piece_edges(num_tokens: int, piece_tokens: int, splits: Iterable[int] = ()) -> list[int]:
    """The sorted piece ends for a prefix of `num_tokens`: multiples of `piece_tokens`, the `splits`
    inside (0, num_tokens), and num_tokens itself. Pure."""
    ends = set(range(piece_tokens, num_tokens, piece_tokens))
    ends.update(s for s in splits if 0 < s < num_tokens)
    ends.add(num_tokens)
    return sorted(ends)


def _edges(token_ids: Sequence[int], piece_tokens: int, splits: Iterable[int]) -> list[tuple[int, int, bytes]]:
    """(start, end, digest of token_ids[:end]) per piece; the digest is a running BLAKE2b-256 over
    the int32 token ids, so it names the prefix whatever the other edges are."""
    h = hashlib.blake2b(digest_size=32)
    out = []
    start = 0
    for end in piece_edges(len(token_ids), piece_tokens, splits):
        h.update(array("i", token_ids[start:end]).tobytes())
        out.append((start, end, h.copy().digest()))
        start = end
    return out
