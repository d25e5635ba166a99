"""Stored responses on disk: one SQLite file mirroring server/openai/responses/store.py's memory, so that a
client's `previous_response_id` chain, GET /v1/responses/{id}, its input items and `item_reference`s
survive a restart or a redeploy (OpenAI keeps stored responses for 30 days; clients expect them to last).

    ResponseStore (memory: reads, the bounds) ──put / touch / delete──▶ SimpleQueue ──▶ writer thread ──▶ SQLite (WAL)
                                                    (ledger/writer.py's, as the usage ledger's)

Memory stays where requests read from: a chained request is prepared on the event loop when its prompt
is remembered (server/openai/routes.py), and it must not wait for a disk. The file is read once, when the server
starts, into the same bounded memory as before (`--max-stored-responses`, 64 MiB of text): the file
holds exactly what memory holds, so the bounds bound it too. A commit with synchronous=FULL waits for
an fsync (milliseconds, more on a slow disk), so the writes are one thread's, batched: whatever is
queued when it wakes is one transaction. A crash or power cut mid-write leaves the last whole
transaction (SQLite's WAL); what was not yet committed (a few milliseconds' worth) is lost, never half
written. Operations reach the file in the order memory applied them, so a DELETE or an eviction is never
undone by an earlier write.

Tenants are stored by the id the server already gives them (server/operator/auth.py: a named tenant, or
`key-` + 12 hex digits of the key's SHA-256, as the usage ledger records them), never by the key.
Measured, and the design's trade-offs: docs/architecture.md, "Stored responses".
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixserve.ledger.writer import BackgroundWriter, Put, log_retry, retry_until_done
from prefixserve.types import LEGACY_OPEN_TENANT_ID, OPEN_TENANT_ID

logger = logging.getLogger(__name__)

# 2: the open server's tenant is OPEN_TENANT_ID; a version 1 file's rows of LEGACY_OPEN_TENANT_ID are
# moved to it when opened (`_init_schema`), as the ledger's are (ledger/store.py)
SCHEMA_VERSION = 2
APPLICATION_ID = 0x70737273  # "psrs": a file of prefixserve's stored responses, not the ledger's nor anyone's
TABLE = "stored_responses"
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    tenant_id   TEXT    NOT NULL,   -- server/operator/auth.py's tenant id, never a key
    response_id TEXT    NOT NULL,
    used        INTEGER NOT NULL,   -- recency: larger is more recently used (per tenant order is what counts)
    messages    TEXT    NOT NULL,   -- JSON: the conversation through the response, as chat messages
    items       TEXT    NOT NULL,   -- JSON: the same before the output, as typed input items
    response    TEXT    NOT NULL,   -- JSON: the response object as answered
    PRIMARY KEY (tenant_id, response_id)
)"""
_PUT = f"INSERT OR REPLACE INTO {TABLE} (tenant_id, response_id, used, messages, items, response) VALUES (?, ?, ?, ?, ?, ?)"
_TOUCH = f"UPDATE {TABLE} SET used = ? WHERE tenant_id = ? AND response_id = ?"
_DELETE = f"DELETE FROM {TABLE} WHERE tenant_id = ? AND response_id = ?"


@dataclass(frozen=True, slots=True)
class Loaded:
    """One row read back at start-up, decoded; `chars` counts its JSON texts as ResponseStore.put does."""

    tenant_id: str
    response_id: str
    used: int
    messages: list[dict[str, Any]]
    items: list[dict[str, Any]]
    response: dict[str, Any]
    chars: int


