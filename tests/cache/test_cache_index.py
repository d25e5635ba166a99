"""The radix index alone: tree shape after splits and removals, and the pure lcp helper."""

from __future__ import annotations

from cache_fakes import NS_A, kv, snap

from prefixserve.cache.entry import Entry
from prefixserve.cache.index import Node, RadixIndex, _common_len


def entry(tokens: tuple[int, ...], truncatable: bool = True) -> Entry:
    state = (kv if truncatable else snap)(tokens, 1)
    return Entry(NS_A, tokens, state, truncatable, False, 1, tuple(state.pieces))


Shape = dict[tuple[int, ...], tuple[bool, "Shape"]]


def shape(index: RadixIndex) -> Shape:
    """{edge: (holds an entry, {child edge: ...})} from the root."""

    def children(node: Node) -> Shape:
        return {c.edge: (c.entry is not None, children(c)) for c in node.children.values()}

    return children(index.root)


def test_split_and_merge_keep_the_tree_compressed() -> None:
    index = RadixIndex()
    abcd, abxy, ab = entry((1, 2, 3, 4)), entry((1, 2, 8, 9), truncatable=False), entry((1, 2))
    index.add(abcd)
    assert shape(index) == {(1, 2, 3, 4): (True, {})}
    index.add(abxy)  # splits the edge after (1, 2)
    assert shape(index) == {(1, 2): (False, {(3, 4): (True, {}), (8, 9): (True, {})})}
    index.add(ab)  # lands on the split node
    assert shape(index) == {(1, 2): (True, {(3, 4): (True, {}), (8, 9): (True, {})})}
    assert (index.root.num_truncatable, index.check()) == (2, 3)
    index.remove(abcd)
    assert shape(index) == {(1, 2): (True, {(8, 9): (True, {})})}
    index.remove(ab)  # (1, 2) now holds nothing and has one child: merged into it
    assert shape(index) == {(1, 2, 8, 9): (True, {})}
    assert (index.root.num_truncatable, index.check()) == (0, 1)
    index.add(ab)  # a key that ends inside an edge
    assert shape(index) == {(1, 2): (True, {(8, 9): (True, {})})}
    index.remove(abxy)
    index.remove(ab)
    assert shape(index) == {} and index.check() == 0


def test_removing_a_leaf_merges_its_entryless_parent() -> None:
    index = RadixIndex()
    a, b, c = entry((1, 2, 3)), entry((1, 2, 4)), entry((1, 5))
    for e in (a, b, c):
        index.add(e)
    assert shape(index) == {
        (1,): (False, {(2,): (False, {(3,): (True, {}), (4,): (True, {})}), (5,): (True, {})})
    }
    index.remove(c)
    assert shape(index) == {(1, 2): (False, {(3,): (True, {}), (4,): (True, {})})}
    index.check()
    assert index.get((1, 2, 4)) is b and index.get((1, 2)) is None and index.get((1, 2, 4, 5)) is None


def test_match_reports_lcp_even_without_a_usable_entry() -> None:
    index = RadixIndex()
    index.add(entry((1, 2, 3, 4, 5), truncatable=False))
    match = index.match((1, 2, 3, 9))
    assert (match.entry, match.num_cached_tokens, match.lcp_len) == (None, 0, 3)


def test_common_len() -> None:
    edge = tuple(range(100))
    tokens = (7, 7) + tuple(range(60)) + (999,)
    assert _common_len(edge, tokens, 2) == 60
    assert _common_len(edge, tokens[:40], 2) == 38  # the prompt ends first
    assert _common_len((5,), (5, 6), 0) == 1
    assert _common_len(edge[:10], tuple(range(50)), 0) == 10  # edge ends first
    for k in range(1, 100):
        assert _common_len(edge, edge[:k] + (-1,), 0) == k
