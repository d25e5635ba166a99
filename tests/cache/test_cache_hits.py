"""What a lookup may serve: full vs partial hits, truncatable vs snapshot states, learning, replacing."""

from __future__ import annotations

import pytest
from cache_fakes import NS_A, NS_B, kv, make_cache, snap

from prefixserve.cache import Entry, Hit, InsertStatus, Miss, PrefixCache

SYS = (1, 2, 3, 4, 5, 6, 7, 8)
U1, U2, U3 = (20, 21, 22), (30, 31), (40, 41, 42, 43)


def only_entry(cache: PrefixCache, tokens: tuple[int, ...]) -> Entry:
    (entry,) = [e for e in cache.entries() if e.token_ids == tokens]
    return entry


# --- full vs partial ------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [kv, snap])
def test_exact_prompt_with_logits_is_a_full_hit(make) -> None:
    cache = make_cache()
    cache.insert(NS_A, SYS, make(SYS, logits=True))
    entry = only_entry(cache, SYS)
    assert cache.lookup(NS_A, SYS) == Hit(entry, 8, 8)
    assert cache.lookup(NS_A, list(SYS)) == Hit(entry, 8, 8)  # any sequence type
    stats = cache.stats_for(NS_A)
    assert (stats.num_full_hits, stats.num_partial_hits, stats.num_cached_tokens) == (2, 0, 16)


def test_exact_prompt_without_logits() -> None:
    cache = make_cache()
    cache.insert(NS_A, SYS, kv(SYS))
    # KV state: serve all but the last token, whose logits the engine must compute
    assert cache.lookup(NS_A, SYS) == Hit(only_entry(cache, SYS), 7, 8)
    cache = make_cache()
    cache.insert(NS_A, SYS, snap(SYS))
    assert cache.lookup(NS_A, SYS) == Miss(8)  # a snapshot cannot be cut back to 7 tokens
    cache.insert(NS_A, SYS[:5], snap(SYS[:5]))
    assert cache.lookup(NS_A, SYS) == Hit(only_entry(cache, SYS[:5]), 5, 8)


def test_prompt_inside_a_longer_entry() -> None:
    cache = make_cache()
    cache.insert(NS_A, SYS + U1, kv(SYS + U1, logits=True))
    assert cache.lookup(NS_A, SYS) == Hit(only_entry(cache, SYS + U1), 7, 8)
    cache = make_cache()
    cache.insert(NS_A, SYS + U1, snap(SYS + U1, logits=True))
    assert cache.lookup(NS_A, SYS) == Miss(8)


def test_diverging_entries() -> None:
    cache = make_cache()
    cache.insert(NS_A, SYS + U1, kv(SYS + U1, logits=True))
    assert cache.lookup(NS_A, SYS + U2) == Hit(only_entry(cache, SYS + U1), 8, 8)
    assert cache.lookup(NS_A, SYS[:3] + (99,)) == Hit(only_entry(cache, SYS + U1), 3, 3)
    assert cache.lookup(NS_A, (99,) + SYS) == Miss(0)
    cache = make_cache()
    cache.insert(NS_A, SYS + U1, snap(SYS + U1, logits=True))
    assert cache.lookup(NS_A, SYS + U2) == Miss(8)
    assert cache.lookup(NS_A, SYS + U1 + U2) == Hit(only_entry(cache, SYS + U1), 11, 11)


def test_one_token_prompt_needs_logits() -> None:
    cache = make_cache()
    cache.insert(NS_A, (7,), kv((7,)))
    assert cache.lookup(NS_A, (7,)) == Miss(1)  # 0 tokens would be served: that is a miss
    assert cache.lookup(NS_A, ()) == Miss(0)
    cache.insert(NS_A, (7,), kv((7,), logits=True))  # replaces: same key, now with logits
    assert cache.lookup(NS_A, (7,)) == Hit(only_entry(cache, (7,)), 1, 1)


