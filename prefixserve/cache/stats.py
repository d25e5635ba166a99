"""Cache counters: kept per namespace, aggregated for public metrics (which carry no tenant labels)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields


@dataclass(slots=True)
class Counters:
    """Monotonic counters of one namespace. Mutated only by `PrefixCache`."""

    num_lookups: int = 0
    num_full_hits: int = 0  # the whole prompt served from the cache (no forward pass)
    num_partial_hits: int = 0
    num_misses: int = 0
    num_cached_tokens: int = 0  # tokens served by hits
    num_insertions: int = 0  # states stored (new keys and replacements)
    num_duplicate_insertions: int = 0  # key already cached; the existing entry was kept
    num_evictions: int = 0  # entries of this namespace evicted for room (by any namespace's insert)
    num_evicted_bytes: int = 0  # bytes those evictions freed
    num_logits_shed: int = 0  # entries that gave up their logits for room, keeping their KV (cache/room.py)
    num_logits_shed_bytes: int = 0  # bytes that freed
    num_rejected_too_large: int = 0  # a state larger than the whole budget
    num_rejected_no_room: int = 0  # everything evictable was pinned
    num_flushed: int = 0  # entries forgotten on request (`PrefixCache.flush`)


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot. `num_entries` / `num_bytes` are gauges (what is cached now), the rest counters.

    Per namespace, `num_bytes` counts storage shared inside the namespace once; aggregated, storage
    shared across namespaces also counts once, so the aggregate may be below the sum of namespaces."""

    num_lookups: int = 0
    num_full_hits: int = 0
    num_partial_hits: int = 0
    num_misses: int = 0
    num_cached_tokens: int = 0
    num_entries: int = 0
    num_bytes: int = 0
    num_insertions: int = 0
    num_duplicate_insertions: int = 0
    num_evictions: int = 0
    num_evicted_bytes: int = 0
    num_logits_shed: int = 0
    num_logits_shed_bytes: int = 0
    num_rejected_too_large: int = 0
    num_rejected_no_room: int = 0
    num_flushed: int = 0

    @property
    def num_hits(self) -> int:
        return self.num_full_hits + self.num_partial_hits

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_COUNTER_NAMES = tuple(f.name for f in fields(Counters))


def snapshot(counters: Iterable[Counters], num_entries: int, num_bytes: int) -> CacheStats:
    """Sum `counters` into a `CacheStats` with the given gauges. Pure."""
    totals = dict.fromkeys(_COUNTER_NAMES, 0)
    for c in counters:
        for name in _COUNTER_NAMES:
            totals[name] += getattr(c, name)
    return CacheStats(num_entries=num_entries, num_bytes=num_bytes, **totals)


def add_counters(a: Counters, b: Counters) -> Counters:
    """The field-wise sum of two sets of counters. Pure."""
    return Counters(**{name: getattr(a, name) + getattr(b, name) for name in _COUNTER_NAMES})
