"""Snapshot-only states with resume points (a hybrid entry's recurrent checkpoints, docs/hybrid.md):
the index serves the deepest point within the prompt's common prefix, keeps its marks through edge
splits, merges and removals, and counts the points' storage like any other."""

from __future__ import annotations

import pytest
from cache_fakes import NS_A, NS_B, make_cache, snap

from prefixserve.cache import Hit, Miss

BASE = tuple(range(100, 300))  # 200 tokens


def test_the_deepest_point_within_the_common_prefix_serves() -> None:
    cache = make_cache()
    r1 = BASE + (1, 2, 3)
    cache.insert(NS_A, r1, snap(r1, logits=True, points=(64, 128, 192)))
    hit = cache.lookup(NS_A, BASE[:150] + (7,) * 60)  # lcp 150: the point at 128
    assert isinstance(hit, Hit) and (hit.num_cached_tokens, hit.lcp_len) == (128, 150)
    hit = cache.lookup(NS_A, BASE + (9,))  # lcp 200: 192
    assert isinstance(hit, Hit) and hit.num_cached_tokens == 192
    hit = cache.lookup(NS_A, BASE[:192])  # a point never serves the whole prompt (no logits there)
    assert isinstance(hit, Hit) and hit.num_cached_tokens == 128
    assert cache.lookup(NS_A, r1).num_cached_tokens == len(r1)  # type: ignore[union-attr]
    assert isinstance(cache.lookup(NS_A, BASE[:60] + (5,) * 9), Miss)  # lcp 60 < the first point
    assert isinstance(cache.lookup(NS_B, BASE + (9,)), Miss)  # another namespace sees nothing
    cache.check_integrity()


def test_an_entry_ending_at_a_point_wins_the_tie_and_a_deeper_one_beats_it() -> None:
    cache = make_cache()
    r1 = BASE + (1,)
    cache.insert(NS_A, r1, snap(r1, logits=True, points=(64, 128)))
    cache.insert(NS_A, BASE[:128], snap(BASE[:128]))
    hit = cache.lookup(NS_A, BASE[:150] + (4,))
    assert isinstance(hit, Hit) and hit.entry.num_tokens == 128 and hit.num_cached_tokens == 128
    cache.insert(NS_A, BASE[:100], snap(BASE[:100]))  # an entry shallower than the point
    hit = cache.lookup(NS_A, BASE[:150] + (4,))
    assert isinstance(hit, Hit) and hit.num_cached_tokens == 128
    cache.check_integrity()


def test_marks_survive_splits_merges_and_removals() -> None:
    cache = make_cache(100_000)
    a, b, c = BASE + (1,), BASE[:150] + (2,) * 60, BASE[:90] + (3,) * 50
    cache.insert(NS_A, a, snap(a, logits=True, points=(64, 128, 192)))
    cache.insert(NS_A, b, snap(b, logits=True, points=(64, 192)))  # splits a's edge at 150
    cache.insert(NS_A, c, snap(c, logits=True, points=(64,)))  # splits again at 90
    cache.check_integrity()
    assert cache.lookup(NS_A, b[:200] + (8,)).num_cached_tokens == 192  # type: ignore[union-attr]
    assert cache.lookup(NS_A, a[:195]).num_cached_tokens == 192  # type: ignore[union-attr]
    cache.discard(cache.get(NS_A, a))  # type: ignore[arg-type]
    cache.check_integrity()
    assert cache.lookup(NS_A, a[:195]).num_cached_tokens == 64  # type: ignore[union-attr]  # b's (64)
    cache.discard(cache.get(NS_A, b))  # type: ignore[arg-type]
    cache.discard(cache.get(NS_A, c))  # type: ignore[arg-type]
    cache.check_integrity()
    assert isinstance(cache.lookup(NS_A, a[:195]), Miss)


def test_points_storage_counts_once_and_a_state_too_large_is_refused() -> None:
    cache = make_cache(1_000)
    r1, r2 = BASE + (1,), BASE + (2,)
    ckpt = [("ckpt-64", 300)]  # one checkpoint's storage, held by two entries (a shared prefix)
    assert cache.insert(NS_A, r1, snap(r1, 200, logits=True, shared=ckpt, points=(64,))).stored
    assert cache.insert(NS_A, r2, snap(r2, 200, logits=True, shared=ckpt, points=(64,))).stored
    assert cache.num_bytes == 700
    cache.check_integrity()
    big = BASE + (3,)
    result = cache.insert(NS_A, big, snap(big, 900, logits=True, shared=[("ckpt-128", 200)], points=(128,)))
    assert result.status.value == "too_large" and cache.stats().num_rejected_too_large == 1
    cache.check_integrity()


@pytest.mark.parametrize("points", [(0,), (5, 5), (9, 3), (203,)])
def test_points_outside_the_state_are_refused(points: tuple[int, ...]) -> None:
    cache = make_cache()
    with pytest.raises(ValueError):
        cache.insert(NS_A, BASE + (1,), snap(BASE + (1,), points=points))

