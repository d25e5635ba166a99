"""Which entries an insert evicts: a pure function of the LRU order and the storage refcounts."""

from __future__ import annotations

from collections.abc import Iterable

from prefixserve.cache.entry import Entry
from prefixserve.cache.state import S
from prefixserve.cache.storage import Pieces, StorageLedger


def plan_room(
    lru: Iterable[Entry[S]], ledger: StorageLedger, budget: int, pieces: Pieces, replaced: Entry[S] | None
) -> list[Entry[S]] | None:
    """The LRU-first unpinned entries (not counting `replaced`, which goes anyway) whose removal
    lets `pieces` fit the budget, or None if no choice does. Does not mutate."""
    total = ledger.num_bytes + ledger.bytes_to_add(pieces)
    kept = {key for key, _ in pieces}  # stays counted whatever is evicted
    released: dict[object, int] = {}

    def release(entry: Entry[S]) -> int:
        freed = 0
        for key, nbytes in entry.pieces:
            count = released[key] = released.get(key, 0) + 1
            if count == ledger.refcount(key) and key not in kept:
                freed += nbytes
        return freed

    if replaced is not None:
        total -= release(replaced)
    victims: list[Entry[S]] = []
    if total <= budget:
        return victims
    for entry in lru:
        if entry.num_pins or entry is replaced:
            continue
        victims.append(entry)
        total -= release(entry)
        if total <= budget:
            return victims
    return None