def test_the_candidate_serving_most_tokens_wins() -> None:
    cache = make_cache()
    short_snap, long_kv = SYS[:3], SYS[:5] + (50, 51)
    cache.insert(NS_A, short_snap, snap(short_snap))
    cache.insert(NS_A, long_kv, kv(long_kv))
    assert cache.lookup(NS_A, SYS) == Hit(only_entry(cache, long_kv), 5, 5)  # kv lcp 5 > snapshot 3
    cache.insert(NS_A, SYS[:6], snap(SYS[:6]))
    assert cache.lookup(NS_A, SYS) == Hit(only_entry(cache, SYS[:6]), 6, 6)  # snapshot 6 > kv 5
    # tie at 5 tokens: the entry ending exactly there (no truncation) wins
    cache.insert(NS_A, SYS[:5], kv(SYS[:5]))
    assert cache.lookup(NS_A, SYS[:5] + (60,)) == Hit(only_entry(cache, SYS[:5]), 5, 5)
    stats = cache.stats_for(NS_A)
    assert (stats.num_lookups, stats.num_partial_hits, stats.num_cached_tokens) == (3, 3, 16)
    cache.check_integrity()


def test_hit_touches_the_entry() -> None:
    cache = make_cache(max_bytes=200)
    cache.insert(NS_A, SYS, kv(SYS, 100))
    cache.insert(NS_A, U1, kv(U1, 100))
    cache.lookup(NS_A, SYS + U2)
    cache.insert(NS_A, U2, kv(U2, 100))
    assert [e.token_ids for e in cache.entries()] == [SYS, U2]
    cache.lookup(NS_A, (99,))  # a miss touches nothing
    assert [e.token_ids for e in cache.entries()] == [SYS, U2]


# --- learning -------------------------------------------------------------------------------------


def test_learning_sequence_with_truncatable_states() -> None:
    cache = make_cache()
    p1, p2, p3 = SYS + U1, SYS + U2, SYS + U3
    assert cache.lookup(NS_A, p1) == Miss(0)  # request 1 seeds its full prompt
    cache.insert(NS_A, p1, kv(p1, logits=True))
    hit = cache.lookup(NS_A, p2)  # request 2: the shared system prompt is served
    assert hit == Hit(only_entry(cache, p1), len(SYS), len(SYS))
    cache.insert(NS_A, p2, kv(p2, logits=True))
    hit = cache.lookup(NS_A, p3)  # request 3: served at least the system prompt
    assert isinstance(hit, Hit) and hit.num_cached_tokens == len(SYS)
    assert cache.lookup(NS_A, p2) == Hit(only_entry(cache, p2), len(p2), len(p2))  # repeat: no forward
    cache.check_integrity()


def test_learning_sequence_with_snapshot_states() -> None:
    cache = make_cache()
    p1, p2, p3 = SYS + U1, SYS + U2, SYS + U3
    assert cache.lookup(NS_A, p1) == Miss(0)
    cache.insert(NS_A, p1, snap(p1, logits=True))
    assert cache.lookup(NS_A, p2) == Miss(len(SYS))  # nothing usable, but lcp says where to cut
    assert cache.insert(NS_A, SYS, snap(SYS)).status is InsertStatus.INSERTED  # the boundary entry
    cache.insert(NS_A, p2, snap(p2, logits=True))
    assert cache.lookup(NS_A, p3) == Hit(only_entry(cache, SYS), len(SYS), len(SYS))
    assert cache.lookup(NS_A, p1) == Hit(only_entry(cache, p1), len(p1), len(p1))
    stats = cache.stats_for(NS_A)
    assert (stats.num_lookups, stats.num_misses, stats.num_partial_hits, stats.num_full_hits) == (4, 2, 1, 1)
    assert (stats.num_entries, stats.num_insertions) == (3, 3)
    cache.check_integrity()


# --- duplicates, replacement ----------------------------------------------------------------------


def test_duplicate_insert_keeps_the_existing_entry() -> None:
    cache = make_cache()
    first = cache.insert(NS_A, SYS, kv(SYS, 100, logits=True)).entry
    result = cache.insert(NS_A, SYS, kv(SYS, 300))
    assert result.status is InsertStatus.ALREADY_PRESENT and result.entry is first
    assert cache.num_bytes == 100 and cache.num_entries == 1


