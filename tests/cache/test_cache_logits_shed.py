"""Logits go before KV (cache/room.py): an insert that needs room first sheds the logits of unpinned
KV entries, in eviction order, and evicts whole entries only when that is not enough."""

from __future__ import annotations

from cache_fakes import NS_A, NS_B, kv, make_cache, snap

from prefixserve.cache import Hit, InsertStatus


def test_logits_are_shed_before_any_entry_is_evicted() -> None:
    cache = make_cache(max_bytes=600)
    a = cache.insert(NS_A, (1, 2, 3), kv((1, 2, 3), 100, logits_bytes=150)).entry
    b = cache.insert(NS_B, (4, 5, 6), kv((4, 5, 6), 100, logits_bytes=150)).entry
    assert a is not None and b is not None and cache.num_bytes == 500
    result = cache.insert(NS_A, (7, 8, 9), kv((7, 8, 9), 200))  # needs 100 B: a's logits (least recent)
    assert result.status is InsertStatus.INSERTED and result.num_evicted == 0
    assert a.is_cached and not a.has_logits and a.nbytes == 100 and b.has_logits
    assert cache.num_bytes == 550
    stats = cache.stats()
    assert (stats.num_logits_shed, stats.num_logits_shed_bytes, stats.num_evictions) == (1, 150, 0)
    cache.check_integrity()
    # the shed entry still serves its tokens; an equal prompt gets all but its last one
    hit = cache.lookup(NS_A, (1, 2, 3))
    assert isinstance(hit, Hit) and hit.entry is a and hit.num_cached_tokens == 2
    hit = cache.lookup(NS_A, (1, 2, 3, 4))
    assert isinstance(hit, Hit) and hit.num_cached_tokens == 3
    full = cache.lookup(NS_B, (4, 5, 6))  # the other kept its logits: no forward at all
    assert isinstance(full, Hit) and full.num_cached_tokens == 3


def test_every_unpinned_logits_piece_goes_before_the_first_entry() -> None:
    cache = make_cache(max_bytes=700)
    old = cache.insert(NS_A, (1,), kv((1,), 100, logits_bytes=100)).entry
    new = cache.insert(NS_A, (2,), kv((2,), 100, logits_bytes=100)).entry
    plain = cache.insert(NS_A, (3,), kv((3,), 200)).entry
    assert old is not None and new is not None and plain is not None and cache.num_bytes == 600
    result = cache.insert(NS_A, (4,), kv((4,), 250))  # 150 over: both logits (200), no entry
    assert result.num_evicted == 0 and not old.has_logits and not new.has_logits
    result = cache.insert(NS_A, (5,), kv((5,), 150))  # no logits left: the least recently used entry goes
    assert result.evicted == (old,) and cache.stats().num_logits_shed == 2
    cache.check_integrity()


def test_pinned_and_snapshot_only_entries_keep_their_logits() -> None:
    cache = make_cache(max_bytes=500)
    pinned = cache.insert(NS_A, (1, 2), kv((1, 2), 100, logits_bytes=100)).entry
    hybrid = cache.insert(NS_A, (3, 4), snap((3, 4), 100, logits=True)).entry
    assert pinned is not None and hybrid is not None
    cache.pin(pinned)
    result = cache.insert(NS_A, (5, 6), kv((5, 6), 250))  # 50 over: the hybrid entry goes whole
    assert result.evicted == (hybrid,) and pinned.has_logits and pinned.nbytes == 200
    cache.unpin(pinned)
    cache.check_integrity()


def test_nothing_is_shed_when_the_insert_cannot_fit_anyway() -> None:
    cache = make_cache(max_bytes=400)
    a = cache.insert(NS_A, (1,), kv((1,), 100, logits_bytes=100)).entry
    b = cache.insert(NS_A, (2,), kv((2,), 150)).entry
    assert a is not None and b is not None
    cache.pin(b)
    result = cache.insert(NS_A, (3,), kv((3,), 300))  # even a gone whole leaves 450 > 400
    assert result.status is InsertStatus.NO_ROOM
    assert a.has_logits and a.nbytes == 200 and cache.num_bytes == 350 and cache.stats().num_logits_shed == 0
    cache.check_integrity()


