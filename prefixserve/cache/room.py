"""What an insert takes from the cached entries to make room: a pure function of the eviction
order, the storage refcounts and the entries' lighter states.

Two kinds of bytes, two prices. An entry's logits (the fp32 scores of its last position, kept so a
prompt equal to its key needs no forward at all) save one token's forward, and only for a prompt
equal to the key; its KV saves the forward of every token it covers, for any prompt extending it.
So before any entry is evicted, the logits of unpinned truncatable entries no equal prompt has asked
for (`Entry.repeated`) are shed, in eviction order: such an entry keeps its KV and still serves any
prompt sharing its tokens (an equal prompt then has its last token computed: `cached_tokens` one
less, and the engine's insert of it with logits marks the new entry repeated). Repeated entries and
snapshot-only (hybrid) ones keep their logits until evicted: without them a hybrid's equal prompt
would fall back to an earlier resume point.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic

from prefixserve.cache.entry import Entry
from prefixserve.cache.state import S
from prefixserve.cache.storage import Pieces, StorageLedger


@dataclass(slots=True)
class Room(Generic[S]):
    """What to do, in this order: give each `shed` entry its lighter state, then evict `victims`."""

    shed: list[tuple[Entry[S], S]] = field(default_factory=list)
    victims: list[Entry[S]] = field(default_factory=list)


def lighter_state(entry: Entry[S]) -> S | None:
    """The entry's state without its logits, where that keeps it useful: an unpinned truncatable entry
    with logits, never asked for by an equal prompt, whose state offers `without_logits()`
    (CachedState). None otherwise."""
    if entry.num_pins or entry.repeated or not entry.truncatable or not entry.has_logits:
        return None
    without = getattr(entry.state, "without_logits", None)
    return None if without is None else without()


def plan_room(
    order: Iterable[Entry[S]],
    ledger: StorageLedger,
    budget: int,
    pieces: Pieces,
    replaced: Entry[S] | None,
    lighter: Callable[[Entry[S]], S | None] = lighter_state,
) -> Room[S] | None:
    """Room for `pieces` within `budget`: first entries' logits (`lighter`, in `order`), then whole
    unpinned entries in `order` (not counting `replaced`, which goes anyway); None if even all of it
    would not do. Does not mutate the cache (it may build lighter states)."""
    total = ledger.num_bytes + ledger.bytes_to_add(pieces)
    kept = {key for key, _ in pieces}  # stays counted whatever is evicted
    released: dict[Hashable, int] = {}

    def release(entry_pieces: Iterable[tuple[Hashable, int]]) -> int:
        freed = 0
        for key, nbytes in entry_pieces:
            count = released[key] = released.get(key, 0) + 1
            if count == ledger.refcount(key) and key not in kept:
                freed += nbytes
        return freed

    if replaced is not None:
        total -= release(replaced.pieces)
    room: Room[S] = Room()
    if total <= budget:
        return room
    entries = [e for e in order if e is not replaced]
    remaining: dict[int, set[Hashable]] = {}  # id(entry) -> the keys a shed entry still holds
    for entry in entries:
        state = lighter(entry)
        if state is None:
            continue
        keep = {key for key, _ in state.storage()}
        if not keep < {key for key, _ in entry.pieces}:
            continue  # a lighter state holds a proper subset of the entry's storage, or is no lighter
        room.shed.append((entry, state))
        remaining[id(entry)] = keep
        total -= release(p for p in entry.pieces if p[0] not in keep)
        if total <= budget:
            return room
    for entry in entries:
        if entry.num_pins:
            continue
        room.victims.append(entry)
        held = remaining.get(id(entry))
        total -= release(p for p in entry.pieces if held is None or p[0] in held)
        if total <= budget:
            return room
    return None
