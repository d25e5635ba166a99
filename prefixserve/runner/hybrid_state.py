"""Session state and cache snapshot of a hybrid model: attention KV + recurrent layer state.

Two kinds of layer state (docs/hybrid.md):
- attention layers' KV (`kv`, [attention layers, 2, kv heads, capacity, head dim], as SessionState's);
- recurrent layers' state (`rec`, models/hybrid.py RecurrentState: conv inputs, the current cell's
  inputs, and the fp32 delta state at the cell start). It describes exactly one position.

So a hybrid state is snapshot-only (`truncatable = False`): a snapshot serves exactly its own length
(the cache's index never truncates it, runner/pieces.py stores it whole as one private piece).
Snapshots and restores deep-copy; neither aliases the other's memory.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from prefixserve.models.gated_delta import CELL
from prefixserve.models.hybrid import RecurrentState
from prefixserve.models.layers import BLOCK
from prefixserve.runner.state import KVSnapshot, SessionState, _round_up


class HybridState(SessionState):
    """A SessionState whose `kv` covers the attention layers only, plus `rec` (recurrent layers)."""

    truncatable = False

    def __init__(self, kv: torch.Tensor, rec: RecurrentState, num_tokens: int = 0,
                 logits: torch.Tensor | None = None) -> None:
        super().__init__(kv, num_tokens, logits)
        self.rec = rec

    @classmethod
    def fresh(cls, kv_shape: tuple[int, int, int, int], rec: RecurrentState, dtype: torch.dtype, device: str,
              capacity: int = 0) -> HybridState:
        layers, two, heads, head_dim = kv_shape
        cap = _round_up(max(capacity, BLOCK), BLOCK)
        return cls(torch.zeros(layers, two, heads, cap, head_dim, dtype=dtype, device=device), rec)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.rec.nbytes

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
        return HybridSnapshot(self.kv[:, :, :, :n].clone(), self.compact_recurrent(), logits)

    def compact_recurrent(self) -> RecurrentState:
        """A deep copy of `rec` keeping only the cell rows in use (num_tokens % CELL; the rest are zero
        by contract, models/hybrid.py)."""
        r = self.rec
        return RecurrentState(r.conv.clone(), r.cell[:, : self.num_tokens % CELL].clone(), r.delta.clone())

    def snapshot_of(self, kvs: KVSnapshot) -> HybridSnapshot:
        """The snapshot made of `kvs` (this state's KV at its current length, as pieces) and a copy of
        the recurrent state (runner/pieces.py)."""
        if kvs.num_tokens != self.num_tokens:
            raise ValueError(f"a hybrid state at {self.num_tokens} tokens has no snapshot at {kvs.num_tokens}")
        return HybridSnapshot.from_kv(kvs, self.compact_recurrent())

    def clone(self) -> HybridState:
        return HybridState(self.kv.clone(), self.rec.clone(), self.num_tokens,
                           None if self.logits is None else self.logits.clone())


class HybridSnapshot:
    """Immutable cached hybrid state (implements cache.CachedState), usable only at exactly
    `num_tokens`: the attention KV as a run of pieces (a KVSnapshot, shareable between entries on one
    prefix path like any KV, runner/pieces.py) plus the private recurrent state, whose `cell` holds
    only the num_tokens % CELL rows in use (restore pads the zero rows back)."""

    truncatable = False

    def __init__(self, kv: torch.Tensor, rec: RecurrentState, logits: torch.Tensor | None) -> None:
        """One private KV piece: kv [attention layers, 2, kv heads, num_tokens, head dim], compact."""
        self._kvs = KVSnapshot(kv, logits)
        self._rec = rec

    @classmethod
    def from_kv(cls, kvs: KVSnapshot, rec: RecurrentState) -> HybridSnapshot:
        """A snapshot of KV pieces `kvs` (logits included) and the compact recurrent state `rec`."""
        snap = cls.__new__(cls)
        snap._kvs = kvs
        snap._rec = rec
        return snap

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
        rec = (("recurrent", self._rec.delta.untyped_storage().data_ptr()), self._rec.nbytes)
        return [*self._kvs.storage(), rec]

    def restore(self, num_tokens: int, extra_capacity: int) -> HybridState:
        """Deep copy into a new HybridState with room for `extra_capacity` more tokens. num_tokens must
        be this snapshot's own length (a recurrent state is valid at one position only)."""
        if num_tokens != self.num_tokens:
            raise ValueError(f"a hybrid snapshot of {self.num_tokens} tokens cannot serve {num_tokens}")
        kv_state = self._kvs.restore(num_tokens, extra_capacity)
        r = self._rec
        cell = r.cell.new_zeros(r.cell.shape[0], CELL, r.cell.shape[2])
        cell[:, : r.cell.shape[1]] = r.cell
        return HybridState(kv_state.kv, RecurrentState(r.conv.clone(), cell, r.delta.clone()), num_tokens,
                           kv_state.logits)
