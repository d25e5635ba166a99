"""What the cache tells an observer about its contents (the KV events of docs/gateway.md)."""

from __future__ import annotations

from typing import Any, Protocol

from prefixserve.cache.entry import Entry


class CacheListener(Protocol):
    """Told of every entry the RAM cache starts and stops holding, on the thread that mutates the
    cache (the engine thread), inside the mutation.

    Contract for implementations: return at once (never block, never wait for I/O: hand the entry to
    another thread), never raise, never call back into the cache. An entry's `namespace` and
    `token_ids` are immutable and may be kept; its other fields may change after the call returns.
    Every `stored` entry is later `removed` exactly once (evicted, replaced, flushed, discarded),
    unless `cleared` comes first, which drops every entry without a `removed` for each."""

    def stored(self, entry: Entry[Any]) -> None: ...

    def removed(self, entry: Entry[Any]) -> None: ...

    def cleared(self) -> None: ...

    def stats(self) -> dict[str, float]:
        """The listener's own counters for /metrics (keys without a prefix). Any thread."""
        ...
