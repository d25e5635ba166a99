"""The ledger's SQLite file: schema, batched idempotent inserts, bucketed aggregation.

One table, one row per request, `request_id` UNIQUE and every insert `INSERT OR IGNORE`: a record
written twice (a retry, a replay after a crash) counts once. The file is in WAL mode, so readers
(queries, the `usage` CLI) never block the writer and always see whole committed batches.

Functions here take a connection and are not thread-safe on their own: a connection belongs to
the thread that opened it (sqlite3's default check). Any number of connections may be open on
one file, from any number of threads and processes.
"""

from __future__ import annotations

import math
import os
import sqlite3
from collections.abc import Sequence
from enum import Enum

from prefixserve.ledger.pricing import ModelPrice, Pricing
from prefixserve.ledger.records import UsageQuery, UsageRecord, UsageRow
from prefixserve.types import LEGACY_OPEN_TENANT_ID, OPEN_TENANT_ID

# 2: the open server's tenant is OPEN_TENANT_ID; a version 1 file's rows of LEGACY_OPEN_TENANT_ID are
# moved to it when a server opens it (`init_schema`)
SCHEMA_VERSION = 2
TABLE = "usage_records"

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    id                 INTEGER PRIMARY KEY,
    request_id         TEXT    NOT NULL UNIQUE,
    created            REAL    NOT NULL,    -- unix seconds
    tenant_id          TEXT    NOT NULL,
    model              TEXT    NOT NULL,
    prompt_tokens      INTEGER NOT NULL,    -- cached ones included
    cached_tokens      INTEGER NOT NULL,
    completion_tokens  INTEGER NOT NULL,
    finish_reason      TEXT    NOT NULL,
    price_input        REAL    NOT NULL,    -- USD per million tokens, as applied when written
    price_cached_input REAL    NOT NULL,
    price_output       REAL    NOT NULL,
    cost_usd           REAL    NOT NULL     -- fixed at write time, later price changes leave it be
);
CREATE INDEX IF NOT EXISTS {TABLE}_created ON {TABLE} (created);
CREATE INDEX IF NOT EXISTS {TABLE}_tenant_created ON {TABLE} (tenant_id, created);
"""

_COLUMNS = (
    "request_id, created, tenant_id, model, prompt_tokens, cached_tokens, completion_tokens,"
    " finish_reason, price_input, price_cached_input, price_output, cost_usd"
)
_INSERT = f"INSERT OR IGNORE INTO {TABLE} ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"

Row = tuple[str, float, str, str, int, int, int, str, float, float, float, float]


def connect(path: str, *, query_only: bool = False) -> sqlite3.Connection:
    """Open `path` in autocommit mode (transactions are explicit) with `fsum` registered.

    synchronous=FULL: a committed batch survives a power cut as well as a process crash (the
    writer commits a few times a second at most, so the fsync is cheap).
    """
    conn = sqlite3.connect(path, timeout=10.0, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 10000")
    conn.execute("PRAGMA synchronous = FULL")
    if query_only:
        conn.execute("PRAGMA query_only = 1")
    conn.create_aggregate("fsum", 1, _ExactSum)  # type: ignore[arg-type]  # typeshed wants a factory
    return conn


def init_schema(path: str) -> None:
    """Create parent directories, the file, WAL mode and the schema; idempotent.

    A version 1 file is upgraded in the same transaction: its rows of tenant LEGACY_OPEN_TENANT_ID
    ("default", what an open server called its tenant then) become OPEN_TENANT_ID's, so an open
    server's usage reads as the open tenant's and a tenant a key file names `default` starts with
    none of it. (A deployment whose key file named a tenant `default` before this version finds that
    tenant's earlier rows under OPEN_TENANT_ID: docs/tenancy.md, "The open tenant", says how to move them back.)

    Raises RuntimeError on a file written by a newer (or foreign) schema, OSError / sqlite3.Error
    when the path cannot be created.
    """
    if not path or path == ":memory:" or path.startswith("file:"):
        raise ValueError(f"ledger path must be a file path, not {path!r}")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    # mode 0600 when new (its -wal and -shm files take the same): tenants' usage is the operator's
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    conn = connect(path)
    try:
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise RuntimeError(f"{path}: could not switch the ledger to WAL mode (got {mode})")
        conn.execute("BEGIN IMMEDIATE")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if conn.execute("PRAGMA application_id").fetchone()[0] != 0:  # the ledger never sets one; the stored
            conn.execute("ROLLBACK")                                   # responses' file, for one, does
            raise RuntimeError(f"{path}: not a usage ledger (another SQLite database)")
        if version not in (0, 1, SCHEMA_VERSION):
            conn.execute("ROLLBACK")
            raise RuntimeError(f"{path}: ledger schema version {version}, this build reads {SCHEMA_VERSION}")
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        if version == 1:
            conn.execute(f"UPDATE {TABLE} SET tenant_id = ? WHERE tenant_id = ?", (OPEN_TENANT_ID, LEGACY_OPEN_TENANT_ID))
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    finally:
        conn.close()


def open_existing(path: str) -> sqlite3.Connection:
    """A query-only connection to a ledger that must already exist (the CLI must not create one).

    Raises FileNotFoundError when there is no file, RuntimeError when it is not a ledger.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no usage ledger at {path}")
    conn = connect(path, query_only=True)
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version == 1:
        conn.close()
        raise RuntimeError(f"{path} is a ledger of an earlier version: start the server on it once to upgrade it")
    if version != SCHEMA_VERSION:
        conn.close()
        raise RuntimeError(f"{path} is not a prefixserve usage ledger (schema version {version})")
    return conn


def to_row(record: UsageRecord, pricing: Pricing) -> Row:
    """The record as a table row, priced now with `pricing`."""
    price = pricing.price_of(record.model)
    reason = record.finish_reason
    reason_text = str(reason.value) if isinstance(reason, Enum) else str(reason)
    return (
        str(record.request_id),
        float(record.created),
        str(record.tenant_id),
        str(record.model),
        int(record.prompt_tokens),
        int(record.cached_tokens),
        int(record.completion_tokens),
        reason_text,
        float(price.input),
        float(price.cached_input),
        float(price.output),
        price.cost(record.prompt_tokens, record.cached_tokens, record.completion_tokens),
    )


def insert_rows(conn: sqlite3.Connection, rows: Sequence[Row]) -> int:
    """Insert `rows` in one transaction; all or none become durable. Returns how many were new
    (the rest had a request_id already present and were ignored)."""
    before = conn.total_changes
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.executemany(_INSERT, rows)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return conn.total_changes - before


def query_usage(conn: sqlite3.Connection, query: UsageQuery) -> list[UsageRow]:
    """Aggregate committed records by time bucket (and model / tenant when grouped).

    One SELECT statement, so one read snapshot: in WAL mode it sees exactly the batches committed
    before it started. Rows are ordered by bucket, then tenant, then model; empty buckets have no row.
    """
    if query.tenant_ids == () or query.models == () or query.start_time == query.end_time:
        return []
    grouped = [g for g in ("tenant_id", "model") if g in query.group_by]
    select_keys = "".join(f", {g}" if g in grouped else f", NULL AS {g}" for g in ("tenant_id", "model"))
    where = ["created >= ?", "created < ?"]
    params: list[object] = [query.bucket_origin, query.bucket_width_s, query.start_time, query.end_time]
    for column, values in (("tenant_id", query.tenant_ids), ("model", query.models)):
        if values is not None:
            where.append(f"{column} IN ({', '.join('?' * len(values))})")
            params.extend(values)
    sql = (
        "SELECT CAST((created - ?) / ? AS INTEGER) AS k" + select_keys + ","
        " COUNT(*), SUM(prompt_tokens), SUM(cached_tokens), SUM(completion_tokens), fsum(cost_usd)"
        f" FROM {TABLE} WHERE {' AND '.join(where)}"
        f" GROUP BY {', '.join(['k', *grouped])} ORDER BY {', '.join(['k', *grouped])}"
    )
    origin, width = query.bucket_origin, query.bucket_width_s
    return [
        UsageRow(origin + k * width, model, tenant, n, prompt, cached, completion, cost)
        for k, tenant, model, n, prompt, cached, completion, cost in conn.execute(sql, params)
    ]


def check_integrity(conn: sqlite3.Connection) -> int:
    """Raise AssertionError unless every row keeps the ledger's invariants; returns the row count.

    Checked: schema version; 0 <= cached <= prompt; counts >= 0; request ids unique; the stored
    cost equals the formula over the stored prices bit for bit.
    """
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version != SCHEMA_VERSION:
        raise AssertionError(f"schema version {version} != {SCHEMA_VERSION}")
    num_rows = 0
    ids: set[str] = set()
    for row in conn.execute(f"SELECT {_COLUMNS} FROM {TABLE}"):
        request_id, _, _, _, prompt, cached, completion, _, p_in, p_cached, p_out, cost = row
        num_rows += 1
        if request_id in ids:
            raise AssertionError(f"request {request_id} recorded twice")
        ids.add(request_id)
        if not (0 <= cached <= prompt and completion >= 0):
            raise AssertionError(f"request {request_id}: bad counts {prompt}/{cached}/{completion}")
        if ModelPrice(p_in, p_cached, p_out).cost(prompt, cached, completion) != cost:
            raise AssertionError(f"request {request_id}: stored cost {cost} != its prices' cost")
    return num_rows


class _ExactSum:
    """SQLite aggregate: the correctly rounded sum of its floats, whatever the row order.

    Keeps Shewchuk's non-overlapping partials (a handful of floats, not every value).
    """

    def __init__(self) -> None:
        self._partials: list[float] = []

    def step(self, value: float | None) -> None:
        if value is None:
            return
        x = float(value)
        i = 0
        for y in self._partials:
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            lo = y - (hi - x)
            if lo:
                self._partials[i] = lo
                i += 1
            x = hi
        self._partials[i:] = [x]

    def finalize(self) -> float:
        return math.fsum(self._partials)
