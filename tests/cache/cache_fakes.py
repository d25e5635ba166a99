"""Small fake `CachedState`s for the cache tests: no model, just token counts and storage pieces."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from prefixserve.cache import PrefixCache
from prefixserve.config import CacheConfig
from prefixserve.types import Namespace

_unique = itertools.count()

NS_A = Namespace("model", "tenant-a")
NS_B = Namespace("model", "tenant-b")
NS_A_SALT = Namespace("model", "tenant-a", "salt-1")
NS_A_OTHER_MODEL = Namespace("other-model", "tenant-a")


@dataclass(frozen=True)
class FakeState:
    num_tokens: int
    truncatable: bool
    has_logits: bool
    pieces: tuple[tuple[Hashable, int], ...]
    resume_points: tuple[int, ...] = ()  # a snapshot-only state's checkpoints (CachedState)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.pieces)

    def storage(self) -> list[tuple[Hashable, int]]:
        return list(self.pieces)

    def without_logits(self) -> FakeState:
        """The state without its logits piece, as the runner's KVSnapshot offers (CachedState)."""
        return FakeState(self.num_tokens, self.truncatable, False, tuple(p for p in self.pieces if p[0][0] != "logits"),
                         self.resume_points)


def kv(
    tokens: Sequence[int], nbytes: int = 100, *, logits: bool = False, shared: Sequence[tuple[str, int]] = (),
    logits_bytes: int = 0,
) -> FakeState:
    """A KV-only (truncatable) state over `tokens`: one private piece of `nbytes` plus `shared` pieces,
    plus a logits piece of `logits_bytes` when given (then `logits` is implied)."""
    state = _state(tokens, True, logits or logits_bytes > 0, nbytes, shared)
    if logits_bytes:
        state = FakeState(state.num_tokens, True, True, (*state.pieces, (("logits", next(_unique)), logits_bytes)))
    return state


def snap(
    tokens: Sequence[int], nbytes: int = 100, *, logits: bool = False, shared: Sequence[tuple[str, int]] = (),
    points: Sequence[int] = (),
) -> FakeState:
    """A snapshot-only (recurrent) state: usable only at exactly len(tokens) and at its `points`."""
    state = _state(tokens, False, logits, nbytes, shared)
    return FakeState(state.num_tokens, False, logits, state.pieces, tuple(points))


def make_cache(max_bytes: int = 10_000) -> PrefixCache:
    return PrefixCache(CacheConfig(max_bytes=max_bytes))


def _state(
    tokens: Sequence[int], truncatable: bool, logits: bool, nbytes: int, shared: Sequence[tuple[str, int]]
) -> FakeState:
    pieces: list[tuple[Hashable, int]] = [(("own", next(_unique)), nbytes)] if nbytes else []
    pieces.extend(shared)
    return FakeState(len(tokens), truncatable, logits, tuple(pieces))
