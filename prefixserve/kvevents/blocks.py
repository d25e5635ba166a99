"""The prefix cache's entries as vLLM-style KV blocks, and which blocks are present as entries come and
go (docs/gateway.md, "Blocks"). Pure: no sockets, no threads; the publisher (publisher.py) drives it.

An entry keyed by `token_ids` covers the full blocks of its tokens:

    # [0, B), [B, 2B), ...           blocks 0, 1, ... (B = block_size), each hashed from its parent
    # [B * (len // B), len)          a partial last block: never announced (vLLM announces full blocks)

A block's hash is BLAKE2b-64 keyed by the publisher's key over (parent hash, the block's token ids);
block 0's parent is a hash of the namespace (model, tenant, salt), so one prompt in two namespaces
never yields one hash. A block is present while any stored entry covers it (entries sharing a prefix
share its blocks), announced stored when the first such entry is stored and removed with the last.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefixserve.types import Namespace

# The tier every announced block lives in: the RAM cache, in host memory (llm-d lowercases it to its
# device tier "cpu"; docs/gateway.md). The disk and Redis tiers are not announced.
MEDIUM = "CPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks newly present, in chain order: `block_hashes[0]`'s parent is `parent_block_hash` (None for
    a chain's first block), each next one's parent the one before; `token_ids` are theirs, block_size
    per hash."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int

    def wire(self) -> list[Any]:
        """vLLM's array-like tagged struct: the tag, then block_hashes, parent_block_hash, token_ids,
        block_size, lora_id, medium (the fields llm-d's indexer decodes, in its order)."""
        return ["BlockStored", list(self.block_hashes), self.parent_block_hash, list(self.token_ids),
                self.block_size, None, MEDIUM]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks no stored entry covers any more."""

    block_hashes: tuple[int, ...]

    def wire(self) -> list[Any]:
        return ["BlockRemoved", list(self.block_hashes), MEDIUM]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block this publisher announced is gone."""

    def wire(self) -> list[Any]:
        return ["AllBlocksCleared"]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """The block hashes of token prefixes in a namespace, keyed by `key` (16 to 64 bytes)."""

    key: bytes
    block_size: int

    def root(self, ns: Namespace) -> bytes:
        """The parent of a namespace's first block (never published)."""
        data = json.dumps([ns.model_id, ns.tenant_id, ns.cache_salt]).encode()
        return hashlib.blake2b(data, key=self.key, digest_size=8, person=b"ps-kv-root").digest()

    def chain(self, ns: Namespace, token_ids: Sequence[int]) -> list[int]:
        """The hashes of the full blocks of `token_ids` in `ns`, first block first (as unsigned 64-bit
        integers). Does not mutate; the same arguments always give the same hashes."""
        size = self.block_size
        parent = self.root(ns)
        hashes = []
        for start in range(0, len(token_ids) - size + 1, size):
            data = parent + array("I", token_ids[start:start + size]).tobytes()
            parent = hashlib.blake2b(data, key=self.key, digest_size=8, person=b"ps-kv-block").digest()
            hashes.append(int.from_bytes(parent, "big"))
        return hashes


class BlockTracker:
    """Which blocks the stored entries cover, and the events that say what changed.

    Fed every entry stored and removed, in the cache's order; answers with the events to publish.
    Mutates; not thread-safe (the publisher's thread owns it). Removing an entry it was never told of
    is ignored, so after `cleared` (or a reset after lost changes) it announces a subset of the cache."""

    def __init__(self, hasher: BlockHasher) -> None:
        self.hasher = hasher
        self._chains: dict[tuple[Namespace, tuple[int, ...]], list[int]] = {}  # tracked entries' blocks
        self._refs: dict[int, int] = {}  # present block -> tracked entries covering it (>= 1)

    @property
    def num_blocks(self) -> int:
        return len(self._refs)

    def present(self) -> frozenset[int]:
        """The hashes of every present block."""
        return frozenset(self._refs)

    def stored(self, ns: Namespace, token_ids: tuple[int, ...]) -> BlockStored | None:
        """The entry (ns, token_ids) is cached: its blocks no entry covered yet, or None if none (it is
        shorter than a block, tracked already, or within blocks other entries cover)."""
        key = (ns, token_ids)
        if key in self._chains:
            return None
        chain = self.hasher.chain(ns, token_ids)
        if not chain:
            return None
        self._chains[key] = chain
        # blocks covered by some entry form a prefix of every chain (an entry covering block i covers
        # the blocks before it): the new ones are a suffix, announced under the last present one
        first_new = next((i for i, h in enumerate(chain) if h not in self._refs), len(chain))
        for h in chain:
            self._refs[h] = self._refs.get(h, 0) + 1
        if first_new == len(chain):
            return None
        size = self.hasher.block_size
        return BlockStored(tuple(chain[first_new:]), chain[first_new - 1] if first_new else None,
                           token_ids[first_new * size:len(chain) * size], size)

    def removed(self, ns: Namespace, token_ids: tuple[int, ...]) -> BlockRemoved | None:
        """The entry (ns, token_ids) is gone: the blocks no other tracked entry covers, or None."""
        chain = self._chains.pop((ns, token_ids), None)
        if chain is None:
            return None
        gone = []
        for h in chain:
            left = self._refs[h] - 1
            if left:
                self._refs[h] = left
            else:
                del self._refs[h]
                gone.append(h)
        return BlockRemoved(tuple(gone)) if gone else None

    def cleared(self) -> list[KVEvent]:
        """Forget every entry: the removal of every present block (for indexers that ignore
        AllBlocksCleared, as llm-d's does), then AllBlocksCleared."""
        events: list[KVEvent] = [BlockRemoved(tuple(self._refs))] if self._refs else []
        self._chains.clear()
        self._refs.clear()
        return [*events, AllBlocksCleared()]

    def check_integrity(self) -> None:
        """Assert: each present block's count is the number of tracked chains holding it, and each
        tracked chain is its entry's hashes. Does not mutate; O(tracked blocks)."""
        counts: dict[int, int] = {}
        for (ns, token_ids), chain in self._chains.items():
            assert chain == self.hasher.chain(ns, token_ids), f"chain of {len(token_ids)} tokens is stale"
            for h in chain:
                counts[h] = counts.get(h, 0) + 1
        assert counts == self._refs, "block reference counts disagree with the tracked entries"
