"""Scenarios with exact expectations: eviction order, byte totals, sharing, isolation, hit rules."""

from __future__ import annotations

import pytest
from cache_fakes import NS_A, NS_A_OTHER_MODEL, NS_A_SALT, NS_B, FakeState, kv, make_cache, snap

from prefixserve.cache import Hit, InsertStatus, Miss, PrefixCache
from prefixserve.types import Namespace

SYS = (1, 2, 3, 4, 5, 6, 7, 8)  # a shared system prompt
U1, U2, U3 = (20, 21, 22), (30, 31), (40, 41, 42, 43)


def keys(cache: PrefixCache, ns: Namespace | None = None) -> list[tuple[int, ...]]:
    """Cached keys, least recently used first."""
    return [e.token_ids for e in cache.entries(ns)]


def put(cache: PrefixCache, ns: Namespace, state: FakeState, tokens: tuple[int, ...]) -> InsertStatus:
    status = cache.insert(ns, tokens, state).status
    cache.check_integrity()
    return status


# --- LRU and bytes --------------------------------------------------------------------------------


def test_lru_eviction_order_and_byte_totals() -> None:
    cache = make_cache(max_bytes=300)
    a, b, c, d = (1,), (2,), (3,), (4,)
    assert put(cache, NS_A, kv(a, 100), a) is InsertStatus.INSERTED
    assert cache.num_bytes == 100
    put(cache, NS_A, kv(b, 100), b)
    assert cache.num_bytes == 200
    put(cache, NS_B, kv(c, 100), c)  # another namespace, same global budget
    assert cache.num_bytes == 300
    assert keys(cache) == [a, b, c]

    hit = cache.lookup(NS_A, (1, 9))  # touches `a`
    assert isinstance(hit, Hit) and hit.entry.token_ids == a
    assert keys(cache) == [b, c, a]

    result = cache.insert(NS_A, d, kv(d, 100))
    cache.check_integrity()
    assert (result.status, result.num_evicted, result.num_evicted_bytes) == (InsertStatus.INSERTED, 1, 100)
    assert keys(cache) == [c, a, d]
    assert cache.num_bytes == 300

    e = (5, 5)
    result = cache.insert(NS_A, e, kv(e, 200))  # needs two victims: c (tenant b), then a
    cache.check_integrity()
    assert (result.num_evicted, result.num_evicted_bytes) == (2, 200)
    assert keys(cache) == [d, e]
    assert cache.num_bytes == 300
    assert cache.stats_for(NS_A).num_evictions == 2  # b, a
    assert cache.stats_for(NS_B).num_evictions == 1  # c, evicted by tenant a's insert
    assert cache.stats().num_evicted_bytes == 300

    assert cache.evict(0) == 0 and keys(cache) == [d, e]
    assert cache.evict(1) == 100 and keys(cache) == [e]
    assert cache.num_bytes == 200
    assert cache.evict(10_000) == 200 and keys(cache) == []
    assert cache.num_bytes == 0
    cache.check_integrity()
    with pytest.raises(ValueError):
        cache.evict(-1)


def test_insert_order_and_duplicate_insert_define_recency() -> None:
    cache = make_cache(max_bytes=300)
    for t in [(1,), (2,), (3,)]:
        put(cache, NS_A, kv(t, 100), t)
    assert put(cache, NS_A, kv((1,), 100), (1,)) is InsertStatus.ALREADY_PRESENT
    assert keys(cache) == [(2,), (3,), (1,)]
    assert cache.num_bytes == 300
    assert cache.stats_for(NS_A).num_duplicate_insertions == 1
    assert cache.stats_for(NS_A).num_insertions == 3
    put(cache, NS_A, kv((4,), 100), (4,))
    assert keys(cache) == [(3,), (1,), (4,)]


def test_shared_storage_counted_once_and_freed_with_its_last_holder() -> None:
    cache = make_cache(max_bytes=1000)
    shared = [("sys-kv", 100)]
    a, b = SYS + U1, SYS + U2
    put(cache, NS_A, kv(a, 50, shared=shared), a)
    assert cache.num_bytes == 150
    put(cache, NS_A, kv(b, 30, shared=shared), b)
    assert cache.num_bytes == 180  # not 280
    assert cache.stats_for(NS_A).num_bytes == 180
    assert cache.evict(1) == 50  # `a` goes; "sys-kv" is still held by `b`
    cache.check_integrity()
    assert keys(cache) == [b] and cache.num_bytes == 130
    assert cache.evict(1) == 130
    cache.check_integrity()
    assert cache.num_bytes == 0


def test_room_planning_counts_shared_storage() -> None:
    shared = [("sys-kv", 100)]
    cache = make_cache(max_bytes=200)
    put(cache, NS_A, kv((1,), 50, shared=shared), (1,))
    assert put(cache, NS_A, kv((2,), 30, shared=shared), (2,)) is InsertStatus.INSERTED  # 180, no eviction
    assert keys(cache) == [(1,), (2,)] and cache.num_bytes == 180
    result = cache.insert(NS_A, (3,), kv((3,), 60, shared=shared))  # 240 -> evict (1,): frees only 50
    cache.check_integrity()
    assert (result.num_evicted, result.num_evicted_bytes) == (1, 50)
    assert keys(cache) == [(2,), (3,)] and cache.num_bytes == 190

    # the only victim shares storage with the newcomer: evicting it frees just its private bytes
    cache = make_cache(max_bytes=150)
    put(cache, NS_A, kv((1,), 50, shared=shared), (1,))
    result = cache.insert(NS_A, (2,), kv((2,), 40, shared=shared))
    cache.check_integrity()
    assert (result.status, result.num_evicted_bytes) == (InsertStatus.INSERTED, 50)
    assert keys(cache) == [(2,)] and cache.num_bytes == 140


