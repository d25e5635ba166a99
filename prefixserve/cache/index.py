"""The prefix index of one namespace: a radix tree over exact token ids.

Every edge holds the token ids it spans and every comparison is of token ids, so a match is never
inferred from a hash (dict lookups by first token only pick which edge to compare). Shape:

    root (depth 0, no edge, no entry)
      └─ edge (t0 … tk) ─▶ node at depth k+1 [entry whose key is those k+1 tokens, or none]
                              └─ …

Invariants (`check`): every path from the root spells a prefix of some entry's key; a non-root node
without an entry has >= 2 children (the tree is compressed), so every leaf holds an entry; a child is
filed under the first token of its edge; `num_truncatable` counts the truncatable entries in a node's
subtree, the node's own included; `marks` holds (depth, entry) for each resume point (`Entry.points`)
of an entry below that lies on the node's edge, parent.depth < depth <= node.depth, so a walk along a
prompt meets exactly the points the prompt shares. Not thread-safe: the owning `PrefixCache` is
driven by one thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic

from prefixserve.cache.entry import Entry, Node
from prefixserve.cache.state import S


@dataclass(frozen=True, slots=True)
class Match(Generic[S]):
    """The best usable entry for a prompt (None: nothing usable) and the prompt's lcp with the index."""

    entry: Entry[S] | None
    num_cached_tokens: int
    lcp_len: int


class RadixIndex(Generic[S]):
    """Entries of one namespace by exact token prefix. Mutated only through `add` and `remove`."""

    def __init__(self) -> None:
        self.root: Node[S] = Node((), 0, None)
        self.num_entries = 0

    def match(self, prompt: tuple[int, ...]) -> Match[S]:
        """The entry serving the most tokens of `prompt` under the usability rules, without mutating.

        An entry with key T serves: len(T) if T is a proper prefix of the prompt; len(prompt) if T is
        the prompt and has logits; if truncatable, also min(lcp(T, prompt), len(prompt) - 1); else
        also its deepest resume point <= that (a snapshot-only state's checkpoints, docs/hybrid.md).
        Ties go to the entry that needs no truncation (its key ends exactly there).
        """
        num_prompt = len(prompt)
        cap = num_prompt - 1  # a partial hit leaves the engine >= 1 token to compute
        node = self.root
        pos = 0
        best: Entry[S] | None = None
        best_len = 0
        trunc_node: Node[S] | None = None  # deepest subtree known to hold a truncatable entry ...
        trunc_len = 0  # ... and what that entry serves
        mark: tuple[int, Entry[S] | None] = (0, None)  # deepest resume point met on the way
        while True:
            entry = node.entry
            if entry is not None:
                if pos < num_prompt:
                    best, best_len = entry, pos
                elif entry.has_logits:
                    return Match(entry, pos, pos)  # the whole prompt, nothing can beat it
            if node.num_truncatable and pos > trunc_len:
                trunc_node, trunc_len = node, min(pos, cap)
            if pos == num_prompt:
                break
            child = node.children.get(prompt[pos])
            if child is None:
                break
            edge = child.edge
            end = pos + len(edge)
            if prompt[pos:end] == edge:
                node, pos = child, end
                mark = _deepest_mark(child, min(pos, cap), mark)
                continue
            pos += _common_len(edge, prompt, pos)
            if child.num_truncatable and pos > trunc_len:
                trunc_node, trunc_len = child, min(pos, cap)
            mark = _deepest_mark(child, min(pos, cap), mark)
            break
        if mark[1] is not None and mark[0] > max(best_len, trunc_len):
            return Match(mark[1], mark[0], pos)
        if trunc_node is not None and trunc_len > best_len:
            return Match(_any_truncatable(trunc_node), trunc_len, pos)
        return Match(best, best_len, pos)

    def get(self, token_ids: tuple[int, ...]) -> Entry[S] | None:
        """The entry keyed by exactly `token_ids`, or None. Does not mutate."""
        node, pos, split = self._descend(token_ids)
        if split == 0 and pos == len(token_ids):
            return node.entry
        return None

    def entry_lengths(self, token_ids: tuple[int, ...]) -> list[int]:
        """Lengths of the entries whose keys are proper prefixes of `token_ids`, shortest first. Does
        not mutate."""
        lengths = []
        node, pos = self.root, 0
        while pos < len(token_ids):
            child = node.children.get(token_ids[pos])
            if child is None or token_ids[pos : pos + len(child.edge)] != child.edge:
                break
            node, pos = child, pos + len(child.edge)
            if node.entry is not None and pos < len(token_ids):
                lengths.append(pos)
        return lengths

    def add(self, entry: Entry[S]) -> None:
        """File `entry` under its key, splitting an edge if needed. The key must not be present yet."""
        key = entry.token_ids
        node, pos, split = self._descend(key)
        if split:  # the key diverges from (or ends inside) the edge to `child`: cut the edge there
            child = node.children[key[pos]]
            mid: Node[S] = Node(child.edge[:split], node.depth + split, node)
            mid.num_truncatable = child.num_truncatable
            mid.marks = [m for m in child.marks if m[0] <= mid.depth]
            child.marks = [m for m in child.marks if m[0] > mid.depth]
            child.edge = child.edge[split:]
            child.parent = mid
            mid.children[child.edge[0]] = child
            node.children[key[pos]] = mid
            node, pos = mid, pos + split
        if pos < len(key):
            leaf: Node[S] = Node(key[pos:], len(key), node)
            node.children[key[pos]] = leaf
            node = leaf
        assert node.entry is None, "key already present"
        node.entry = entry
        entry.node = node
        self.num_entries += 1
        if entry.truncatable:
            _add_truncatable(node, 1)
        for point in entry.points:  # on the key's path: the node whose edge holds that depth
            at = node
            while at.parent is not None and at.parent.depth >= point:
                at = at.parent
            at.marks.append((point, entry))

    def remove(self, entry: Entry[S]) -> None:
        """Unfile `entry` (which must be filed here) and compress the tree around its node."""
        node = entry.node
        assert node is not None and node.entry is entry, "entry is not in this index"
        node.entry = None
        entry.node = None
        self.num_entries -= 1
        if entry.truncatable:
            _add_truncatable(node, -1)
        if entry.points:
            at: Node[S] | None = node
            while at is not None:
                at.marks = [m for m in at.marks if m[1] is not entry]
                at = at.parent
        parent = node.parent
        if parent is None:
            return
        if not node.children:
            del parent.children[node.edge[0]]
            if parent.parent is not None and parent.entry is None and len(parent.children) == 1:
                _merge_into_child(parent)
        elif len(node.children) == 1:
            _merge_into_child(node)

    def entries(self) -> Iterator[Entry[S]]:
        """Every entry, depth first. Does not mutate; do not mutate the index while iterating."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.entry is not None:
                yield node.entry
            stack.extend(node.children.values())

    def check(self) -> int:
        """Assert the tree's invariants (see the module docstring); return the number of entries."""
        count = 0
        marks: list[tuple[int, int]] = []
        stack: list[tuple[Node[S], tuple[int, ...]]] = [(self.root, ())]
        require(self.root.entry is None and self.root.edge == (), "the root holds no entry or edge")
        while stack:
            node, path = stack.pop()
            require(node.depth == len(path), f"node depth {node.depth} != path length {len(path)}")
            num_truncatable = 0
            if node.entry is not None:
                count += 1
                entry = node.entry
                require(entry.node is node and entry.is_cached, f"{entry} does not point back to its node")
                require(entry.token_ids == path, f"{entry} filed under another key")
                num_truncatable += entry.truncatable
            elif node.parent is not None:
                require(len(node.children) >= 2, f"uncompressed node at depth {node.depth}")
            for first, child in node.children.items():
                require(child.parent is node, "child's parent pointer is wrong")
                require(len(child.edge) > 0 and child.edge[0] == first, "child filed under another token")
                num_truncatable += child.num_truncatable
                stack.append((child, path + child.edge))
            require(node.num_truncatable == num_truncatable, f"num_truncatable wrong at depth {node.depth}")
            low = -1 if node.parent is None else node.parent.depth
            for depth, owner in node.marks:
                require(low < depth <= node.depth and owner.token_ids[:node.depth] == path, "mark off its edge")
                marks.append((depth, id(owner)))
        require(count == self.num_entries, f"num_entries {self.num_entries} != {count} in the tree")
        points = [(p, id(e)) for e in self.entries() for p in e.points]
        require(sorted(marks) == sorted(points), "marks != the entries' resume points")
        return count

    def _descend(self, key: tuple[int, ...]) -> tuple[Node[S], int, int]:
        """Follow `key` down whole edges: (deepest node reached, its depth, split) where split > 0 means
        the key shares `split` tokens with the next edge but does not contain all of it."""
        node = self.root
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                return node, pos, 0
            end = pos + len(child.edge)
            if key[pos:end] != child.edge:
                return node, pos, _common_len(child.edge, key, pos)
            node, pos = child, end
        return node, pos, 0


