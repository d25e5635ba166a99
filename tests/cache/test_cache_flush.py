"""`PrefixCache.flush`: forgetting namespaces, pinned entries included, with exact byte counts."""

from __future__ import annotations

from cache_fakes import NS_A, NS_A_SALT, NS_B, kv, make_cache

from prefixserve.cache import FlushResult, Hit, Miss
from prefixserve.types import FlushScope

SYS = (1, 2, 3, 4, 5, 6, 7, 8)
U1 = (20, 21, 22)


def test_flush_one_tenant_keeps_the_others_and_counts_shared_bytes_once() -> None:
    cache = make_cache()
    cache.insert(NS_A, SYS, kv(SYS, 100, shared=[("sys-a", 50)]))
    cache.insert(NS_A, SYS + U1, kv(SYS + U1, 30, logits=True, shared=[("sys-a", 50)]))
    cache.insert(NS_A_SALT, SYS, kv(SYS, 70))
    cache.insert(NS_B, SYS, kv(SYS, 40))
    cache.check_integrity()
    assert cache.num_bytes == 100 + 30 + 50 + 70 + 40

    result = cache.flush(FlushScope("tenant-a", "").selects)  # only the unsalted namespace
    cache.check_integrity()
    assert result == FlushResult(num_entries=2, num_bytes=180)  # the shared 50 once
    assert isinstance(cache.lookup(NS_A, SYS + U1), Miss)
    assert isinstance(cache.lookup(NS_A_SALT, SYS + U1), Hit)
    assert isinstance(cache.lookup(NS_B, SYS + U1), Hit)
    assert [e.namespace for e in cache.entries()] == [NS_A_SALT, NS_B]
    assert cache.stats_for(NS_A).num_flushed == 2 and cache.stats().num_evictions == 0

    assert cache.flush(FlushScope("tenant-a").selects) == FlushResult(1, 70)  # every salt of a
    assert cache.flush(FlushScope("tenant-a").selects) == FlushResult(0, 0)  # nothing left: no-op
    assert cache.flush(FlushScope().selects) == FlushResult(1, 40)  # everyone
    cache.check_integrity()
    assert (cache.num_entries, cache.num_bytes) == (0, 0)


def test_a_pinned_entry_is_forgotten_too_and_never_served_again() -> None:
    cache = make_cache()
    cache.insert(NS_A, SYS, kv(SYS, 100, logits=True))
    hit = cache.lookup(NS_A, SYS)
    assert isinstance(hit, Hit)
    cache.pin(hit.entry)  # a session is copying from it
    assert cache.flush(FlushScope("tenant-a").selects) == FlushResult(1, 100)
    cache.check_integrity()
    assert hit.entry.is_cached is False
    assert cache.lookup(NS_A, SYS) == Miss(0)
    cache.unpin(hit.entry)  # the holder finishes its copy; still safe
    cache.check_integrity()
    assert cache.num_bytes == 0
