"""The hand-over of Deltas from the engine thread to the asyncio callers, one stream per request.

A stream closed early (the client left) is not simply dropped: the engine still ends the request
(abort) and reports what it computed in the final Delta. The stream's queue is swapped for an
`Abandoned` record that keeps that usage for the server's ledger (`Streams.abandoned_usage`), so a
client that leaves is billed exactly what was computed (nothing if it was still queued).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from prefixserve.types import Delta, FinishReason, InvalidRequest, Usage

log = logging.getLogger("prefixserve.engine")

ABORT_USAGE_WAIT_S = 10.0  # how long the server waits for a closed stream's abort usage (one engine step)
MAX_ABANDONED = 4096  # closed streams whose usage no one collected yet; past it the oldest is forgotten


class Abandoned:
    """A request whose stream was closed early, collecting its abort's final usage (event-loop side:
    `put_nowait` stands in for the stream's queue)."""

    def __init__(self, future: asyncio.Future[Usage | None], num_left: int, done: Callable[[], None]) -> None:
        self.future = future
        self.num_left = num_left  # choices not finished yet
        self.usage: Usage | None = None
        self._done = done

    def take_over(self, q: asyncio.Queue[Delta]) -> None:
        while not q.empty():
            self.put_nowait(q.get_nowait())

    def put_nowait(self, delta: Delta) -> None:
        if self.future.done():
            return
        if delta.usage is not None:
            self.usage = delta.usage
        if delta.finish_reason is not None:
            self.num_left -= 1
            if self.num_left <= 0 or delta.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
                self.future.set_result(self.usage)
                self._done()


class Streams:
    """Request id -> where its Deltas go. `emit` is called from the engine thread, the rest on the
    callers' event loops."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._targets: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Delta] | Abandoned]] = {}
        self._abandoned: dict[str, Abandoned] = {}  # closed early, final usage not collected yet

    def open(self, rid: str) -> asyncio.Queue[Delta]:
        q: asyncio.Queue[Delta] = asyncio.Queue()
        with self._lock:
            if rid in self._targets:
                raise InvalidRequest(f"request id {rid!r} is already in use")
            self._targets[rid] = (asyncio.get_running_loop(), q)
        return q

    def close(self, rid: str, q: asyncio.Queue[Delta], num_left: int, early: bool) -> None:
        """The stream's iterator ended. `early` (the caller closed it with `num_left` choices
        unfinished): the Deltas still to come go to an `Abandoned` record. Deltas the engine already
        handed to the queue run first (callbacks run in order: the swap and `emit` share the lock),
        then the queue's leftovers move over, then the engine's next Deltas arrive directly."""
        with self._lock:
            if not early:
                self._targets.pop(rid, None)
                return
            loop = self._targets[rid][0]
            if len(self._abandoned) >= MAX_ABANDONED:
                self._abandoned.pop(next(iter(self._abandoned)))
            rec = Abandoned(loop.create_future(), num_left, lambda: self._forget(rid))
            self._abandoned[rid] = rec
            self._targets[rid] = (loop, rec)
            loop.call_soon(rec.take_over, q)

    def _forget(self, rid: str) -> None:
        with self._lock:
            self._targets.pop(rid, None)

    async def abandoned_usage(self, rid: str) -> Usage | None:
        """See AsyncEngine.abandoned_usage."""
        rec = self._abandoned.pop(rid, None)
        if rec is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(rec.future), ABORT_USAGE_WAIT_S)
        except TimeoutError:
            log.warning("no final usage for aborted request %s within %.0f s", rid, ABORT_USAGE_WAIT_S)
            return rec.usage

    def emit(self, rid: str, delta: Delta) -> None:
        """From the engine thread: hand `delta` to the request's stream (if it still has one)."""
        with self._lock:  # scheduled under the lock: ordered with a stream's swap (`close`)
            target = self._targets.get(rid)
            if target is not None:
                loop, q = target
                try:
                    loop.call_soon_threadsafe(q.put_nowait, delta)
                except RuntimeError:  # the caller's loop is closed
                    pass

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._targets)
