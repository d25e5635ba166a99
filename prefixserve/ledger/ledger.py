"""`Ledger`: records usage off the request path and answers usage queries.

    request thread ──record()──▶ SimpleQueue ──▶ writer thread ──▶ SQLite (WAL)
                                                  batches for <= max_delay_s, one commit per batch

The queue and the thread are ledger/writer.py's, shared with the stored responses; what a batch's
commit does, and how it fails, is this module's.

Durability: a record handed to `record()` is committed within about `max_delay_s` plus one
commit (tens of milliseconds; never more than ~0.2 s on a healthy disk). A crash (SIGKILL, power
cut) loses only what was not yet committed; a record is never written twice (request_id UNIQUE,
INSERT OR IGNORE), so replays after a restart are harmless.

Backlog: while SQLite fails, records wait in memory, at most `max_pending` of them. From half of that
on, `refusal()` says why the server should take no new billable request (it answers 503
`ledger_backlog`), so the records of the requests already running still fit; a record past the bound
is refused, counted and logged at ERROR with its counts, never silently lost and never a reason for
memory to grow without bound (docs/operations.md, "Usage ledger and prices").
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
from prefixserve.ledger.writer import BackgroundWriter, Put, log_retry, retry_until_done

logger = logging.getLogger(__name__)

MAX_PENDING = 65_536  # records waiting for SQLite at most (~300 bytes each with the queue: ~20 MB)


@dataclass(frozen=True, slots=True)
class LedgerStats:
    num_recorded: int  # accepted by record()
    num_written: int  # new rows committed
    num_duplicates: int  # committed batches' records whose request_id was already present
    num_dropped: int  # recorded after close(), or rejected by SQLite as unwritable
    num_write_errors: int  # failed commit attempts (each retried)
    num_pending: int = 0  # accepted, not committed yet (the backlog `max_pending` bounds)
    num_refused: int = 0  # refused by record() with `max_pending` waiting (each logged at ERROR)


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
        max_pending: int = MAX_PENDING,
    ) -> None:
        """Create parent dirs and schema (errors raise here, at start-up), start the writer. At most
        `max_pending` records wait for SQLite (the module docstring)."""
        if not 0 < max_delay_s <= 0.2:
            raise ValueError("max_delay_s must be in (0, 0.2]")
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if max_pending < 2:
            raise ValueError("max_pending must be >= 2")
        store.init_schema(path)
        self.path = path
        self.pricing = pricing if pricing is not None else Pricing.default()
        self._lock = threading.Lock()  # orders record() against close(); guards the counters
        self._num_written = 0
        self._num_duplicates = 0
        self._num_dropped = 0
        self._num_write_errors = 0
        self._num_refused = 0
        self._backlogged = False  # refusal() refuses; set and logged as the backlog reaches half of max_pending
        self._writer: BackgroundWriter[UsageRecord] = BackgroundWriter(
            label="usage ledger",
            log=logger,
            thread_name="ledger-writer",
            connect=lambda: store.connect(path),
            commit=self._commit,
            max_delay_s=max_delay_s,
            max_batch=max_batch,
            max_pending=max_pending,
            lock=self._lock,
        )

    def record(self, rec: UsageRecord) -> None:
        """Queue `rec` for the writer. Safe from any thread, O(1), never raises, never blocks on I/O.

        After close(), or with `max_pending` records waiting, the record is refused and logged at ERROR
        (with its counts, so it can be recovered from the log) and counted (`num_dropped`, `num_refused`).
        """
        try:
            if not isinstance(rec, UsageRecord):
                raise TypeError(f"expected a UsageRecord, got {type(rec).__name__}")
            put = self._writer.put(rec)
            with self._lock:
                if put is Put.QUEUED:
                    rising = not self._backlogged and self._writer.num_pending >= self._writer.max_pending // 2
                    self._backlogged |= rising
                    num_pending = self._writer.num_pending
                elif put is Put.FULL:
                    self._num_refused += 1
                else:
                    self._num_dropped += 1
            if put is Put.QUEUED:
                if rising:
                    logger.error("usage ledger: %d records wait for %s (failing or slow?); new requests are refused "
                                 "with 503 ledger_backlog until it catches up", num_pending, self.path)
                return
            if put is Put.FULL:
                logger.error("usage ledger: %d records wait for %s already; refused %r",
                             self._writer.max_pending, self.path, rec)
            else:
                logger.error("usage ledger closed; dropped %r", rec)
        except Exception:  # the hot path must not fail because of accounting
            logger.exception("usage ledger: could not queue %r", rec)

    def refusal(self) -> str | None:
        """Why a new billable request should be refused now, or None: from half of `max_pending` records
        waiting for SQLite until they are down to a quarter, so the requests already running can still
        record theirs. O(1), no lock: an event loop calls it for every request."""
        if not self._backlogged:
            return None
        return (f"the usage ledger cannot keep up: {self._writer.num_pending} usage records wait for its file; "
                "new requests are refused until they are written")

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
                self._writer.num_pending,
                self._num_refused,
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
        finally:
            self._caught_up(len(batch))
        return True

    def _caught_up(self, num_done: int) -> None:
        """After a commit of `num_done` records: stop refusing once what still waits is at most a quarter
        of `max_pending` (the writer subtracts them after this returns)."""
        with self._lock:
            falling = self._backlogged and self._writer.num_pending - num_done <= self._writer.max_pending // 4
            self._backlogged &= not falling
        if falling:
            logger.warning("usage ledger: caught up with %s; new requests are served again", self.path)

    def _commit_batch(self, conn: sqlite3.Connection, batch: list[UsageRecord]) -> None:
        """Commit `batch`, retrying transient failures (locked, I/O error, disk full) with backoff
        until it succeeds. Rows SQLite refuses outright are isolated, logged and dropped."""
        if not batch:
            return
        rows = [store.to_row(rec, self.pricing) for rec in batch]

        def failed(failures: int) -> None:
            with self._lock:
                self._num_write_errors += 1
            log_retry(logger, failures, "usage ledger: commit of %d records failed; retrying", len(rows))

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
