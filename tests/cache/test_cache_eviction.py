"""`CacheConfig.eviction`: LRU stays the default; GDSF (cache/eviction.py) keeps every cache contract
(bytes, pins, namespaces, check_integrity) and evicts lowest priority first."""

from __future__ import annotations

import random

import pytest
from cache_fakes import NS_A, NS_B, kv

from prefixserve.cache import InsertStatus, PrefixCache
from prefixserve.cache.eviction import GDSFOrder, LRUOrder
from prefixserve.config import CacheConfig


def gdsf(max_bytes: int) -> PrefixCache:
    return PrefixCache(CacheConfig(max_bytes=max_bytes, eviction="gdsf"))


def test_lru_is_the_default_and_unknown_policies_are_refused() -> None:
    assert CacheConfig().eviction == "lru"
    assert type(PrefixCache(CacheConfig())._order) is LRUOrder  # recency order, as before
    with pytest.raises(ValueError, match="eviction"):
        CacheConfig(eviction="fifo")


def test_gdsf_keeps_the_entry_used_more_where_lru_drops_it() -> None:
    for policy, survivor in (("lru", (4, 5, 6)), ("gdsf", (1, 2, 3))):
        cache = PrefixCache(CacheConfig(max_bytes=250, eviction=policy))
        cache.insert(NS_A, (1, 2, 3), kv((1, 2, 3), 100))
        cache.lookup(NS_A, (1, 2, 3, 9))  # a second use of (1, 2, 3)
        cache.insert(NS_A, (4, 5, 6), kv((4, 5, 6), 100))  # newer, used once
        result = cache.insert(NS_A, (7, 8, 9), kv((7, 8, 9), 100))
        assert result.status is InsertStatus.INSERTED and result.num_evicted == 1
        assert cache.get(NS_A, survivor) is not None, policy
        cache.check_integrity()


def test_gdsf_priorities_and_clock() -> None:
    cache = gdsf(250)
    order = cache._order
    assert isinstance(order, GDSFOrder)
    a = cache.insert(NS_A, (1, 2, 3), kv((1, 2, 3), 100)).entry
    assert a is not None and order.priority(a) == pytest.approx(3 / 100)
    cache.lookup(NS_A, (1, 2, 3, 4))
    assert order.priority(a) == pytest.approx(2 * 3 / 100)
    b = cache.insert(NS_B, (5, 6, 7), kv((5, 6, 7), 100)).entry  # namespaces share one budget and order
    assert b is not None
    cache.insert(NS_A, (8, 9, 10), kv((8, 9, 10), 100))
    assert not b.is_cached and order.clock == pytest.approx(3 / 100)  # the clock is the victim's priority
    c = cache.get(NS_A, (8, 9, 10))
    assert c is not None and order.priority(c) == pytest.approx(3 / 100 + 3 / 100)  # inserted before the evict


def test_gdsf_ages_out_an_entry_no_longer_used() -> None:
    cache = gdsf(250)
    cache.insert(NS_A, (1, 2, 3), kv((1, 2, 3), 100))
    for _ in range(4):
        cache.lookup(NS_A, (1, 2, 3, 0))
    for i in range(12):  # a stream of new prompts, each used once
        key = (100 + i, 1, 2)
        cache.insert(NS_A, key, kv(key, 100))
        cache.check_integrity()
    assert cache.get(NS_A, (1, 2, 3)) is None  # the clock caught up with its 5 uses


def test_gdsf_prefers_to_keep_entries_cheaper_per_token() -> None:
    cache = gdsf(300)
    cache.insert(NS_A, (1,), kv((1,), 100))  # 1 token in 100 B
    cache.insert(NS_A, (2, 3, 4, 5), kv((2, 3, 4, 5), 100))  # 4 tokens in 100 B
    cache.insert(NS_A, (6, 7, 8, 9), kv((6, 7, 8, 9), 150))
    assert cache.get(NS_A, (1,)) is None and cache.get(NS_A, (2, 3, 4, 5)) is not None


