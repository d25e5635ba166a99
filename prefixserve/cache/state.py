"""What the cache needs to know about a cached model state. The state itself belongs to the runtime.

The cache never reads, copies or mutates a state's contents: it indexes it by the exact token prefix
it was computed from, counts its bytes and decides when to drop it. The engine deep-copies a state
out of the cache while holding a pin on its entry (`PrefixCache.pinned`).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol, TypeVar, runtime_checkable


@runtime_checkable
class CachedState(Protocol):
    """A model state after `num_tokens` prompt tokens, as the runtime stores it.

    The cache reads `truncatable`, `has_logits` and `storage()` once, at insert, and assumes they never
    change while the state is cached (entries are never mutated by a session).

    Optional: a state may offer `without_logits()`, the same state without its logits (sharing the
    rest of its storage, storage keys a subset of its own); the cache then sheds logits before it
    evicts whole entries (cache/room.py). Truncatable states only.

    Optional: a snapshot-only state may also offer `resume_points`, the sorted shorter lengths it can
    restore to as well (a hybrid state's recurrent checkpoints, docs/hybrid.md); its storage then counts
    their bytes too. Read once at insert; absent means none.
    """

    @property
    def num_tokens(self) -> int:
        """How many prompt tokens the state covers; equals the length of the key it is inserted under."""
        ...

    @property
    def truncatable(self) -> bool:
        """True for KV-only states: the first k tokens of it serve any prompt sharing those k tokens.
        False for states with recurrent (snapshot) layers: usable only at exactly `num_tokens`."""
        ...

    @property
    def has_logits(self) -> bool:
        """The state carries the logits of its last position, so a prompt equal to its key needs no
        forward pass at all."""
        ...

    @property
    def nbytes(self) -> int:
        """Sum of the nbytes of `storage()`."""
        ...

    def storage(self) -> list[tuple[Hashable, int]]:
        """The pieces of memory the state holds, as (storage key, nbytes), keys distinct within a state.

        Pieces with the same key in several entries are one piece of memory (for example a KV block two
        entries view) and count once against the budget; a key must always come with the same nbytes.
        """
        ...


# The state type one cache stores (the engine: the runner's snapshots; the disk tier: file references).
S = TypeVar("S", bound=CachedState)