def test_an_equal_prompt_with_logits_gives_them_back() -> None:
    """After a shed, the engine computes the last token of an equal prompt and inserts the state with
    logits: it replaces the lighter entry, so a repeated prompt is again served whole."""
    cache = make_cache(max_bytes=400)
    cache.insert(NS_A, (1, 2), kv((1, 2), 100, logits_bytes=100))
    cache.insert(NS_A, (3, 4), kv((3, 4), 150))  # 350: fits
    cache.insert(NS_A, (5, 6), kv((5, 6), 100))  # 450 > 400: (1, 2) sheds its logits
    shed = cache.get(NS_A, (1, 2))
    assert shed is not None and not shed.has_logits
    result = cache.insert(NS_A, (1, 2), kv((1, 2), 100, logits_bytes=50))
    assert result.status is InsertStatus.REPLACED and result.entry is not None and result.entry.has_logits
    hit = cache.lookup(NS_A, (1, 2))
    assert isinstance(hit, Hit) and hit.num_cached_tokens == 2
    cache.check_integrity()


def test_an_entry_an_equal_prompt_asked_for_keeps_its_logits() -> None:
    """A prompt repeated whole (the same request again, a retry) keeps being served with no forward,
    however recently it was used relative to entries whose logits are shed."""
    cache = make_cache(max_bytes=500)
    hot = cache.insert(NS_A, (1, 2), kv((1, 2), 100, logits_bytes=100)).entry
    cold = cache.insert(NS_A, (3, 4), kv((3, 4), 100, logits_bytes=100)).entry
    assert hot is not None and cold is not None
    full = cache.lookup(NS_A, (1, 2))
    assert isinstance(full, Hit) and full.num_cached_tokens == 2 and hot.repeated and not cold.repeated
    cache.lookup(NS_A, (3, 4, 5))  # extends cold: its KV is used, its logits are not
    cache.insert(NS_A, (6, 7), kv((6, 7), 150))  # 550 > 500: cold's logits go although hot is older
    assert hot.has_logits and not cold.has_logits and cold.is_cached
    cache.insert(NS_A, (8, 9), kv((8, 9), 100))  # nothing left to shed: hot, least recently used, goes whole
    assert not hot.is_cached and cold.is_cached
    cache.check_integrity()


def test_room_is_planned_without_a_walk_over_every_entry() -> None:
    """The cache hands `plan_room` its sheddable entries apart (recency order): an insert that one
    shed makes room for reads neither the entries before it nor the eviction order."""
    from prefixserve.cache.room import plan_room

    cache = make_cache(max_bytes=100 * 100 + 250 + 50)  # full but for 50 B
    for i in range(100):  # entries with nothing to shed, least recently used
        cache.insert(NS_A, (i, 0), kv((i, 0), 100))
    recent = cache.insert(NS_A, (7, 7, 7), kv((7, 7, 7), 100, logits_bytes=150)).entry
    assert recent is not None and list(cache._sheddable) == [recent]
    walked: list[object] = []

    def counted(entries):
        for entry in entries:
            walked.append(entry)
            yield entry

    room = plan_room(counted(cache._order.victims()), cache._ledger, cache.config.max_bytes,
                     ((("new", 1), 100),), None, counted(cache._sheddable))
    assert room is not None and [s.entry for s in room.shed] == [recent] and room.victims == []
    assert walked == [recent]
    result = cache.insert(NS_B, (1,), kv((1,), 100))
    assert result.num_evicted == 0 and not recent.has_logits and list(cache._sheddable) == []
    cache.check_integrity()
