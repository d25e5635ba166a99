"""Byte accounting with shared storage counted once: a refcount per storage key."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

Pieces = tuple[tuple[Hashable, int], ...]  # (storage key, nbytes), keys distinct


class StorageLedger:
    """Which storage pieces are held, by how many entries, and their total counted once.

    A piece's bytes count from its first holder's `acquire` to its last holder's `release`. Mutated
    only by `acquire`/`release`; the rest never mutates. Not thread-safe (one engine thread).
    """

    def __init__(self) -> None:
        self.num_bytes = 0
        self._refcounts: dict[Hashable, int] = {}
        self._sizes: dict[Hashable, int] = {}

    def acquire(self, pieces: Pieces) -> int:
        """Add one holder to each piece; return the bytes newly counted (pieces held by no one before)."""
        added = 0
        for key, nbytes in pieces:
            count = self._refcounts.get(key, 0)
            if count == 0:
                self._sizes[key] = nbytes
                added += nbytes
            self._refcounts[key] = count + 1
        self.num_bytes += added
        return added

    def release(self, pieces: Pieces) -> int:
        """Drop one holder from each piece (each must be held); return the bytes no longer counted."""
        freed = 0
        for key, _ in pieces:
            count = self._refcounts[key] - 1
            if count == 0:
                del self._refcounts[key]
                freed += self._sizes.pop(key)
            else:
                self._refcounts[key] = count
        self.num_bytes -= freed
        return freed

    def refcount(self, key: Hashable) -> int:
        return self._refcounts.get(key, 0)

    def size_of(self, key: Hashable) -> int | None:
        """The nbytes a held key was acquired with, or None if no one holds it."""
        return self._sizes.get(key)

    def bytes_to_add(self, pieces: Pieces) -> int:
        """What `acquire(pieces)` would add now. Does not mutate."""
        return sum(nbytes for key, nbytes in pieces if key not in self._refcounts)

    def check(self, held: Iterable[Pieces]) -> None:
        """Assert that the refcounts and the total are exactly those of holders `held`."""
        refcounts: dict[Hashable, int] = {}
        sizes: dict[Hashable, int] = {}
        for pieces in held:
            for key, nbytes in pieces:
                refcounts[key] = refcounts.get(key, 0) + 1
                if sizes.setdefault(key, nbytes) != nbytes:
                    raise AssertionError(f"storage key {key!r} held with sizes {sizes[key]} and {nbytes}")
        if refcounts != self._refcounts:
            raise AssertionError("storage refcounts do not match the entries holding them")
        if sizes != self._sizes:
            raise AssertionError("storage sizes do not match the entries holding them")
        total = sum(sizes.values())
        if total != self.num_bytes:
            raise AssertionError(f"counted bytes {self.num_bytes} != {total} held (shared counted once)")


def validate_pieces(pieces: Iterable[tuple[Hashable, int]], nbytes: int, ledger: StorageLedger) -> Pieces:
    """A state's storage as a tuple, or ValueError if it breaks the `CachedState.storage` contract:
    duplicate keys, negative sizes, a sum other than `nbytes`, or a key already held with another size."""
    result = tuple((key, int(size)) for key, size in pieces)
    if len({key for key, _ in result}) != len(result):
        raise ValueError("a state's storage keys must be distinct")
    if any(size < 0 for _, size in result):
        raise ValueError("storage nbytes must be >= 0")
    if sum(size for _, size in result) != nbytes:
        raise ValueError(f"state.nbytes {nbytes} != the sum of its storage pieces")
    for key, size in result:
        held = ledger.size_of(key)
        if held is not None and held != size:
            raise ValueError(f"storage key {key!r} is already cached with {held} bytes, not {size}")
    return result