def open_disk(path: str | Path, flag: str = "--responses-path") -> ResponseDisk:
    """The file at `path`, created (mode 0600: it holds prompts and replies) with its directory when missing.
    One that cannot hold stored responses is a ValueError naming `flag` and the path, for start-up's one
    line and exit status 2 (server/run.py)."""
    path = Path(path)
    where = f"{flag} {path}"
    if path.is_dir():
        raise ValueError(f"{where}: is a directory; stored responses are a file (e.g. {path / 'responses.sqlite3'})")
    if path.parent.exists() and not path.parent.is_dir():
        raise ValueError(f"{where}: {path.parent} is not a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        return ResponseDisk(str(path))
    except InUse:
        raise ValueError(f"{where}: in use by another prefixserve process; one server per stored-responses "
                         "file (each reads it once, at start): give each its own --responses-path or "
                         "--data-dir, or pass --no-responses-persist") from None
    except (OSError, sqlite3.Error, RuntimeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise ValueError(f"{where}: cannot open the stored responses: {reason}") from None


class InUse(Exception):
    """Another ResponseDisk (this process or another) holds the file."""


class ResponseDisk:
    """The file and its writer thread. `put`, `touch` and `delete` queue in O(1) and never raise or block
    on I/O; call them in the order memory changed (ResponseStore does, under its lock). `load`, `flush`
    and `close` block the caller."""

    def __init__(self, path: str) -> None:
        """Open and check the file, creating its schema; raises sqlite3.Error / RuntimeError for a file
        that is not SQLite, not WAL-capable, or not a prefixserve stored-responses file of this version,
        InUse when another one holds it (an exclusive flock on the file, held until `close`: two servers
        on one file would each serve only what it loaded, and overwrite each other's rows)."""
        self.path = path
        self._lock = os.open(path, os.O_RDONLY)
        try:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise InUse(path) from None
            conn = _connect(path)
            try:
                _init_schema(conn, path)
            finally:
                conn.close()
        except BaseException:
            os.close(self._lock)
            raise
        self.num_write_errors = 0  # failed commit attempts (each retried)
        self._writer: BackgroundWriter[tuple[str, tuple[Any, ...]]] = BackgroundWriter(
            label="stored responses",
            log=logger,
            thread_name="response-store-writer",
            connect=lambda: _connect(path),
            commit=self._commit,
            max_batch=1024,
        )

    def load(self) -> Iterator[Loaded]:
        """Every readable row, least recently used first. A row that does not decode to a stored response
        is logged, skipped (its id is then a 404 like any unknown one) and deleted: it can never be served."""
        conn = _connect(self.path)
        try:
            rows = conn.execute(f"SELECT tenant_id, response_id, used, messages, items, response FROM {TABLE}"
                                " ORDER BY used").fetchall()
        finally:
            conn.close()
        for tenant_id, response_id, used, *texts in rows:
            try:
                yield _decoded(tenant_id, response_id, used, texts)
            except (ValueError, TypeError, KeyError) as e:
                logger.error("stored response %r (tenant %r) in %s is unreadable and is forgotten: %s",
                             str(response_id)[:64], str(tenant_id)[:64], self.path, e)
                self.delete(tenant_id, response_id)

    def put(self, tenant_id: str, response_id: str, used: int, texts: tuple[str, str, str]) -> None:
        self._send((_PUT, (tenant_id, response_id, used, *texts)))

    def touch(self, tenant_id: str, response_id: str, used: int) -> None:
        self._send((_TOUCH, (used, tenant_id, response_id)))

    def delete(self, tenant_id: str, response_id: str) -> None:
        self._send((_DELETE, (tenant_id, response_id)))

    def flush(self, timeout: float = 5.0) -> None:
        """Block until everything queued before the call is committed. Raises TimeoutError past `timeout`."""
        if not self._writer.flush(timeout):
            raise TimeoutError(f"stored responses not durable in {self.path} after {timeout} s")

    def close(self, timeout: float = 10.0) -> None:
        """Commit what is queued, stop the writer and let the file go. Idempotent; later writes are dropped
        (and logged)."""
        self._writer.close(timeout)
        if self._lock >= 0:
            os.close(self._lock)  # releases the flock
            self._lock = -1

    def _send(self, op: tuple[str, tuple[Any, ...]]) -> None:
        if self._writer.put(op) is not Put.QUEUED:  # no max_pending here: CLOSED only
            logger.error("stored responses: closed; a write to %s was dropped", self.path)

    # --- writer thread (ledger/writer.py's) ----------------------------------------------------

    def _commit(self, conn: sqlite3.Connection, ops: list[tuple[str, tuple[Any, ...]]]) -> bool:
        """All of `ops` in one transaction, retried with backoff until it commits: a failing disk delays
        the file (memory keeps serving), and no write is dropped, so a DELETE can never come back."""
        if not ops:
            return True

        def attempt() -> None:
            conn.execute("BEGIN IMMEDIATE")
            for sql, params in ops:
                conn.execute(sql, params)
            conn.execute("COMMIT")

        def failed(failures: int) -> None:
            _rollback(conn)
            self.num_write_errors += 1
            log_retry(logger, failures, "stored responses: a commit of %d writes to %s failed; retrying", len(ops),
                      self.path)

        retry_until_done(attempt, failed)
        return True


def _connect(path: str) -> sqlite3.Connection:
    """Autocommit (transactions explicit); synchronous=FULL: a commit survives a power cut too."""
    conn = sqlite3.connect(path, timeout=10.0, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 10000")
    conn.execute("PRAGMA synchronous = FULL")
    return conn


def _init_schema(conn: sqlite3.Connection, path: str) -> None:
    """WAL mode and the table, in a file that is new or already ours (application_id and user_version).
    A version 1 file's responses of tenant LEGACY_OPEN_TENANT_ID become OPEN_TENANT_ID's (an open
    server's then), in the same transaction."""
    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        raise RuntimeError(f"could not switch to WAL mode (got {mode})")
    conn.execute("BEGIN IMMEDIATE")
    try:
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        if app_id == 0 and version == 0 and tables == 0:
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        elif app_id != APPLICATION_ID:
            raise RuntimeError("not a prefixserve stored-responses file (another SQLite database)")
        elif version == 1:
            conn.execute(f"UPDATE {TABLE} SET tenant_id = ? WHERE tenant_id = ?", (OPEN_TENANT_ID, LEGACY_OPEN_TENANT_ID))
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        elif version != SCHEMA_VERSION:
            raise RuntimeError(f"stored-responses schema version {version}, this build reads {SCHEMA_VERSION}")
        conn.execute(_SCHEMA)
        conn.execute("COMMIT")
    except BaseException:
        _rollback(conn)
        raise


def _rollback(conn: sqlite3.Connection) -> None:
    try:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
    except sqlite3.Error:  # a failing disk: the transaction is gone with the connection's next use
        logger.warning("stored responses: rollback failed", exc_info=True)


def _decoded(tenant_id: Any, response_id: Any, used: Any, texts: list[Any]) -> Loaded:
    """A row as ResponseStore keeps it; ValueError / TypeError / KeyError when it is not one."""
    if not (isinstance(tenant_id, str) and isinstance(response_id, str) and isinstance(used, int)):
        raise TypeError("bad key columns")
    if not all(isinstance(t, str) for t in texts):
        raise TypeError("a JSON column is not text")
    messages, items, response = (json.loads(t) for t in texts)
    if not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
        raise TypeError("messages is not a list of objects")
    if not (isinstance(items, list) and all(isinstance(i, dict) for i in items)):
        raise TypeError("items is not a list of objects")
    if not (isinstance(response, dict) and isinstance(response["output"], list)
            and all(isinstance(i, dict) for i in response["output"])):
        raise TypeError("response is not a response object")
    return Loaded(tenant_id, response_id, used, messages, items, response, sum(len(t) for t in texts))