def test_state_with_logits_replaces_one_without() -> None:
    cache = make_cache(max_bytes=300)
    old = cache.insert(NS_A, SYS, kv(SYS, 100)).entry
    cache.insert(NS_A, U1, kv(U1, 100))
    assert old is not None
    with cache.pinned(old):  # someone copies from it: keep it
        assert cache.insert(NS_A, SYS, kv(SYS, 150, logits=True)).status is InsertStatus.ALREADY_PRESENT
    result = cache.insert(NS_A, SYS, kv(SYS, 150, logits=True))
    cache.check_integrity()
    assert result.status is InsertStatus.REPLACED and result.num_evicted == 0
    assert not old.is_cached and result.entry is not None and result.entry.has_logits
    assert [e.token_ids for e in cache.entries()] == [U1, SYS]
    assert cache.num_bytes == 250
    result = cache.insert(NS_A, U1, kv(U1, 250, logits=True))  # needs SYS evicted too
    assert (result.status, result.num_evicted, result.num_evicted_bytes) == (InsertStatus.REPLACED, 1, 150)
    assert [e.token_ids for e in cache.entries()] == [U1] and cache.num_bytes == 250
    assert cache.stats_for(NS_A).num_insertions == 4
    cache.check_integrity()


# --- the rest of the API --------------------------------------------------------------------------


def test_clear_keeps_counters_and_tolerates_late_unpins() -> None:
    cache = make_cache()
    entry = cache.insert(NS_A, SYS, kv(SYS, 100)).entry
    cache.insert(NS_B, SYS, kv(SYS, 100))
    assert entry is not None
    cache.pin(entry)
    cache.clear()
    cache.check_integrity()
    assert (cache.num_entries, cache.num_bytes, entry.is_cached) == (0, 0, False)
    cache.unpin(entry)
    assert cache.lookup(NS_A, SYS) == Miss(0)
    stats = cache.stats()
    assert (stats.num_insertions, stats.num_evictions, stats.num_lookups) == (2, 0, 1)


def test_stats_aggregate_over_namespaces() -> None:
    cache = make_cache()
    cache.insert(NS_A, SYS, kv(SYS, 100, logits=True))
    cache.insert(NS_B, U1, kv(U1, 40, logits=True))
    cache.lookup(NS_A, SYS)
    cache.lookup(NS_A, SYS + U1)
    cache.lookup(NS_B, SYS)
    a, b, total = cache.stats_for(NS_A), cache.stats_for(NS_B), cache.stats()
    assert (a.num_lookups, a.num_full_hits, a.num_partial_hits, a.num_cached_tokens) == (2, 1, 1, 16)
    assert (b.num_lookups, b.num_misses, b.num_entries, b.num_bytes) == (1, 1, 1, 40)
    assert total.as_dict() == {
        "num_lookups": 3,
        "num_full_hits": 1,
        "num_partial_hits": 1,
        "num_misses": 1,
        "num_cached_tokens": 16,
        "num_entries": 2,
        "num_bytes": 140,
        "num_insertions": 2,
        "num_duplicate_insertions": 0,
        "num_evictions": 0,
        "num_evicted_bytes": 0,
        "num_logits_shed": 0,
        "num_logits_shed_bytes": 0,
        "num_rejected_too_large": 0,
        "num_rejected_no_room": 0,
        "num_flushed": 0,
    }
    assert total.num_hits == 2


def test_idle_namespaces_fold_into_the_aggregate() -> None:
    from prefixserve.cache.prefix_cache import MAX_IDLE_NAMESPACES
    from prefixserve.types import Namespace

    cache = make_cache()
    cache.insert(NS_A, SYS, kv(SYS))
    for i in range(MAX_IDLE_NAMESPACES + 10):
        cache.lookup(Namespace("model", "t", f"salt-{i}"), SYS)
    assert cache.stats().num_lookups == MAX_IDLE_NAMESPACES + 10
    assert cache.stats().num_misses == MAX_IDLE_NAMESPACES + 10
    assert cache.stats_for(NS_A).num_entries == 1  # namespaces with entries keep their own counters
    cache.check_integrity()


def test_states_that_break_the_contract_are_refused() -> None:
    cache = make_cache()
    with pytest.raises(ValueError):
        cache.insert(NS_A, SYS, kv(SYS[:3]))  # num_tokens != len(token_ids)
    with pytest.raises(ValueError):
        cache.insert(NS_A, (), kv(()))
    with pytest.raises(ValueError):
        cache.insert(NS_A, SYS, kv(SYS, 0, shared=[("k", 1), ("k", 1)]))  # duplicate storage key
    cache.insert(NS_A, SYS, kv(SYS, 0, shared=[("k", 10)]))
    with pytest.raises(ValueError):
        cache.insert(NS_A, U1, kv(U1, 0, shared=[("k", 11)]))  # same key, another size
    assert cache.num_entries == 1 and cache.num_bytes == 10
    cache.check_integrity()
