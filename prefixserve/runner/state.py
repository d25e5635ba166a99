"""Per-session model state: KV for every layer, its length, and the last position's logits.

A `SessionState` is owned by one session and grows as it runs. `snapshot()` makes an immutable,
compact `KVSnapshot` for the cache; `KVSnapshot.restore()` deep-copies it back into a fresh
session state. Neither ever aliases the other's memory, so a session can never change a cache
entry and one entry can seed any number of concurrent sessions.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from prefixserve.models.layers import BLOCK

GROW_TOKENS = 256  # capacity grows in steps of at least this many tokens (a multiple of BLOCK)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


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

    @classmethod
    def empty(cls, shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, capacity: int = 0) -> SessionState:
        """shape = (num_layers, 2, num_kv_heads, head_dim)."""
        layers, two, heads, head_dim = shape
        cap = _round_up(max(capacity, BLOCK), BLOCK)
        return cls(torch.zeros(layers, two, heads, cap, head_dim, dtype=dtype, device=device))

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    @property
    def nbytes(self) -> int:
        n = self.kv.numel() * self.kv.element_size()
        return n + (self.logits.numel() * self.logits.element_size() if self.logits is not None else 0)

    def reserve(self, num_tokens: int) -> None:
        """Make room for `num_tokens` in total, keys rounded up to a BLOCK boundary. Keeps contents."""
        need = _round_up(num_tokens, BLOCK)
        if need <= self.capacity:
            return
        new_cap = _round_up(max(need, self.capacity * 2, GROW_TOKENS), BLOCK)
        kv = self.kv.new_zeros(*self.kv.shape[:3], new_cap, self.kv.shape[4])
        kv[:, :, :, : self.num_tokens] = self.kv[:, :, :, : self.num_tokens]
        self.kv = kv

    def truncate(self, num_tokens: int) -> None:
        """Drop everything after `num_tokens` (zeroing it, as block attention requires); logits are lost."""
        assert 0 <= num_tokens <= self.num_tokens
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
        return SessionState(self.kv.clone(), self.num_tokens, None if self.logits is None else self.logits.clone())


class KVSnapshot:
    """Immutable cached state (implements cache.CachedState). Never handed to a session directly."""

    truncatable = True

    def __init__(self, kv: torch.Tensor, logits: torch.Tensor | None) -> None:
        self._kv = kv  # [num_layers, 2, num_kv_heads, num_tokens, head_dim], compact
        self._logits = logits

    @property
    def num_tokens(self) -> int:
        return self._kv.shape[3]

    @property
    def has_logits(self) -> bool:
        return self._logits is not None

    @property
    def logits(self) -> torch.Tensor | None:
        return self._logits

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.storage())

    def storage(self) -> list[tuple[Hashable, int]]:
        pieces: list[tuple[Hashable, int]] = [(self._kv.untyped_storage().data_ptr(), self._kv.untyped_storage().nbytes())]
        if self._logits is not None:
            pieces.append((self._logits.untyped_storage().data_ptr(), self._logits.untyped_storage().nbytes()))
        return pieces

    def restore(self, num_tokens: int, extra_capacity: int) -> SessionState:
        """Deep-copy the first `num_tokens` into a new SessionState with room for `extra_capacity` more."""
        assert 0 < num_tokens <= self.num_tokens
        layers, two, heads, _, head_dim = self._kv.shape
        state = SessionState.empty((layers, two, heads, head_dim), self._kv.dtype, str(self._kv.device),
                                   num_tokens + extra_capacity)
        state.kv[:, :, :, :num_tokens] = self._kv[:, :, :, :num_tokens]
        state.num_tokens = num_tokens
        if num_tokens == self.num_tokens and self._logits is not None:
            state.logits = self._logits.clone()
        return state