def test_storage_shared_across_namespaces_counts_once_in_the_aggregate() -> None:
    cache = make_cache()
    put(cache, NS_A, kv((1,), 10, shared=[("weights-view", 100)]), (1,))
    put(cache, NS_B, kv((1,), 20, shared=[("weights-view", 100)]), (1,))
    assert cache.stats_for(NS_A).num_bytes == 110
    assert cache.stats_for(NS_B).num_bytes == 120
    assert cache.stats().num_bytes == cache.num_bytes == 130


# --- budget edges ---------------------------------------------------------------------------------


def test_pinned_entries_are_never_evicted() -> None:
    cache = make_cache(max_bytes=200)
    a, b = (1,), (2,)
    put(cache, NS_A, kv(a, 100), a)
    put(cache, NS_A, kv(b, 100), b)
    entry_a = cache.entries()[0]
    with cache.pinned(entry_a):
        assert entry_a.num_pins == 1
        put(cache, NS_A, kv((3,), 100), (3,))  # evicts b, the LRU entry that is not pinned
        assert keys(cache) == [a, (3,)]
        entry_c = cache.entries()[1]
        cache.pin(entry_c)
        result = cache.insert(NS_A, (4,), kv((4,), 100))
        assert result.status is InsertStatus.NO_ROOM and result.entry is None
        assert keys(cache) == [a, (3,)] and cache.num_bytes == 200  # nothing evicted for nothing
        assert cache.evict(10_000) == 0
        cache.unpin(entry_c)
        assert cache.evict(10_000) == 100 and keys(cache) == [a]
        cache.check_integrity()
    assert entry_a.num_pins == 0
    assert cache.stats_for(NS_A).num_rejected_no_room == 1
    with pytest.raises(ValueError):
        cache.unpin(entry_a)
    assert cache.evict(1) == 100
    assert not entry_a.is_cached
    with pytest.raises(ValueError):
        cache.pin(entry_a)  # evicted: too late to pin


def test_entry_larger_than_budget_is_rejected_and_counted() -> None:
    cache = make_cache(max_bytes=100)
    put(cache, NS_A, kv((1,), 60), (1,))
    result = cache.insert(NS_A, (2,), kv((2,), 101))
    assert result.status is InsertStatus.TOO_LARGE and result.entry is None
    assert keys(cache) == [(1,)] and cache.num_bytes == 60  # nothing evicted for it
    assert cache.stats_for(NS_A).num_rejected_too_large == 1
    assert cache.stats().num_rejected_too_large == 1
    assert put(cache, NS_A, kv((3,), 100), (3,)) is InsertStatus.INSERTED  # exactly the budget fits
    assert keys(cache) == [(3,)] and cache.num_bytes == 100


def test_budget_zero_disables_caching() -> None:
    cache = make_cache(max_bytes=0)
    result = cache.insert(NS_A, SYS, kv(SYS, 1, logits=True))
    assert result.status is InsertStatus.DISABLED and not result.stored
    assert cache.lookup(NS_A, SYS) == Miss(0)
    assert cache.num_entries == 0 and cache.num_bytes == 0
    stats = cache.stats()
    assert (stats.num_lookups, stats.num_misses, stats.num_insertions) == (1, 1, 0)
    cache.check_integrity()


# --- isolation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("other", [NS_B, NS_A_SALT, NS_A_OTHER_MODEL])
def test_namespaces_are_isolated_both_ways(other: Namespace) -> None:
    cache = make_cache()
    put(cache, NS_A, kv(SYS + U1, logits=True), SYS + U1)
    assert cache.lookup(other, SYS + U1) == Miss(0)  # neither the entry nor its lcp leaks
    assert cache.lookup(other, SYS + U2) == Miss(0)
    put(cache, other, kv(SYS, logits=True), SYS)
    assert cache.lookup(NS_A, SYS) == Hit(cache.entries(NS_A)[0], len(SYS) - 1, len(SYS))
    hit = cache.lookup(other, SYS + U1)
    assert isinstance(hit, Hit) and hit.entry.namespace == other
    assert (hit.num_cached_tokens, hit.lcp_len) == (len(SYS), len(SYS))
    assert cache.stats_for(other).num_misses == 2 and cache.stats_for(NS_A).num_misses == 0
    cache.check_integrity()


def test_salted_and_unsalted_differ_only_in_salt() -> None:
    cache = make_cache()
    put(cache, NS_A_SALT, snap(SYS, logits=True), SYS)
    assert isinstance(cache.lookup(NS_A_SALT, SYS), Hit)
    assert cache.lookup(NS_A, SYS) == Miss(0)
    assert cache.lookup(Namespace("model", "tenant-a", "salt-2"), SYS) == Miss(0)
