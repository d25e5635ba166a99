"""`Ledger`: records usage off the request path and answers usage queries.

    request thread ──record()──▶ SimpleQueue ──▶ writer thread ──▶ SQLite (WAL)
                                                  batches for <= max_delay_s, one commit per batch

Durability: a record handed to `record()` is committed within about `max_delay_s` plus one
commit (tens of milliseconds; never more than ~0.2 s on a healthy disk). A crash (SIGKILL, power
cut) loses only what was not yet committed; a record is never written twice (request_id UNIQUE,
INSERT OR IGNORE), so replays after a restart are harmless.
"""

from __future__ import annotations

import atexit
import logging
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Self

from prefixserve.ledger import store
from prefixserve.ledger.pricing import Pricing
from prefixserve.ledger.records import UsageQuery, UsageRecord, UsageRow

logger = logging.getLogger(__name__)

_STOP = object()  # queue marker: commit what came before, then exit


@dataclass(frozen=True, slots=True)
class LedgerStats:
    num_recorded: int  # accepted by record()
    num_written: int  # new rows committed
    num_duplicates: int  # committed batches' records whose request_id was already present
    num_dropped: int  # recorded after close(), or rejected by SQLite as unwritable
    num_write_errors: int  # failed commit attempts (each retried)


class Ledger:
    """Per-request usage, durable in SQLite, written by one batching thread.

    Thread-safety: every public method may be called from any thread. `record()` is O(1) and
    never blocks on I/O or raises; `flush()`, `query()` and `close()` block the caller.
    """

    def __init__(
        self,
        path: str,
        pricing: Pricing | None = None,
        *,
        max_delay_s: float = 0.05,
        max_batch: int = 2048,
    ) -> None:
        """Create parent dirs and schema (errors raise here, at start-up), start the writer."""
        if not 0 < max_delay_s <= 0.2:
            raise ValueError("max_delay_s must be in (0, 0.2]")
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        store.init_schema(path)
        self.path = path
        self.pricing = pricing if pricing is not None else Pricing.default()
        self._max_delay_s = max_delay_s
        self._max_batch = max_batch
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders record() against close(); guards the counters
        self._closed = False
        self._num_recorded = 0
        self._num_written = 0
        self._num_duplicates = 0
        self._num_dropped = 0
        self._num_write_errors = 0
        self._writer = threading.Thread(target=self._run, name="ledger-writer", daemon=True)
        self._writer.start()
        atexit.register(self.close)  # a process that forgets close() still commits on exit

    def record(self, rec: UsageRecord) -> None:
        """Queue `rec` for the writer. Safe from any thread, O(1), never raises, never blocks on I/O.

        After close() the record is dropped and logged at ERROR (with its counts, so it can be
        recovered from the log).
        """
        try:
            if not isinstance(rec, UsageRecord):
                raise TypeError(f"expected a UsageRecord, got {type(rec).__name__}")
            with self._lock:
                if not self._closed:
                    self._queue.put(rec)
                    self._num_recorded += 1
                    return
                self._num_dropped += 1
            logger.error("usage ledger closed; dropped %r", rec)
        except Exception:  # the hot path must not fail because of accounting
            logger.exception("usage ledger: could not queue %r", rec)

    def flush(self, timeout: float = 5.0) -> None:
        """Block until every record queued before this call is committed (durable).

        Raises TimeoutError if that takes longer than `timeout` (e.g. the disk is failing; the
        writer keeps retrying). After close() it only waits for close()'s final commit.
        """
        done = threading.Event()
        with self._lock:
            closed = self._closed
            if not closed:
                self._queue.put(done)
        if closed:
            self._writer.join(timeout)  # close() already queued the final commit
            return
        if not done.wait(timeout):
            raise TimeoutError(f"usage ledger: records not durable after {timeout} s")

    def query(self, query: UsageQuery, *, flush: bool = True) -> list[UsageRow]:
        """Aggregated usage (see `store.query_usage`).

        With flush (the default) everything recorded before the call is committed first, so a
        caller reads its own writes; the SELECT then runs on a fresh connection and reads one
        WAL snapshot, which holds only whole committed batches. Blocks for about one commit:
        call it from a worker thread, not an event loop.
        """
        if flush and not self.closed:
            self.flush()
        conn = store.connect(self.path, query_only=True)
        try:
            return store.query_usage(conn, query)
        finally:
            conn.close()

    def check_integrity(self) -> int:
        """Flush, then verify every committed row (store.check_integrity); returns the row count."""
        if not self.closed:
            self.flush()
        conn = store.connect(self.path, query_only=True)
        try:
            return store.check_integrity(conn)
        finally:
            conn.close()

    def close(self, timeout: float = 10.0) -> None:
        """Commit everything recorded so far and stop the writer. Idempotent; later record()s drop."""
        with self._lock:
            first = not self._closed
            self._closed = True
            if first:
                self._queue.put(_STOP)
        if first:
            atexit.unregister(self.close)
        self._writer.join(timeout)
        if self._writer.is_alive():
            logger.error("usage ledger: writer did not finish within %s s; records may be lost", timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> LedgerStats:
        with self._lock:
            return LedgerStats(
                self._num_recorded,
                self._num_written,
                self._num_duplicates,
                self._num_dropped,
                self._num_write_errors,
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- writer thread -------------------------------------------------------------------------

    def _run(self) -> None:
        conn = store.connect(self.path)
        try:
            stop = False
            while not stop:
                batch, waiters, stop = self._collect()
                try:
                    self._commit(conn, batch)
                except Exception:  # a bug; keep serving later records, leave these waiters to time out
                    logger.exception("usage ledger: lost a batch of %d records", len(batch))
                    with self._lock:
                        self._num_dropped += len(batch)
                    continue
                for done in waiters:
                    done.set()
            try:
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:
                logger.warning("usage ledger: final checkpoint failed", exc_info=True)
        finally:
            conn.close()

    def _collect(self) -> tuple[list[UsageRecord], list[threading.Event], bool]:
        """Block for the first item, then gather more for up to max_delay_s. A flush or stop marker
        ends the batch at once, so it holds exactly what was queued before the marker."""
        batch: list[UsageRecord] = []
        waiters: list[threading.Event] = []
        item = self._queue.get()
        deadline = time.monotonic() + self._max_delay_s
        while True:
            if item is _STOP:
                return batch, waiters, True
            if isinstance(item, threading.Event):
                waiters.append(item)
                return batch, waiters, False
            batch.append(item)  # type: ignore[arg-type]  # record() admits only UsageRecords
            if len(batch) >= self._max_batch:
                return batch, waiters, False
            remaining = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                return batch, waiters, False

    def _commit(self, conn: sqlite3.Connection, batch: list[UsageRecord]) -> None:
        """Commit `batch`, retrying transient failures (locked, I/O error, disk full) with backoff
        until it succeeds. Rows SQLite refuses outright are isolated, logged and dropped."""
        if not batch:
            return
        rows = [store.to_row(rec, self.pricing) for rec in batch]
        backoff_s = 0.05
        while True:
            try:
                num_new, num_refused = _insert_isolating_refused(conn, rows)
                break
            except sqlite3.Error:
                with self._lock:
                    self._num_write_errors += 1
                logger.exception("usage ledger: commit of %d records failed; retrying", len(rows))
                time.sleep(backoff_s)
                backoff_s = min(2.0, backoff_s * 2)
        with self._lock:
            self._num_written += num_new
            self._num_dropped += num_refused
            self._num_duplicates += len(rows) - num_new - num_refused


# Errors that retrying cannot fix: the row itself is unwritable.
_REFUSED = (sqlite3.InterfaceError, sqlite3.IntegrityError, sqlite3.DataError)


def _insert_isolating_refused(conn: sqlite3.Connection, rows: list[store.Row]) -> tuple[int, int]:
    """(new rows, refused rows). One transaction normally; row by row only if one is refused."""
    try:
        return store.insert_rows(conn, rows), 0
    except _REFUSED:
        pass
    num_new = num_refused = 0
    for row in rows:
        try:
            num_new += store.insert_rows(conn, [row])
        except _REFUSED:
            logger.exception("usage ledger: SQLite refused record %r; dropped", row)
            num_refused += 1
    return num_new, num_refused
