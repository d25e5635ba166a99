"""Session state and cache snapshot of a hybrid model: attention KV + recurrent layer state.

Two kinds of layer state (docs/hybrid.md):
- attention layers' KV (`kv`, [attention layers, 2, kv heads, capacity, head dim], as SessionState's);
- recurrent layers' state (`rec`, models/hybrid/decoder.py RecurrentState: conv inputs, the current cell's
  inputs, and the fp32 delta state at the cell start). It describes exactly one position.

So a hybrid state is snapshot-only (`truncatable = False`): a snapshot serves its own length, and the
shorter lengths where it holds a recurrent checkpoint (`resume_points`): the attention KV truncates to
any length, so a checkpoint costs only its recurrent state. While prefilling, the engine stops at
`checkpoint_positions` (on the GRID, spaced geometrically back from the prompt's end, at most
MAX_CHECKPOINTS; docs/hybrid.md has the measurement) and calls `keep_checkpoint`. Snapshots and
restores deep-copy the current recurrent state; checkpoints are kept once and never written again,
so every snapshot of one session holds the same checkpoint tensors (counted once by the cache).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from prefixserve.models.hybrid.decoder import RecurrentState
from prefixserve.models.hybrid.gated_delta import CELL
from prefixserve.models.layers import BLOCK
from prefixserve.runner.state import KVSnapshot, SessionState, round_up

GRID = 64  # checkpoints and boundary entries sit on multiples of it: no cell rows to keep there
MAX_CHECKPOINTS = 3  # per prompt: 19.5 MB each at the 0.8B shape (docs/hybrid.md)


def checkpoint_positions(prompt_len: int) -> list[int]:
    """Grid positions below `prompt_len` at distances ~GRID * (2**k - 1) back from its last token,
    k < MAX_CHECKPOINTS, ascending: a prompt sharing lcp tokens with this one resumes at the deepest
    one <= lcp, so it recomputes fewer than 2 * (prompt_len - lcp + GRID - 1) tokens."""
    last = prompt_len - 1
    points = {(last - GRID * (2**k - 1)) // GRID * GRID for k in range(MAX_CHECKPOINTS)}
    return sorted(p for p in points if p > 0)


class HybridState(SessionState):
    """A SessionState whose `kv` covers the attention layers only, plus `rec` (recurrent layers)."""

    truncatable = False

    def __init__(self, kv: torch.Tensor, rec: RecurrentState, num_tokens: int = 0,
                 logits: torch.Tensor | None = None, checkpoints: dict[int, RecurrentState] | None = None) -> None:
        super().__init__(kv, num_tokens, logits)
        self.rec = rec
        self.checkpoints = {} if checkpoints is None else checkpoints  # position -> compact rec, read-only

    @classmethod
    def fresh(cls, kv_shape: tuple[int, int, int, int], rec: RecurrentState, dtype: torch.dtype, device: str,
              capacity: int = 0) -> HybridState:
        layers, two, heads, head_dim = kv_shape
        cap = round_up(max(capacity, BLOCK), BLOCK)
        return cls(torch.zeros(layers, two, heads, cap, head_dim, dtype=dtype, device=device), rec)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.rec.nbytes + sum(c.nbytes for c in self.checkpoints.values())

    def boundary_at(self, lcp: int) -> int:
        """The grid position at or below `lcp`: where prompts that share only part of this one's
        common prefix still meet it (docs/hybrid.md)."""
        return lcp - lcp % GRID

    def checkpoint_positions(self, prompt_len: int) -> list[int]:
        return [p for p in checkpoint_positions(prompt_len) if p > self.num_tokens]

    def keep_checkpoint(self) -> None:
        self.checkpoints[self.num_tokens] = self.compact_recurrent()

    def truncate(self, num_tokens: int, force_zero: bool = False) -> None:
        """Only to the current length: a recurrent state cannot go back. force_zero zeroes the
        attention KV past it (as SessionState.truncate does)."""
        if num_tokens != self.num_tokens:
            raise ValueError(f"a hybrid state at {self.num_tokens} tokens cannot be truncated to {num_tokens}")
        if force_zero:
            self.kv[:, :, :, num_tokens:].zero_()

    def snapshot(self, num_tokens: int | None = None, with_logits: bool = True) -> HybridSnapshot:  # type: ignore[override]
        """A deep copy at the current length (the only one a recurrent state describes)."""
        n = self.num_tokens if num_tokens is None else num_tokens
        if n != self.num_tokens or n <= 0:
            raise ValueError(f"a hybrid state at {self.num_tokens} tokens has no snapshot at {n}")
        logits = self.logits.clone() if (with_logits and self.logits is not None) else None
        return HybridSnapshot(self.kv[:, :, :, :n].clone(), self.compact_recurrent(), logits, self._kept())

    def compact_recurrent(self) -> RecurrentState:
        """A deep copy of `rec` keeping only the cell rows in use (num_tokens % CELL; the rest are zero
        by contract, models/hybrid/decoder.py)."""
        r = self.rec
        return RecurrentState(r.conv.clone(), r.cell[:, : self.num_tokens % CELL].clone(), r.delta.clone())

    def snapshot_of(self, kvs: KVSnapshot) -> HybridSnapshot:
        """The snapshot made of `kvs` (this state's KV at its current length, as pieces) and a copy of
        the recurrent state (runner/pieces.py)."""
        if kvs.num_tokens != self.num_tokens:
            raise ValueError(f"a hybrid state at {self.num_tokens} tokens has no snapshot at {kvs.num_tokens}")
        return HybridSnapshot.from_kv(kvs, self.compact_recurrent(), self._kept())

    def _kept(self) -> dict[int, RecurrentState]:
        return {p: c for p, c in sorted(self.checkpoints.items()) if p < self.num_tokens}

    def clone(self) -> HybridState:
        twin = HybridState(self.kv.clone(), self.rec.clone(), self.num_tokens,
                           None if self.logits is None else self.logits.clone(), dict(self.checkpoints))
        twin.grow_limit = self.grow_limit
        return twin


class HybridSnapshot:
    """Immutable cached hybrid state (implements cache.CachedState), usable at exactly `num_tokens`
    and at its `resume_points`: the attention KV as a run of pieces (a KVSnapshot, shareable between
    entries on one prefix path like any KV, runner/pieces.py), the recurrent state at its end, whose
    `cell` holds only the num_tokens % CELL rows in use (restore pads the zero rows back), and the
    recurrent checkpoints (shared with the other snapshots of the session that kept them)."""

    truncatable = False

    def __init__(self, kv: torch.Tensor, rec: RecurrentState, logits: torch.Tensor | None,
                 points: dict[int, RecurrentState] | None = None) -> None:
        """One private KV piece: kv [attention layers, 2, kv heads, num_tokens, head dim], compact."""
        self._kvs = KVSnapshot(kv, logits)
        self._rec = rec
        self._points = {} if points is None else points

    @classmethod
    def from_kv(cls, kvs: KVSnapshot, rec: RecurrentState,
                points: dict[int, RecurrentState] | None = None) -> HybridSnapshot:
        """A snapshot of KV pieces `kvs` (logits included), the compact recurrent state `rec` and
        checkpoints `points` (positions < kvs.num_tokens)."""
        snap = cls.__new__(cls)
        snap._kvs = kvs
        snap._rec = rec
        snap._points = {} if points is None else points
        return snap

    @property
    def resume_points(self) -> tuple[int, ...]:
        """The shorter lengths this snapshot also restores to (sorted; cache.CachedState)."""
        return tuple(sorted(self._points))

    @property
    def recurrent(self) -> RecurrentState:
        """The compact recurrent state at `num_tokens` (read-only; runner/codec.py)."""
        return self._rec

    @property
    def checkpoints(self) -> dict[int, RecurrentState]:
        """A new dict of the compact recurrent checkpoints by position, ascending (read-only tensors)."""
        return dict(sorted(self._points.items()))

    def with_kv(self, kvs: KVSnapshot) -> HybridSnapshot:
        """The same recurrent part over other pieces of the same KV (runner/pieces.py: adopt)."""
        assert kvs.num_tokens == self.num_tokens
        return HybridSnapshot.from_kv(kvs, self._rec, self._points)

    @property
    def checkpoint_nbytes(self) -> int:
        """Bytes of the recurrent checkpoints (of `nbytes`; for the bench and docs/hybrid.md)."""
        return sum(r.nbytes for r in self._points.values())

    @property
    def kv(self) -> KVSnapshot:
        return self._kvs

    @property
    def num_tokens(self) -> int:
        return self._kvs.num_tokens

    @property
    def has_logits(self) -> bool:
        return self._kvs.has_logits

    @property
    def logits(self) -> torch.Tensor | None:
        return self._kvs.logits

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.storage())

    def storage(self) -> list[tuple[Hashable, int]]:
        recs = [self._rec, *self._points.values()]
        return [*self._kvs.storage(), *((("recurrent", r.delta.untyped_storage().data_ptr()), r.nbytes) for r in recs)]

    def restore(self, num_tokens: int, extra_capacity: int, pool: object = None) -> HybridState:
        """Deep copy into a new HybridState with room for `extra_capacity` more tokens. num_tokens must
        be this snapshot's own length or one of its resume points (a recurrent state is valid at one
        position only); the new state keeps the checkpoints up to it (shared, never written), so its
        own snapshots serve them too at no extra bytes. `pool` is ignored: hybrid states are not pooled."""
        r = self._rec if num_tokens == self.num_tokens else self._points.get(num_tokens)
        if r is None:
            raise ValueError(f"a hybrid snapshot of {self.num_tokens} tokens cannot serve {num_tokens}")
        kv_state = self._kvs.restore(num_tokens, extra_capacity)
        cell = r.cell.new_zeros(r.cell.shape[0], CELL, r.cell.shape[2])
        cell[:, : r.cell.shape[1]] = r.cell
        points = {p: c for p, c in self._points.items() if p <= num_tokens}
        return HybridState(kv_state.kv, RecurrentState(r.conv.clone(), cell, r.delta.clone()), num_tokens,
                           kv_state.logits, points)
