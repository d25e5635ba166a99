"""Per-session model state: KV for every layer, its length, and the last position's logits.

A `SessionState` is owned by one session and grows as it runs. `snapshot()` makes an immutable,
compact `KVSnapshot` for the cache; `KVSnapshot.restore()` deep-copies it back into a fresh
session state. Neither ever aliases the other's memory, so a session can never change a cache
entry and one entry can seed any number of concurrent sessions.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from prefixserve.models.layers import BLOCK

log = logging.getLogger("prefixserve.runner")

GROW_TOKENS = 256  # capacity grows in steps of at least this many tokens (a multiple of BLOCK)


def round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple` (> 0)."""
    return (n + multiple - 1) // multiple * multiple


class KVPool:
    """KV buffers of finished sessions, kept for the next session instead of going back to the OS.

    A fresh multi-MB tensor is new pages, and the first touch of new pages is the kernel's (and on
    a VM the host's) work: measured on the 2-core Xeon VM, restoring a 1,900-token prefix took
    ~23 ms with a fresh buffer (zero-fill + copy) and, every twenty or so requests, 140-520 ms when
    the allocation stalled; into a reused buffer the same copy takes ~6 ms. `take` returns garbage,
    so every caller writes or zeroes all of it (block attention needs zeros past the valid keys).
    Bounded by `max_bytes`, oldest out, and by what `trim` allows (the engine keeps the pool within
    the session budget its admitted sessions leave). Engine-thread only.

    Who holds a buffer is this code's own count, never asked of torch (its storage use count is a
    private API whose meaning may change with any torch release, and a wrong answer would hand memory
    a cache entry or session still reads to another tenant's session). A buffer has exactly one
    holder: the `SessionState` it was lent to (`take`) or that made it (growth). Nothing else keeps a
    view of a session's KV past the call that made it: snapshots, forks and the tiers copy
    (`SessionState.snapshot`, runner/pieces.py). `give` is the holder's last use, taking the count to
    zero; the pool then keeps the buffer unless it is not one whole storage (a view: someone else's
    memory), is pooled already (a second give would lend it to two sessions), or is too large.
    `check_integrity` asserts the pool's side of it.

    512 MiB, not the 128 it was: back-to-back requests on a 2,000-token system prompt keep up to
    MAX_PENDING_REFILLS finished states (45 MB each) waiting for their refill while the next requests
    restore, so 128 MiB (two buffers) sent most buffers back to the OS, and on the VM fresh pages cost
    ~40 us each to touch: 0.5-0.65 s in one request of two to five (a 22-token
    suffix over 2,030 cached tokens: 500-650 ms instead of 70). Measured with 512 MiB: 36 such
    requests, 8 buffers allocated, none slow (docs/architecture.md, "KV buffers").
    """

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes = max_bytes
        self._free: list[torch.Tensor] = []  # oldest first
        self._pooled: set[int] = set()  # the storages of `_free`, by address (alive while pooled): each once
        self.bytes = 0
        self.num_reused = 0
        self.num_allocated = 0
        self.num_refused = 0  # gives not kept because the buffer was a view or pooled already (each a bug)

    def take(self, shape: tuple[int, int, int, int, int], dtype: torch.dtype, device: str) -> torch.Tensor:
        """A tensor of `shape` (capacity = shape[3]) or of a capacity up to a quarter (at least
        GROW_TOKENS) larger; its contents are undefined. The caller is its one holder until `give`."""
        cap = shape[3]
        slack = max(GROW_TOKENS, cap // 4)
        best = None
        for i, t in enumerate(self._free):
            if (t.dtype == dtype and t.device.type == torch.device(device).type and t.shape[:3] == shape[:3]
                    and t.shape[4] == shape[4] and cap <= t.shape[3] <= cap + slack
                    and (best is None or t.shape[3] < self._free[best].shape[3])):
                best = i
        if best is None:
            self.num_allocated += 1
            t = torch.empty(shape, dtype=dtype, device=device)
        else:
            t = self._free.pop(best)
            self._pooled.discard(_address(t))
            self.bytes -= _nbytes(t)
            self.num_reused += 1
        return t

    def trim(self, limit: int) -> None:
        """Hold at most `limit` bytes (oldest out). `trim(0)` empties the pool; any limit is safe."""
        while self._free and self.bytes > max(0, limit):
            old = self._free.pop(0)
            self._pooled.discard(_address(old))
            self.bytes -= _nbytes(old)

    def give(self, kv: torch.Tensor) -> bool:
        """Its holder is done with `kv` and never uses it again (the class docstring): keep it for a later
        `take` if it is one whole storage, not pooled already and within `max_bytes`. Whether it was kept."""
        address = _address(kv)
        whole = kv.is_contiguous() and kv.storage_offset() == 0 and kv.untyped_storage().nbytes() == _nbytes(kv)
        if not whole or address in self._pooled:
            self.num_refused += 1
            log.error("KV pool: refused a buffer that is %s", "pooled already" if whole else "a view of a larger one")
            return False
        if _nbytes(kv) > self.max_bytes:
            return False
        self._free.append(kv)
        self._pooled.add(address)
        self.bytes += _nbytes(kv)
        self.trim(self.max_bytes)
        return True

    def check_integrity(self) -> None:
        """Bytes add up; every pooled buffer is a whole storage, pooled once."""
        assert self.bytes == sum(_nbytes(t) for t in self._free) <= self.max_bytes
        assert self._pooled == {_address(t) for t in self._free} and len(self._pooled) == len(self._free)
        assert all(t.storage_offset() == 0 and t.untyped_storage().nbytes() == _nbytes(t) for t in self._free)


def _address(t: torch.Tensor) -> int:
    """Names a buffer's memory while the buffer lives (the address of its storage's first byte)."""
    return int(t.untyped_storage().data_ptr())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _kv_buffer(
    shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, capacity: int, pool: KVPool | None
) -> torch.Tensor:
    """An uninitialised KV tensor for (num_layers, 2, num_kv_heads, head_dim) with room for `capacity`
    tokens rounded up to a BLOCK: from `pool` when given (possibly a little larger), else new."""
    layers, two, heads, head_dim = shape
    full = (layers, two, heads, round_up(max(capacity, BLOCK), BLOCK), head_dim)
    return torch.empty(full, dtype=dtype, device=device) if pool is None else pool.take(full, dtype, device)


class SessionState:
    """Mutable state of one running session.

    kv: [num_layers, 2, num_kv_heads, capacity, head_dim]
    # [0, num_tokens)          valid keys/values
    # [num_tokens, capacity)   zero (block attention reads up to the next BLOCK boundary)
    logits: fp32 [vocab] of position num_tokens - 1, or None when not known (after truncation).
    Recurrent layers would add fields here and set `truncatable = False`.
    """

    truncatable = True

    def __init__(self, kv: torch.Tensor, num_tokens: int = 0, logits: torch.Tensor | None = None) -> None:
        assert kv.shape[3] % BLOCK == 0
        self.kv = kv
        self.num_tokens = num_tokens
        self.logits = logits
        # the most tokens it may hold (its session's prompt + max_tokens, what admission reserved): growth
        # stops there instead of doubling past it; None: unbounded (set by the engine as it restores a session: engine/core.py)
        self.grow_limit: int | None = None

    @classmethod
    def empty(
        cls, shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, capacity: int = 0,
        pool: KVPool | None = None,
    ) -> SessionState:
        """shape = (num_layers, 2, num_kv_heads, head_dim); the buffer from `pool` when it has one."""
        return cls(_kv_buffer(shape, dtype, device, capacity, pool).zero_())

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    @property
    def nbytes(self) -> int:
        n = self.kv.numel() * self.kv.element_size()
        return n + (self.logits.numel() * self.logits.element_size() if self.logits is not None else 0)

    def reserve(self, num_tokens: int) -> None:
        """Make room for `num_tokens` in total, keys rounded up to a BLOCK boundary. Keeps contents."""
        need = round_up(num_tokens, BLOCK)
        if need <= self.capacity:
            return
        new_cap = max(need, self.capacity * 2, GROW_TOKENS)
        if self.grow_limit is not None:
            new_cap = min(new_cap, max(need, self.grow_limit))
        new_cap = round_up(new_cap, BLOCK)
        kv = self.kv.new_zeros(*self.kv.shape[:3], new_cap, self.kv.shape[4])
        kv[:, :, :, : self.num_tokens].copy_(self.kv[:, :, :, : self.num_tokens])  # a method call: the GIL is released
        self.kv = kv

    def truncate(self, num_tokens: int, force_zero: bool = False) -> None:
        """Drop everything after `num_tokens` (zeroing it, as block attention requires); logits are lost.
        force_zero: zero the whole capacity past `num_tokens` (after a forward that failed midway)."""
        assert 0 <= num_tokens <= self.num_tokens
        if force_zero:
            self.kv[:, :, :, num_tokens:].zero_()
        if num_tokens < self.num_tokens:
            self.kv[:, :, :, num_tokens : self.num_tokens].zero_()
            self.num_tokens = num_tokens
            self.logits = None

    def snapshot(self, num_tokens: int | None = None, with_logits: bool = True) -> KVSnapshot:
        """A compact deep copy of the first `num_tokens` (default: all). Logits are kept only for the full length."""
        n = self.num_tokens if num_tokens is None else num_tokens
        assert 0 < n <= self.num_tokens
        logits = self.logits.clone() if (with_logits and n == self.num_tokens and self.logits is not None) else None
        return KVSnapshot(self.kv[:, :, :, :n].clone(), logits)

    def clone(self) -> SessionState:
        twin = SessionState(self.kv.clone(), self.num_tokens, None if self.logits is None else self.logits.clone())
        twin.grow_limit = self.grow_limit
        return twin

    def boundary_at(self, lcp: int) -> int:
        """Where the engine puts a boundary entry for a common prefix of `lcp` tokens: right there
        (KV restores to any length). A snapshot-only state may choose a shallower position."""
        return lcp

    def checkpoint_positions(self, prompt_len: int) -> list[int]:
        """Positions in (num_tokens, prompt_len) where prefill should stop and `keep_checkpoint`:
        none, since a truncatable snapshot serves every length (runner/hybrid_state.py keeps some)."""
        return []

    def keep_checkpoint(self) -> None:
        """Keep what a restore at the current length needs, for the snapshots taken later: nothing here."""


@dataclass(frozen=True, slots=True)
class KVPiece:
    """KV of tokens [start, end) of one prefix, as a compact tensor [num_layers, 2, num_kv_heads,
    end - start, head_dim]. `key` names the memory for the cache's byte accounting: two snapshots
    holding the same piece hold the same tensor and the same key (see runner/pieces.py)."""

    start: int
    end: int
    key: Hashable
    kv: torch.Tensor


class KVSnapshot:
    """Immutable cached state (implements cache.CachedState). Never handed to a session directly.

    Its KV is a run of pieces covering [0, num_tokens) in order; pieces may be shared with other
    snapshots (runner/pieces.py) and are never written after construction, so sharing is safe."""

    truncatable = True

    def __init__(self, kv: torch.Tensor, logits: torch.Tensor | None) -> None:
        """One private piece: kv [num_layers, 2, num_kv_heads, num_tokens, head_dim], compact."""
        self._pieces: tuple[KVPiece, ...] = (KVPiece(0, kv.shape[3], ("own", kv.untyped_storage().data_ptr()), kv),)
        self._logits = logits

    @classmethod
    def from_pieces(cls, pieces: Sequence[KVPiece], logits: torch.Tensor | None) -> KVSnapshot:
        """A snapshot of pieces that tile [0, end of the last) in order (asserted)."""
        assert pieces and pieces[0].start == 0
        assert all(a.end == b.start for a, b in itertools.pairwise(pieces))
        snap = cls.__new__(cls)
        snap._pieces = tuple(pieces)
        snap._logits = logits
        return snap

    @property
    def pieces(self) -> tuple[KVPiece, ...]:
        return self._pieces

    @property
    def _kv(self) -> torch.Tensor:
        """The whole KV as one tensor (a concatenated copy when the snapshot has several pieces)."""
        if len(self._pieces) == 1:
            return self._pieces[0].kv
        return torch.cat([p.kv for p in self._pieces], dim=3)

    @property
    def num_tokens(self) -> int:
        return self._pieces[-1].end

    @property
    def has_logits(self) -> bool:
        return self._logits is not None

    @property
    def logits(self) -> torch.Tensor | None:
        return self._logits

    def without_logits(self) -> KVSnapshot:
        """The same KV pieces (shared, not copied) without the logits: what the cache keeps of an
        entry whose logits it sheds for room (cache/room.py)."""
        return KVSnapshot.from_pieces(self._pieces, None)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.storage())

    def storage(self) -> list[tuple[Hashable, int]]:
        pieces: list[tuple[Hashable, int]] = [(p.key, p.kv.untyped_storage().nbytes()) for p in self._pieces]
        if self._logits is not None:
            pieces.append((("logits", self._logits.untyped_storage().data_ptr()), self._logits.untyped_storage().nbytes()))
        return pieces

    def restore(self, num_tokens: int, extra_capacity: int, pool: KVPool | None = None) -> SessionState:
        """Deep-copy the first `num_tokens` into a new SessionState with room for `extra_capacity` more:
        one copy per piece, each into its own token range (into a buffer from `pool` when given)."""
        assert 0 < num_tokens <= self.num_tokens
        layers, two, heads, _, head_dim = self._pieces[0].kv.shape
        kv0 = self._pieces[0].kv
        state = SessionState(_kv_buffer((layers, two, heads, head_dim), kv0.dtype, str(kv0.device),
                                        num_tokens + extra_capacity, pool))
        state.kv[:, :, :, num_tokens:].zero_()  # the pieces below write the rest
        for p in self._pieces:
            if p.start >= num_tokens:
                break
            end = min(p.end, num_tokens)
            state.kv[:, :, :, p.start : end].copy_(p.kv[:, :, :, : end - p.start])
        state.num_tokens = num_tokens
        if num_tokens == self.num_tokens and self._logits is not None:
            state.logits = self._logits.clone()
        return state
