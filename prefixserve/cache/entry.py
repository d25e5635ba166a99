"""Entries, the index nodes that hold them (cache/index.py), and the named results of
`PrefixCache.lookup` and `PrefixCache.insert`."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic

from prefixserve.cache.state import CachedState, S
from prefixserve.types import Namespace


@dataclass(eq=False, slots=True)
class Entry(Generic[S]):
    """One cached state, keyed by the exact token prefix it was computed from, inside one namespace.

    Read-only for everyone but the cache. Equality is identity. `truncatable`, `has_logits`, `nbytes`
    and `pieces` are read from the state once, at insert; `state`, `has_logits`, `nbytes` and
    `pieces` change once more if the cache sheds the entry's logits for room (cache/room.py). An
    entry stays a valid Python object after the cache drops it (`is_cached` turns False); the state
    lives as long as someone holds it.
    """

    namespace: Namespace
    token_ids: tuple[int, ...]
    state: S
    truncatable: bool
    has_logits: bool
    nbytes: int
    pieces: tuple[tuple[Hashable, int], ...]  # (storage key, nbytes), keys distinct
    points: tuple[int, ...] = ()  # shorter lengths a snapshot-only state also restores to (resume_points)
    num_pins: int = 0  # sessions copying from it right now; > 0 means never evicted
    repeated: bool = False  # a prompt equal to its key was looked up: its logits earn their bytes (cache/room.py)
    is_cached: bool = True  # False once evicted, replaced or cleared
    node: Node[S] | None = None  # where the index holds it; None once dropped

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        kind = "kv" if self.truncatable else "snapshot"
        logits = "+logits" if self.has_logits else ""
        return (
            f"Entry({self.namespace.tenant_id}/{self.namespace.cache_salt!r}, {self.num_tokens} tokens, "
            f"{kind}{logits}, {self.nbytes} B, pins={self.num_pins}, cached={self.is_cached})"
        )


class Node(Generic[S]):
    """A node of a namespace's radix tree (cache/index.py): the edge from its parent, its entry if any,
    and the counts and resume-point marks of its subtree. Mutated by `RadixIndex` only."""

    __slots__ = ("children", "depth", "edge", "entry", "marks", "num_truncatable", "parent")

    def __init__(self, edge: tuple[int, ...], depth: int, parent: Node[S] | None) -> None:
        self.edge = edge  # the tokens from the parent to here; () for the root
        self.depth = depth  # tokens from the root to here
        self.parent = parent
        self.children: dict[int, Node[S]] = {}  # first token of the child's edge -> child
        self.entry: Entry[S] | None = None
        self.num_truncatable = 0  # truncatable entries in this subtree, own entry included
        self.marks: list[tuple[int, Entry[S]]] = []  # resume points on this node's edge (module docstring)


def resume_points(state: CachedState) -> tuple[int, ...]:
    """The optional `resume_points` of a snapshot-only state (CachedState), sorted, inside
    (0, num_tokens); ValueError otherwise. () for a truncatable state: it serves every length."""
    points = tuple(getattr(state, "resume_points", ()))
    if state.truncatable or not points:
        return ()
    if list(points) != sorted(set(points)) or points[0] <= 0 or points[-1] >= state.num_tokens:
        raise ValueError(f"resume points {points} not sorted inside (0, {state.num_tokens})")
    return points


@dataclass(frozen=True, slots=True)
class Hit(Generic[S]):
    """Copy the first `num_cached_tokens` tokens of `entry.state` (unless truncatable: all of it, or
    one of its resume points), then compute the rest of the prompt. `num_cached_tokens ==
    len(prompt)` only when the entry is exactly the prompt and carries its logits: then no forward
    pass is needed.

    `lcp_len` is the longest common prefix of the prompt with any entry of its namespace (>= the hit);
    for a snapshot-only runtime it is where a boundary entry pays off."""

    entry: Entry[S]
    num_cached_tokens: int
    lcp_len: int


@dataclass(frozen=True, slots=True)
class Miss:
    """Nothing usable. `lcp_len` as in `Hit`: insert a boundary entry there so the next request hits."""

    lcp_len: int


class InsertStatus(str, enum.Enum):
    INSERTED = "inserted"  # stored as a new entry
    REPLACED = "replaced"  # the key was cached without logits; the new state (with logits) replaced it
    ALREADY_PRESENT = "already_present"  # the key was cached; the existing entry was kept and touched
    TOO_LARGE = "too_large"  # the state alone exceeds the whole budget; not stored
    NO_ROOM = "no_room"  # only pinned entries could have been evicted; nothing was evicted, not stored
    DISABLED = "disabled"  # max_bytes == 0


@dataclass(frozen=True, slots=True)
class InsertResult(Generic[S]):
    status: InsertStatus
    entry: Entry[S] | None  # what the cache holds for these tokens after the call (None if nothing)
    num_evicted: int = 0  # entries evicted to make room
    num_evicted_bytes: int = 0  # bytes those evictions freed
    evicted: tuple[Entry[S], ...] = ()  # the entries evicted, least recently used first

    @property
    def stored(self) -> bool:
        """The state passed in is now cached (the caller must not mutate it from here on)."""
        return self.status in (InsertStatus.INSERTED, InsertStatus.REPLACED)


@dataclass(frozen=True, slots=True)
class FlushResult:
    """What `PrefixCache.flush` dropped: entries, and the bytes no longer counted (shared storage
    once; storage still held by an entry that was kept is not counted as gone)."""

    num_entries: int = 0
    num_bytes: int = 0
    complete: bool = True  # False: the tier did not answer (Redis down), its entries of the scope may remain
