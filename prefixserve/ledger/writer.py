"""`BackgroundWriter`: one thread that commits a store's queued writes to its SQLite file, a burst as one
transaction, so that the callers' hot paths never wait for a disk.

    caller ──put()──▶ SimpleQueue ──▶ writer thread ──commit(conn, batch)──▶ SQLite (WAL)

Both durable stores use it: the usage ledger (ledger/ledger.py) and the stored responses
(server/openai/responses/disk.py; server may import ledger, never the reverse, docs/architecture.md). Each
store keeps what is its own: the connection, what a batch's commit does and how it fails, its
log messages' wording and its thread's name. Here is only what they share: the queue and its order
(writes reach the file in the order they were put), a flush that waits for what was put before it,
and a close that commits what is queued and stops the thread, also at interpreter exit, and an optional
bound on what waits (`max_pending`): a store whose disk fails must refuse writes it cannot hold, loudly,
rather than grow until the process dies (docs/operations.md, "Usage ledger and prices").
"""

from __future__ import annotations

import atexit
import enum
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_STOP = object()  # queue marker: commit what came before, then exit


class Put(enum.Enum):
    """What `BackgroundWriter.put` did with a write."""

    QUEUED = "queued"  # it will reach the file in order
    FULL = "full"  # refused: `max_pending` writes wait already (the file is failing or slow)
    CLOSED = "closed"  # refused: the writer was closed


class BackgroundWriter(Generic[T]):
    """The queue, the thread and its loop. `put` is O(1) and never blocks on I/O; `flush` and `close`
    block the caller. `label` starts the log messages written here ("usage ledger: ...") on `log`, the
    store's own logger, so that a deployment's logging configuration sees them where it did before."""

    def __init__(
        self,
        *,
        label: str,
        log: logging.Logger,
        thread_name: str,
        connect: Callable[[], sqlite3.Connection],
        commit: Callable[[sqlite3.Connection, list[T]], bool],
        max_delay_s: float = 0.0,
        max_batch: int = 1024,
        max_pending: int = 0,
        lock: threading.Lock | None = None,
    ) -> None:
        """`commit` returns whether the batch is durable: only then are its flushes answered (one that
        is not times out, as a caller must learn). A batch gathers for up to `max_delay_s` after its
        first write (0: only what is queued already), at most `max_batch` writes. `max_pending` bounds the
        writes put and not yet through a commit (0: no bound). `lock` (default a new one) orders put()
        against close(); a store passes its own to count under it with `num_queued` and `num_pending`."""
        if max_pending < 0:
            raise ValueError("max_pending must be >= 0 (0: no bound)")
        self._label = label
        self._log = log
        self._connect = connect
        self._commit = commit
        self._max_delay_s = max_delay_s
        self._max_batch = max_batch
        self.max_pending = max_pending
        self.lock = lock if lock is not None else threading.Lock()
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._closed = False
        self.num_queued = 0  # writes accepted by put(); read it under `lock`
        self.num_pending = 0  # of those, the ones whose commit has not returned yet; read it under `lock`
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()
        atexit.register(self.close)  # a process that forgets close() still commits on exit

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, item: T) -> Put:
        """Queue `item` for the next commit, or refuse it (nothing queued): CLOSED after close(), FULL
        while `max_pending` writes wait. Never blocks on I/O; the caller says what a refusal means."""
        with self.lock:
            if self._closed:
                return Put.CLOSED
            if self.max_pending and self.num_pending >= self.max_pending:
                return Put.FULL
            self._queue.put(item)
            self.num_queued += 1
            self.num_pending += 1
            return Put.QUEUED

    def flush(self, timeout: float) -> bool:
        """Block until everything put before this call is committed; False if that takes longer than
        `timeout` (a failing disk: the commit keeps retrying). After close() it waits for close()'s
        final commit only."""
        done = threading.Event()
        with self.lock:
            closed = self._closed
            if not closed:
                self._queue.put(done)
        if closed:
            self._thread.join(timeout)  # close() already queued the final commit
            return True
        return done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Commit everything put so far and stop the thread. Idempotent; later put()s return False."""
        with self.lock:
            first = not self._closed
            self._closed = True
            if first:
                self._queue.put(_STOP)
        if first:
            atexit.unregister(self.close)
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._log.error("%s: the writer did not finish within %s s; queued writes may be lost", self._label, timeout)

    # --- writer thread -------------------------------------------------------------------------

    def _run(self) -> None:
        conn = self._connect()
        try:
            stop = False
            while not stop:
                batch, waiters, stop = self._collect()
                durable = self._commit(conn, batch)
                with self.lock:  # committed, or lost and counted by the store: no longer waiting
                    self.num_pending -= len(batch)
                if durable:
                    for done in waiters:
                        done.set()
            try:
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:
                self._log.warning("%s: final checkpoint failed", self._label, exc_info=True)
        finally:
            conn.close()

    def _collect(self) -> tuple[list[T], list[threading.Event], bool]:
        """Block for the first item, then gather more for up to max_delay_s. A flush or stop marker
        ends the batch at once, so it holds exactly what was queued before the marker."""
        batch: list[T] = []
        waiters: list[threading.Event] = []
        item = self._queue.get()
        deadline = time.monotonic() + self._max_delay_s
        while True:
            if item is _STOP:
                return batch, waiters, True
            if isinstance(item, threading.Event):
                waiters.append(item)
                return batch, waiters, False
            batch.append(item)  # type: ignore[arg-type]  # put() admits only T
            if len(batch) >= self._max_batch:
                return batch, waiters, False
            remaining = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                return batch, waiters, False


def retry_until_done(attempt: Callable[[], R], failed: Callable[[int], None]) -> R:
    """`attempt()` until it raises no sqlite3.Error (a locked file, an I/O error, a full disk: transient,
    so the write is delayed, never dropped), backing off 0.05 s doubling to 2 s. `failed(n)` (the n-th
    failure in a row) runs inside the except, so it can count, roll back and log (`log_retry`)."""
    backoff_s = 0.05
    failures = 0
    while True:
        try:
            return attempt()
        except sqlite3.Error:
            failures += 1
            failed(failures)
            time.sleep(backoff_s)
            backoff_s = min(2.0, backoff_s * 2)


RETRY_LOG_EVERY = 15  # a failing commit says so again every this many tries (~30 s at the 2 s backoff)


def log_retry(log: logging.Logger, failures: int, message: str, *args: object) -> None:
    """Log the `failures`-th failure in a row of a commit (called inside its except): the first with
    its traceback, then one line every RETRY_LOG_EVERY tries, not a traceback every 2 s while a disk
    stays full."""
    if failures == 1:
        log.exception(message, *args)
    elif failures % RETRY_LOG_EVERY == 0:
        log.warning(message + " (still, %d tries)", *args, failures)