def test_gdsf_skips_pinned_entries_and_evict_follows_the_order() -> None:
    cache = gdsf(1000)
    low = cache.insert(NS_A, (1,), kv((1,), 100)).entry
    high = cache.insert(NS_A, (2, 3, 4, 5), kv((2, 3, 4, 5), 100)).entry
    assert low is not None and high is not None
    with cache.pinned(low):
        assert cache.evict(1) == 100
        assert low.is_cached and not high.is_cached
    assert cache.evict(1) == 100 and not low.is_cached
    assert cache.num_bytes == 0
    cache.check_integrity()


def test_gdsf_counts_shared_storage_once_and_replaces_without_logits() -> None:
    cache = gdsf(1000)
    cache.insert(NS_A, (1, 2), kv((1, 2), 0, shared=[("sys", 200)]))
    cache.insert(NS_A, (1, 2, 3), kv((1, 2, 3), 50, shared=[("sys", 200)]))
    assert cache.num_bytes == 250
    result = cache.insert(NS_A, (1, 2), kv((1, 2), 10, logits=True, shared=[("sys", 200)]))
    assert result.status is InsertStatus.REPLACED and cache.num_bytes == 260
    cache.check_integrity()


def test_gdsf_random_operations_keep_every_invariant() -> None:
    rng = random.Random(7)
    cache = gdsf(600)
    pinned = []
    for step in range(2000):
        ns = rng.choice((NS_A, NS_B))
        key = tuple(rng.randrange(3) for _ in range(rng.randrange(1, 6)))
        op = rng.random()
        if op < 0.5:
            shared = [("s", 60)] if key[0] == 0 else []
            cache.insert(ns, key, kv(key, rng.choice((0, 40, 90, 200)), logits=rng.random() < 0.5, shared=shared))
        elif op < 0.8:
            hit = cache.lookup(ns, key)
            if getattr(hit, "entry", None) is not None and rng.random() < 0.2:
                cache.pin(hit.entry)  # type: ignore[union-attr]
                pinned.append(hit.entry)  # type: ignore[union-attr]
        elif op < 0.9 and pinned:
            cache.unpin(pinned.pop(rng.randrange(len(pinned))))
        elif op < 0.95:
            cache.evict(rng.randrange(300))
        elif op < 0.97:
            cache.flush(lambda n: n == NS_B)
        elif step % 500 == 0:
            cache.clear()  # pinned entries are dropped too; their holders may still unpin them
        cache.check_integrity()
        assert cache.num_bytes <= 600


def test_a_hit_on_the_head_of_an_entry_leaves_it_where_it_was_in_the_order() -> None:
    """LRU counts a use when a lookup serves all of an entry, or all of the prompt: a prompt that
    parts from an entry midway uses its head only, which the engine caches as a boundary entry of its
    own, so the entry's unused tail keeps aging (cache/eviction.py)."""
    cache = PrefixCache(CacheConfig(max_bytes=1000))
    long = cache.insert(NS_A, (1, 2, 3, 4, 5, 6), kv((1, 2, 3, 4, 5, 6), 100)).entry
    other = cache.insert(NS_A, (7, 8, 9), kv((7, 8, 9), 100)).entry
    assert long is not None and other is not None
    head = cache.lookup(NS_A, (1, 2, 3, 0, 0))  # parts at 3: served 3 of the entry's 6
    assert head.num_cached_tokens == 3 and cache.entries() == [long, other]
    whole = cache.lookup(NS_A, (1, 2, 3, 4, 5, 6, 0))  # served all of it
    assert whole.num_cached_tokens == 6 and cache.entries() == [other, long]
    cache.lookup(NS_A, (7, 8))  # the prompt is a prefix of the entry: all of the prompt but its last token
    assert cache.entries() == [long, other]
    cache.check_integrity()
