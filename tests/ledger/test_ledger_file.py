"""The ledger's file: a database of another application is never taken for one (ledger/store.py
`init_schema`)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest


def test_another_sqlite_database_is_not_taken_for_a_ledger(tmp_path: Path) -> None:
    """--ledger-path at the stored responses' file (or any database that names its application) is
    refused, not given a usage table: the reverse mistake was already refused."""
    from prefixserve.ledger import store
    from prefixserve.server.openai.responses.disk import APPLICATION_ID

    other = tmp_path / "responses.sqlite3"
    conn = sqlite3.connect(other)
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute("PRAGMA user_version = 2")
    conn.execute("CREATE TABLE responses (id TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(RuntimeError, match="not a usage ledger"):
        store.init_schema(str(other))
    conn = sqlite3.connect(other)
    assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["responses"]
    conn.close()
    store.init_schema(str(tmp_path / "usage.sqlite3"))  # a new file is a ledger
