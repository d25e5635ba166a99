"""`Ledger`: records usage off the request path and answers usage queries.

    request thread ──record()──▶ SimpleQueue ──▶ writer thread ──▶ SQLite (WAL)
                                                  batches for <= max_delay_s, one commit per batch

The queue and the thread are ledger/writer.py's, shared with the stored responses; what a batch's
commit does, and how it fails, is this module's.

Durability: a record handed to `record()` is committed within about `max_delay_s` plus one
commit (tens of milliseconds; never more than ~0.2 s on a healthy disk). A crash (SIGKILL, power
cut) loses only what was not yet committed; a record is never written twice (request_id UNIQUE,
INSERT OR IGNORE), so replays after a restart are harmless.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from dataclasses import dataclass
from typing import Self

from prefixserve.ledger import store
from prefixserve.ledger.pricing import Pricing
from prefixserve.ledger.records import UsageQuery, UsageRecord, UsageRow
from prefixserve.ledger.writer import BackgroundWriter, retry_until_done

logger = logging.getLogger(__name__)


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
        self._lock = threading.Lock()  # orders record() against close(); guards the counters
        self._num_written = 0
        self._num_duplicates = 0
        self._num_dropped = 0
        self._num_write_errors = 0
        self._writer: BackgroundWriter[UsageRecord] = BackgroundWriter(
            label="usage ledger",
            log=logger,
            thread_name="ledger-writer",
            connect=lambda: store.connect(path),
            commit=self._commit,
            max_delay_s=max_delay_s,
            max_batch=max_batch,
            lock=self._lock,
        )

    def record(self, rec: UsageRecord) -> None:
        """Queue `rec` for the writer. Safe from any thread, O(1), never raises, never blocks on I/O.

        After close() the record is dropped and logged at ERROR (with its counts, so it can be
        recovered from the log).
        """
        try:
            if not isinstance(rec, UsageRecord):
                raise TypeError(f"expected a UsageRecord, got {type(rec).__name__}")
            if self._writer.put(rec):
                return
            with self._lock:
                self._num_dropped += 1
            logger.error("usage ledger closed; dropped %r", rec)
        except Exception:  # the hot path must not fail because of accounting
            logger.exception("usage ledger: could not queue %r", rec)

    def flush(self, timeout: float = 5.0) -> None:
        """Block until every record queued before this call is committed (durable).

        Raises TimeoutError if that takes longer than `timeout` (e.g. the disk is failing; the
        writer keeps retrying). After close() it only waits for close()'s final commit.
        """
        if not self._writer.flush(timeout):
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
        self._writer.close(timeout)

    @property
    def closed(self) -> bool:
        return self._writer.closed

    def stats(self) -> LedgerStats:
        with self._lock:
            return LedgerStats(
                self._writer.num_queued,
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

    def _commit(self, conn: sqlite3.Connection, batch: list[UsageRecord]) -> bool:
        """The writer's commit (ledger/writer.py): True once `batch` is durable. A failure other than
        SQLite's is a bug: the batch is logged and counted as dropped, its flushes time out, and the
        writer goes on with later records."""
        try:
            self._commit_batch(conn, batch)
        except Exception:
            logger.exception("usage ledger: lost a batch of %d records", len(batch))
            with self._lock:
                self._num_dropped += len(batch)
            return False
        return True

    def _commit_batch(self, conn: sqlite3.Connection, batch: list[UsageRecord]) -> None:
        """Commit `batch`, retrying transient failures (locked, I/O error, disk full) with backoff
        until it succeeds. Rows SQLite refuses outright are isolated, logged and dropped."""
        if not batch:
            return
        rows = [store.to_row(rec, self.pricing) for rec in batch]

        def failed() -> None:
            with self._lock:
                self._num_write_errors += 1
            logger.exception("usage ledger: commit of %d records failed; retrying", len(rows))

        num_new, num_refused = retry_until_done(lambda: _insert_isolating_refused(conn, rows), failed)
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
