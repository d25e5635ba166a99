"""Which unpinned entry goes first when the byte budget needs room (`CacheConfig.eviction`).

- `lru` (the default): least recently used first. An entry is used when a lookup serves all of it
  (or all of the prompt but the last token, which is then computed) or an insert finds its key
  already cached. A lookup that serves only the head of a longer entry, where the prompt parts from
  it, does not make the entry recent: the engine then caches the part that was used as a boundary
  entry and the new prompt, which share the head's KV pieces (docs/cache.md), so the head stays
  while the unused tail ages out. A radix cache's leaf-first LRU does the same at block grain; on
  the Mooncake trace this raised the hit rate at 25% of the working set from 0.93x Belady's to
  0.98x (docs/cache.md, "Eviction").
- `gdsf` (Greedy-Dual-Size-Frequency, Cherkasova 1998): lowest priority first, where an entry's
  priority is `clock + uses x num_tokens / nbytes`, set when it is inserted or used; `uses` counts
  the insert and every use; `clock` is the priority of the last entry evicted (it only grows, so an
  entry not used for long ages out). Recompute cost is taken as proportional to tokens and size is
  the entry's bytes (logits included), so among equally used entries the smaller per token (long
  ones, whose fixed logits weigh less) stay; ties go least recently used first.

An order tracks the entries the owning `PrefixCache` holds: the cache reports each insert
(`added`), use (`used`), eviction for room (`evicted`, before `dropped`) and drop for any reason
(`dropped`), and asks `victims` for the order in which `plan_room` and `evict` may pick. Not
thread-safe (the engine thread drives the cache).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Generic

from prefixserve.cache.entry import Entry
from prefixserve.cache.state import S

EVICTION_POLICIES = ("lru", "gdsf")


class LRUOrder(Generic[S]):
    """Least recently used first. Owns the mutations of the cache's recency order `recency` (least
    recently used first), which the cache reads for its other walks."""

    def __init__(self, recency: OrderedDict[Entry[S], None]) -> None:
        self.recency = recency

    def added(self, entry: Entry[S]) -> None:
        self.recency[entry] = None

    def used(self, entry: Entry[S]) -> None:
        self.recency.move_to_end(entry)

    def evicted(self, entry: Entry[S]) -> None:
        """`entry` is about to be dropped to make room (`dropped` follows)."""

    def dropped(self, entry: Entry[S]) -> None:
        del self.recency[entry]

    def clear(self) -> None:
        self.recency.clear()

    def victims(self) -> Iterable[Entry[S]]:
        """Every cached entry, in the order eviction may take them (pins are the caller's business).
        Does not mutate; do not mutate the cache while iterating."""
        return self.recency

    def check(self) -> None:
        """Assert that the order tracks exactly the cached entries (those in `recency`)."""


class GDSFOrder(LRUOrder[S]):
    """Greedy-Dual-Size-Frequency (module docstring)."""

    def __init__(self, recency: OrderedDict[Entry[S], None]) -> None:
        super().__init__(recency)
        self.clock = 0.0
        self._uses: dict[Entry[S], int] = {}
        self._priority: dict[Entry[S], float] = {}

    def added(self, entry: Entry[S]) -> None:
        super().added(entry)
        self._uses[entry] = 0
        self.used(entry)

    def used(self, entry: Entry[S]) -> None:
        super().used(entry)
        uses = self._uses[entry] = self._uses[entry] + 1
        self._priority[entry] = self.clock + uses * entry.num_tokens / max(1, entry.nbytes)

    def evicted(self, entry: Entry[S]) -> None:
        self.clock = max(self.clock, self._priority[entry])

    def dropped(self, entry: Entry[S]) -> None:
        super().dropped(entry)
        del self._uses[entry]
        del self._priority[entry]

    def clear(self) -> None:
        super().clear()
        self._uses.clear()
        self._priority.clear()

    def priority(self, entry: Entry[S]) -> float:
        return self._priority[entry]

    def victims(self) -> Iterable[Entry[S]]:
        """Lowest priority first, ties least recently used first (a stable sort of the recency
        order): O(n log n) in the cached entries, paid only by an insert that must evict."""
        return sorted(self.recency, key=self._priority.__getitem__)

    def check(self) -> None:
        if self._priority.keys() != self.recency.keys() or self._uses.keys() != self.recency.keys():
            raise AssertionError("the GDSF order does not track exactly the cached entries")
        if any(p < 0 for p in self._priority.values()) or any(u < 1 for u in self._uses.values()):
            raise AssertionError("a GDSF priority < 0 or use count < 1")


def make_order(policy: str, recency: OrderedDict[Entry[S], None]) -> LRUOrder[S]:
    """The order for `CacheConfig.eviction` over the cache's recency dict; ValueError for an unknown
    policy."""
    if policy == "lru":
        return LRUOrder(recency)
    if policy == "gdsf":
        return GDSFOrder(recency)
    raise ValueError(f"unknown eviction policy {policy!r}; one of {', '.join(EVICTION_POLICIES)}")
