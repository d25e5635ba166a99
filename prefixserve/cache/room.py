"""What an insert takes from the cached entries to make room: a pure function of the eviction
order, the order of the entries whose logits may go, and the storage refcounts.

Two kinds of bytes, two prices. An entry's logits (the fp32 scores of its last position, kept so a
prompt equal to its key needs no forward at all) save one token's forward, and only for a prompt
equal to the key; its KV saves the forward of every token it covers, for any prompt extending it.
So before any entry is evicted, the logits of unpinned truncatable entries no equal prompt has asked
for (`Entry.repeated`) are shed, least recently used first (under either eviction policy): such an entry keeps its KV and still serves any
prompt sharing its tokens (an equal prompt then has its last token computed: `cached_tokens` one
less, and the engine's insert of it with logits marks the new entry repeated). Repeated entries and
snapshot-only (hybrid) ones keep their logits until evicted: without them a hybrid's equal prompt
would fall back to an earlier resume point.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic

from prefixserve.cache.entry import Entry
from prefixserve.cache.state import S
from prefixserve.cache.storage import Pieces, StorageLedger


@dataclass(frozen=True, slots=True)
class Shed(Generic[S]):
    """One entry's logits to shed: its lighter `state`, the pieces it keeps and those it gives up."""

    entry: Entry[S]
    state: S
    kept: Pieces
    dropped: Pieces


@dataclass(slots=True)
class Room(Generic[S]):
    """What to do, in this order: apply each `shed`, then evict `victims`."""

    shed: list[Shed[S]] = field(default_factory=list)
    victims: list[Entry[S]] = field(default_factory=list)


def sheddable(entry: Entry[S]) -> bool:
    """Whether the entry's logits may be shed (pins aside): a truncatable entry with logits, never
    asked for by an equal prompt, whose state offers `without_logits()` (CachedState). The cache
    keeps these in recency order (`PrefixCache`), so room is found without a walk over every entry."""
    return entry.truncatable and entry.has_logits and not entry.repeated and hasattr(entry.state, "without_logits")


def plan_room(
    order: Iterable[Entry[S]],
    ledger: StorageLedger,
    budget: int,
    pieces: Pieces,
    replaced: Entry[S] | None,
    shed_order: Iterable[Entry[S]] = (),
) -> Room[S] | None:
    """Room for `pieces` within `budget`: first the logits of the unpinned `sheddable` entries of
    `shed_order`, in that order, then whole unpinned entries in `order` (not counting `replaced`,
    which goes anyway); None if even all of it would not do. Does not mutate the cache (it builds
    lighter states). Walks only as far as it needs in each order."""
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
    remaining: dict[int, Pieces] = {}  # id(entry) -> the pieces a shed entry still holds
    for entry in shed_order:
        if entry.num_pins or entry is replaced or not sheddable(entry):
            continue
        state = entry.state.without_logits()  # type: ignore[attr-defined]  # sheddable() checked it
        keep = {key for key, _ in state.storage()}
        if not keep < {key for key, _ in entry.pieces}:
            continue  # a lighter state holds a proper subset of the entry's storage, or is no lighter
        shed = Shed(entry, state, tuple(p for p in entry.pieces if p[0] in keep),
                    tuple(p for p in entry.pieces if p[0] not in keep))
        room.shed.append(shed)
        remaining[id(entry)] = shed.kept
        total -= release(shed.dropped)
        if total <= budget:
            return room
    for entry in order:
        if entry.num_pins or entry is replaced:
            continue
        room.victims.append(entry)
        total -= release(remaining.get(id(entry), entry.pieces))
        if total <= budget:
            return room
    return None
