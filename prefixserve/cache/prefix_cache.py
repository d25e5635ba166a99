"""The cross-request prefix cache: exact keys, namespaces, one global LRU byte budget.

Threading: the engine drives the cache from its one loop thread; nothing here locks. A state may
be deep-copied on another thread only while its entry is pinned (pin and unpin on the engine thread).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic

from prefixserve.cache.entry import Entry, FlushResult, Hit, InsertResult, InsertStatus, Miss, resume_points
from prefixserve.cache.eviction import LRUOrder, make_order
from prefixserve.cache.index import RadixIndex, require
from prefixserve.cache.listener import CacheListener
from prefixserve.cache.room import Shed, plan_room, sheddable
from prefixserve.cache.state import S
from prefixserve.cache.stats import CacheStats, Counters, add_counters, snapshot
from prefixserve.cache.storage import StorageLedger, validate_pieces
from prefixserve.config import CacheConfig
from prefixserve.types import Namespace

# Namespaces that hold no entries keep their own counters until there are this many namespaces;
# then they are folded into one aggregate (salts are client-chosen, so namespaces are unbounded).
MAX_IDLE_NAMESPACES = 4096


@dataclass(slots=True)
class _Space(Generic[S]):
    """One namespace: its index, its bytes (shared storage once within it) and its counters."""

    index: RadixIndex[S] = field(default_factory=RadixIndex)
    ledger: StorageLedger = field(default_factory=StorageLedger)
    counters: Counters = field(default_factory=Counters)


class PrefixCache(Generic[S]):
    """Model states keyed by (namespace, exact token-id prefix), within `config.max_bytes` in all.

    Visibility is per namespace: a lookup sees only its own namespace's entries. Memory is global:
    an insert in one namespace may evict another's least recently used entries. Pinned entries are
    never evicted. Every method runs on the engine thread (see the module docstring). `listener`, if
    given, is told of every entry stored and removed (cache/listener.py; KV events, docs/gateway.md).
    """

    def __init__(self, config: CacheConfig, listener: CacheListener | None = None) -> None:
        self.config = config
        self.listener = listener
        self._spaces: dict[Namespace, _Space[S]] = {}
        self._lru: OrderedDict[Entry[S], None] = OrderedDict()  # least recently used first
        self._order: LRUOrder[S] = make_order(config.eviction, self._lru)  # keeps _lru; who goes first
        self._sheddable: OrderedDict[Entry[S], None] = OrderedDict()  # room.sheddable ones, least recently used first
        self._ledger = StorageLedger()  # all entries; shared storage once across namespaces
        self._retired = Counters()  # counters of idle namespaces folded away
        self._sweep_at = MAX_IDLE_NAMESPACES

    @property
    def num_bytes(self) -> int:
        """Bytes held by cached entries, shared storage counted once. Always <= config.max_bytes."""
        return self._ledger.num_bytes

    @property
    def num_entries(self) -> int:
        return len(self._lru)

    def lookup(self, ns: Namespace, token_ids: Sequence[int]) -> Hit[S] | Miss:
        """The entry serving the most tokens of the prompt `token_ids` in namespace `ns`.

        Mutates only recency (an entry that served all of itself, or the whole prompt, becomes most
        recently used: cache/eviction.py), the entry's `repeated` flag and counters; always safe to call.
        Usable: an entry whose key is a proper prefix of the prompt serves its length; one equal to
        the prompt serves all of it only if it has logits; a truncatable entry also serves its
        longest common prefix with the prompt, capped at len(prompt) - 1, a snapshot-only one its
        deepest resume point within that (CachedState, docs/hybrid.md). To copy the state, pin
        the entry (`pinned`) before returning to anything that could insert or evict.
        """
        counters = self._space(ns).counters
        counters.num_lookups += 1
        hit = self.peek(ns, token_ids)
        if not isinstance(hit, Hit):
            counters.num_misses += 1
            return hit
        if hit.num_cached_tokens >= min(hit.entry.num_tokens, len(token_ids) - 1):
            self._use(hit.entry)  # served whole, or the whole prompt: see cache/eviction.py
        if hit.entry.num_tokens == len(token_ids) and hit.entry.token_ids == tuple(token_ids):
            hit.entry.repeated = True  # its logits stay (cache/room.py)
            self._sheddable.pop(hit.entry, None)
        counters.num_cached_tokens += hit.num_cached_tokens
        if hit.num_cached_tokens == len(token_ids):
            counters.num_full_hits += 1
        else:
            counters.num_partial_hits += 1
        return hit

    def insert(self, ns: Namespace, token_ids: Sequence[int], state: S) -> InsertResult[S]:
        """Cache `state`, the model state after the prompt `token_ids`, in namespace `ns`.

        Mutates. On `stored`, the cache holds `state` and the caller must never mutate it again
        (copy it first if it will keep running). Makes room by shedding the logits of unpinned
        entries, then evicting unpinned entries, of any namespace, each in eviction order
        (cache/room.py), and changes nothing unless the state then fits. Tokens already
        cached: the existing entry is touched and kept, unless it lacks logits, the new state has
        them and no one pins the old one: then it is replaced. Raises ValueError if the state's
        `num_tokens` is not len(token_ids), token_ids is empty, or its storage breaks its contract.
        """
        key = token_ids if type(token_ids) is tuple else tuple(token_ids)
        if not key:
            raise ValueError("cannot cache a state of an empty prompt")
        if state.num_tokens != len(key):
            raise ValueError(f"state covers {state.num_tokens} tokens, the key has {len(key)}")
        space = self._space(ns)
        counters = space.counters
        if self.config.max_bytes == 0:
            return InsertResult(InsertStatus.DISABLED, None)
        old = space.index.get(key)
        if old is not None:
            self._use(old)
            if not (state.has_logits and not old.has_logits and old.num_pins == 0):
                counters.num_duplicate_insertions += 1
                return InsertResult(InsertStatus.ALREADY_PRESENT, old)
        nbytes = state.nbytes
        pieces = validate_pieces(state.storage(), nbytes, self._ledger)
        points = resume_points(state)
        if nbytes > self.config.max_bytes:
            counters.num_rejected_too_large += 1
            return InsertResult(InsertStatus.TOO_LARGE, old)
        room = plan_room(self._order.victims(), self._ledger, self.config.max_bytes, pieces, old, self._sheddable)
        if room is None:
            counters.num_rejected_no_room += 1
            return InsertResult(InsertStatus.NO_ROOM, old)
        # acquire first, so storage the newcomer shares with a victim is never counted as freed
        self._ledger.acquire(pieces)
        space.ledger.acquire(pieces)
        if old is not None:
            self._drop(old)
        for shed in room.shed:
            self._shed_logits(shed)
        victims = room.victims
        num_evicted_bytes = sum(self._evict_one(victim) for victim in victims)
        entry = Entry(ns, key, state, bool(state.truncatable), bool(state.has_logits), nbytes, pieces, points,
                      repeated=old is not None and old.repeated)
        space.index.add(entry)
        self._order.added(entry)
        if sheddable(entry):
            self._sheddable[entry] = None
        counters.num_insertions += 1
        if self.listener is not None:
            self.listener.stored(entry)
        status = InsertStatus.INSERTED if old is None else InsertStatus.REPLACED
        return InsertResult(status, entry, len(victims), num_evicted_bytes, tuple(victims))

    def entry_lengths(self, ns: Namespace, token_ids: Sequence[int]) -> list[int]:
        """Lengths of `ns`'s entries that are proper prefixes of `token_ids`, shortest first: where a
        new state's shared storage should have piece edges. Does not mutate (not even recency)."""
        space = self._spaces.get(ns)
        return [] if space is None else space.index.entry_lengths(tuple(token_ids))

    def get(self, ns: Namespace, token_ids: Sequence[int]) -> Entry[S] | None:
        """The entry keyed by exactly `token_ids` in `ns`, or None. Does not mutate."""
        space = self._spaces.get(ns)
        return None if space is None else space.index.get(tuple(token_ids))

    def best_len(self, ns: Namespace, token_ids: Sequence[int]) -> int:
        """How many tokens `lookup` would serve now (whether a lower tier holds more). Does not mutate."""
        hit = self.peek(ns, token_ids)
        return hit.num_cached_tokens if isinstance(hit, Hit) else 0

    def peek(self, ns: Namespace, token_ids: Sequence[int]) -> Hit[S] | Miss:
        """What `lookup` returns, without counting or touching recency. Does not mutate."""
        space = self._spaces.get(ns)
        if space is None or space.index.num_entries == 0:
            return Miss(0)
        match = space.index.match(token_ids if type(token_ids) is tuple else tuple(token_ids))
        return Miss(match.lcp_len) if match.entry is None else Hit(match.entry, match.num_cached_tokens, match.lcp_len)

    def evict(self, num_bytes: int) -> int:
        """Evict least recently used unpinned entries until at least `num_bytes` are freed or none
        is left; return the bytes freed (entries sharing storage may free less each). Mutates.
        `evict(0)` does nothing. Raises ValueError on a negative amount."""
        if num_bytes < 0:
            raise ValueError("num_bytes must be >= 0")
        freed = 0
        while freed < num_bytes:
            victim = next((e for e in self._order.victims() if e.num_pins == 0), None)
            if victim is None:
                break
            freed += self._evict_one(victim)
        return freed

    def discard(self, entry: Entry[S]) -> int:
        """Forget one entry (pinned or not) if it is still cached; return the bytes freed. Mutates;
        not counted as an eviction. For a lower tier dropping a file found corrupt."""
        return self._drop(entry) if entry.is_cached else 0

    def pin(self, entry: Entry[S]) -> None:
        """Keep `entry` from eviction until a matching `unpin`. Pins nest. Raises ValueError if the
        entry is no longer cached (pin right after the lookup, before anything can evict it)."""
        if not entry.is_cached:
            raise ValueError(f"{entry} is not cached")
        entry.num_pins += 1

    def unpin(self, entry: Entry[S]) -> None:
        """Release one `pin`. Safe on an entry dropped by `clear` meanwhile. Raises ValueError if the
        entry is not pinned."""
        if entry.num_pins <= 0:
            raise ValueError(f"{entry} is not pinned")
        entry.num_pins -= 1

    @contextmanager
    def pinned(self, entry: Entry[S]) -> Iterator[Entry[S]]:
        """`with cache.pinned(hit.entry) as entry: copy entry.state` — pin for the block's duration."""
        self.pin(entry)
        try:
            yield entry
        finally:
            self.unpin(entry)

    def entries(self, ns: Namespace | None = None) -> list[Entry[S]]:
        """Cached entries (of `ns`, or all), least recently used first. Does not mutate."""
        return [e for e in self._lru if ns is None or e.namespace == ns]

    def stats(self) -> CacheStats:
        """Counters summed over all namespaces, bytes with shared storage once. For public metrics."""
        counters = [space.counters for space in self._spaces.values()]
        return snapshot([*counters, self._retired], len(self._lru), self._ledger.num_bytes)

    def stats_for(self, ns: Namespace) -> CacheStats:
        """One namespace's counters and gauges (zeros once an idle namespace has been folded away)."""
        space = self._spaces.get(ns)
        if space is None:
            return CacheStats()
        return snapshot([space.counters], space.index.num_entries, space.ledger.num_bytes)

    def flush(self, selects: Callable[[Namespace], bool]) -> FlushResult:
        """Forget every entry of every namespace `selects` returns True for, pinned ones included:
        from now on no lookup returns them (a session already copying from one keeps its object and
        may still unpin it). Mutates; counted as `num_flushed`, not as evictions. Always safe
        (nothing selected: nothing changes). The caller (the engine thread) decides who may flush
        what; the cache only forgets."""
        victims = [e for e in self._lru if selects(e.namespace)]
        freed = 0
        for entry in victims:
            self._spaces[entry.namespace].counters.num_flushed += 1
            freed += self._drop(entry)
        return FlushResult(len(victims), freed)

    def clear(self) -> None:
        """Drop every entry, pinned ones included (holders keep their objects and may still unpin).
        Counters are kept; the drops are not counted as evictions. Mutates."""
        for entry in self._lru:
            entry.is_cached = False
            entry.node = None
        self._order.clear()
        self._sheddable.clear()
        self._ledger = StorageLedger()
        for space in self._spaces.values():
            space.index = RadixIndex()
            space.ledger = StorageLedger()
        if self.listener is not None:
            self.listener.cleared()

    def check_integrity(self) -> None:
        """Assert every invariant: each namespace's tree is sound and holds exactly that namespace's
        entries in the LRU; byte totals and storage refcounts match the entries (shared storage
        once, globally and per namespace); the budget holds; pin counts are >= 0. Does not mutate.
        Costs O(cached tokens): for tests and debugging."""
        max_bytes = self.config.max_bytes
        require(self._ledger.num_bytes <= max_bytes, f"{self._ledger.num_bytes} B over budget {max_bytes}")
        by_space: dict[Namespace, list[Entry[S]]] = {}
        for entry in self._lru:
            require(entry.is_cached and entry.node is not None, f"{entry} in the LRU but not indexed")
            require(entry.num_pins >= 0, f"{entry} has a negative pin count")
            require(entry.nbytes == sum(n for _, n in entry.pieces), f"{entry} nbytes != its pieces")
            require(entry.namespace in self._spaces, f"{entry} belongs to an unknown namespace")
            by_space.setdefault(entry.namespace, []).append(entry)
        self._ledger.check(entry.pieces for entry in self._lru)
        self._order.check()
        require(list(self._sheddable) == [e for e in self._lru if e in self._sheddable]
                and set(self._sheddable) == {e for e in self._lru if sheddable(e)},
                "the sheddable entries are not exactly those room.sheddable accepts, in recency order")
        for ns, space in self._spaces.items():
            space.index.check()
            members = by_space.get(ns, [])
            require(
                {id(e) for e in space.index.entries()} == {id(e) for e in members},
                f"index of {ns} disagrees with the LRU",
            )
            space.ledger.check(entry.pieces for entry in members)

    def _space(self, ns: Namespace) -> _Space[S]:
        space = self._spaces.get(ns)
        if space is None:
            if len(self._spaces) >= self._sweep_at:
                self._fold_idle_namespaces()
            space = self._spaces[ns] = _Space()
        return space

    def _fold_idle_namespaces(self) -> None:
        """Fold the counters of namespaces without entries into `_retired`; amortised O(1) per call
        of `_space` because the next sweep waits until the namespace count doubles."""
        for ns in [ns for ns, space in self._spaces.items() if space.index.num_entries == 0]:
            retired = self._spaces.pop(ns).counters
            self._retired = add_counters(self._retired, retired)
        self._sweep_at = max(MAX_IDLE_NAMESPACES, 2 * len(self._spaces))

    def _use(self, entry: Entry[S]) -> None:
        """`entry` was used: most recently used in the eviction order and among the sheddable."""
        self._order.used(entry)
        if entry in self._sheddable:
            self._sheddable.move_to_end(entry)

    def _shed_logits(self, shed: Shed[S]) -> int:
        """Give a cached entry its state without logits (cache/room.py); return the bytes freed. The
        entry keeps its key, place in the order and KV; the old state object is left as it was."""
        entry = shed.entry
        self._spaces[entry.namespace].ledger.release(shed.dropped)
        self._sheddable.pop(entry, None)
        entry.state = shed.state
        entry.has_logits = bool(shed.state.has_logits)
        entry.pieces = shed.kept
        entry.nbytes = sum(n for _, n in shed.kept)
        freed = self._ledger.release(shed.dropped)
        counters = self._spaces[entry.namespace].counters
        counters.num_logits_shed += 1
        counters.num_logits_shed_bytes += freed
        return freed

    def _evict_one(self, entry: Entry[S]) -> int:
        self._order.evicted(entry)
        freed = self._drop(entry)
        counters = self._spaces[entry.namespace].counters
        counters.num_evictions += 1
        counters.num_evicted_bytes += freed
        return freed

    def _drop(self, entry: Entry[S]) -> int:
        """Remove a cached entry from index, LRU and ledgers; return the global bytes freed."""
        space = self._spaces[entry.namespace]
        space.index.remove(entry)
        space.ledger.release(entry.pieces)
        self._order.dropped(entry)
        self._sheddable.pop(entry, None)
        entry.is_cached = False
        if self.listener is not None:
            self.listener.removed(entry)
        return self._ledger.release(entry.pieces)
