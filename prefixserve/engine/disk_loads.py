"""Sessions parked while the disk tier reads an entry for them (docs/cache.md, "Load").

Engine-thread only. The file is read, verified and decoded on the tier's loader thread, so a load
never holds up other sessions' steps; once it lands, the entry goes into RAM (sharing pieces like
any insert) and the session goes back to the front of the queue, where its RAM lookup now hits.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait

from prefixserve.cache import PrefixCache
from prefixserve.cache.disk import DiskTier
from prefixserve.cache.tier import Loaded, LoadFailed
from prefixserve.engine.session import Session
from prefixserve.runner.pieces import PieceStore

MIN_DISK_GAIN_TOKENS = 32  # a disk entry must serve this many tokens more than RAM to be loaded


class DiskLoads:
    def __init__(self, disk: DiskTier | None, cache: PrefixCache, pieces: PieceStore) -> None:
        self.disk = disk
        self._cache = cache
        self._pieces = pieces
        self._parked: list[tuple[Session, Future[Loaded | LoadFailed]]] = []

    def __bool__(self) -> bool:
        return bool(self._parked)

    def park(self, s: Session) -> bool:
        """Start a load and park `s` if disk serves >= MIN_DISK_GAIN_TOKENS more of its prompt than
        RAM; asks the disk once per session. The caller checked that reuse is allowed at all."""
        if self.disk is None or s.disk_checked or self._cache.config.max_bytes == 0:
            return False
        s.disk_checked = True
        ns, ids = s.request.namespace, s.request.prompt_ids
        hit = self.disk.lookup(ns, ids)
        if hit is None or hit.num_cached_tokens < self._cache.best_len(ns, ids) + MIN_DISK_GAIN_TOKENS:
            return False
        self._parked.append((s, self.disk.load(hit)))
        return True

    def ready(self, block: bool) -> list[Session]:
        """Sessions whose load finished, in parking order, their entries now in RAM (a failed load,
        or a namespace flushed meanwhile, inserts nothing: a miss). With `block`, wait up to 50 ms
        for one first (when the engine has nothing else to do)."""
        if block and self._parked:
            wait([f for _, f in self._parked], timeout=0.05, return_when=FIRST_COMPLETED)
        done = [(s, f) for s, f in self._parked if f.done()]
        for s, fut in done:
            self._parked.remove((s, fut))
            result = fut.result()
            if isinstance(result, Loaded) and s.cacheable:
                ns, key = s.request.namespace, result.token_ids
                self._cache.insert(ns, key, self._pieces.adopt(result.state, key, ns))  # one copy per new piece
        return [s for s, _ in done]

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