def _common_len(edge: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
    """Length of the common prefix of `edge` and `tokens[pos:]`, given that their first tokens agree.
    Binary search over slice equality: O(log n) comparisons that each run in C."""
    lo = 1  # edge[:lo] == tokens[pos:pos + lo]
    hi = min(len(edge), len(tokens) - pos)  # the answer is <= hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if edge[lo:mid] == tokens[pos + lo : pos + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _deepest_mark(node: Node[S], limit: int, best: tuple[int, Entry[S] | None]) -> tuple[int, Entry[S] | None]:
    """The deepest of `best` and `node`'s marks at depth <= limit."""
    for depth, entry in node.marks:
        if best[0] < depth <= limit:
            best = (depth, entry)
    return best


def _any_truncatable(node: Node[S]) -> Entry[S]:
    """A truncatable entry in `node`'s subtree (which must hold one): the first met on the way down."""
    while node.entry is None or not node.entry.truncatable:
        node = next(c for c in node.children.values() if c.num_truncatable)
    return node.entry


def _add_truncatable(node: Node[S] | None, delta: int) -> None:
    while node is not None:
        node.num_truncatable += delta
        node = node.parent


def _merge_into_child(node: Node[S]) -> None:
    """Remove an entry-less, single-child, non-root `node` by prepending its edge to its child's."""
    parent = node.parent
    assert parent is not None and node.entry is None and len(node.children) == 1
    (child,) = node.children.values()
    child.edge = node.edge + child.edge
    child.marks = node.marks + child.marks
    child.parent = parent
    parent.children[node.edge[0]] = child
    node.parent = None
    node.children = {}


def require(condition: bool, message: str) -> None:
    """An invariant check that stays on under `python -O`: AssertionError(`message`) unless `condition`."""
    if not condition:
        raise AssertionError(message)
