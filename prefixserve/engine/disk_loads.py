"""Sessions parked while a lower tier (disk, then the shared tier on Redis) reads an entry for them
(docs/cache.md, "Load").

Engine-thread only. The entry is found (Redis), read, verified and decoded on the tier's loader
thread, so a load never holds up other sessions' steps; once it lands, the entry goes into RAM
(sharing pieces like any insert) and the session goes back to the front of the queue, where its RAM
lookup now hits. Each tier is asked once per session, in order; after a disk load the shared tier
is still asked for a longer entry.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING

from prefixserve.cache import PrefixCache
from prefixserve.cache.disk import DiskTier
from prefixserve.cache.tier import Loaded, LoadFailed
from prefixserve.engine.session import Session, Snapshot
from prefixserve.runner.pieces import PieceStore
from prefixserve.types import FlushScope

if TYPE_CHECKING:  # only a shared tier's server imports it (and redis with it, 0.2 s)
    from prefixserve.cache.shared import SharedTier

log = logging.getLogger("prefixserve.engine")

MIN_DISK_GAIN_TOKENS = 32  # a disk entry must serve this many tokens more than RAM to be loaded


class DiskLoads:
    def __init__(self, disk: DiskTier | None, cache: PrefixCache[Snapshot], pieces: PieceStore,
                 shared: SharedTier | None = None) -> None:
        self.disk = disk
        self.shared = shared
        self._cache = cache
        self._pieces = pieces
        self._parked: list[tuple[Session, Future[Loaded | LoadFailed]]] = []
        self._flushing: list[FlushScope] = []  # flushes whose Redis part is under way (engine/control.py)

    def __bool__(self) -> bool:
        return bool(self._parked)

    def park(self, s: Session) -> bool:
        """Start a load and park `s` if a lower tier serves >= MIN_DISK_GAIN_TOKENS more of its prompt
        than RAM: disk first (a local lookup), then the shared tier (looked up on its loader thread;
        skipped at once while Redis is down). The caller checked that reuse is allowed at all."""
        if self._cache.config.max_bytes == 0:
            return False
        ns, ids = s.request.namespace, s.request.prompt_ids
        need = self._cache.best_len(ns, ids) + MIN_DISK_GAIN_TOKENS
        if s.num_tiers_asked == 0:
            s.num_tiers_asked = 1
            hit = None if self.disk is None else self.disk.lookup(ns, ids)
            if hit is not None and self.disk is not None and hit.num_cached_tokens >= need:
                self._parked.append((s, self.disk.load(hit)))
                return True
        if s.num_tiers_asked == 1:
            s.num_tiers_asked = 2
            flushing = any(scope.selects(ns) for scope in self._flushing)  # its values may be going
            found = None if self.shared is None or flushing else self.shared.find(ns, ids, need)
            if found is not None:
                self._parked.append((s, found))
                return True
        return False

    def ready(self, block: bool) -> list[Session]:
        """Sessions whose load finished, in parking order, their entries now in RAM (a failed load,
        or a namespace flushed meanwhile, inserts nothing: a miss). With `block`, wait up to 50 ms
        for one first (when the engine has nothing else to do). An entry that cannot go into RAM is
        a miss too (logged): its session still goes back to the queue."""
        if block and self._parked:
            wait([f for _, f in self._parked], timeout=0.05, return_when=FIRST_COMPLETED)
        done = [(s, f) for s, f in self._parked if f.done()]
        for s, fut in done:
            self._parked.remove((s, fut))
            result = fut.result()
            if isinstance(result, Loaded) and s.cacheable:
                ns, key = s.request.namespace, result.token_ids
                try:
                    self._cache.insert(ns, key, self._pieces.adopt(result.state, key, ns))  # one copy per new piece
                except Exception:
                    log.exception("a loaded entry for %s could not go into RAM", s.request.request_id)
        return [s for s, _ in done]

    def flushing(self, scope: FlushScope) -> None:
        """A flush of `scope` is deleting its values in the shared tier: no session reads them until
        `flushed(scope)` (those parked already were made uncacheable by the flush: their loads insert nothing)."""
        self._flushing.append(scope)

    def flushed(self, scope: FlushScope) -> None:
        """The shared tier's part of a flush of `scope` ended (`flushing`)."""
        if scope in self._flushing:
            self._flushing.remove(scope)

    def sessions(self) -> list[Session]:
        return [s for s, _ in self._parked]

    def take(self, request_id: str) -> Session | None:
        """Unpark and return the session of `request_id` (its load finishes unobserved), or None."""
        for s, fut in self._parked:
            if s.request.request_id == request_id:
                self._parked.remove((s, fut))
                return s
        return None

    def take_all(self) -> list[Session]:
        sessions = self.sessions()
        self._parked.clear()
        return sessions
