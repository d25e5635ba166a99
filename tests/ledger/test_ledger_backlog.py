"""A ledger whose file fails holds at most `max_pending` records, refuses the rest loudly, and the server
refuses new requests with an OpenAI-shaped 503 while the backlog is high, so no usage is lost silently
and memory does not grow (docs/operations.md, "Usage ledger and prices")."""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from prefixserve.config import ServerConfig
from prefixserve.ledger import Ledger, UsageRecord, store
from prefixserve.server.app import create_app
from tests.helpers.fake_engine import FakeEngine

T0 = 1_730_419_200


def rec(i: int) -> UsageRecord:
    return UsageRecord(f"req-{i}", "t1", "m1", 100, 40, 10, "stop", T0)


@pytest.fixture()
def healthy(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The ledger's SQLite fails every commit (a disk I/O error) until the event is set."""
    ok = threading.Event()
    real = store.insert_rows

    def insert(conn: sqlite3.Connection, rows: list[store.Row]) -> int:
        if not ok.is_set():
            raise sqlite3.OperationalError("disk I/O error")
        return real(conn, rows)

    monkeypatch.setattr(store, "insert_rows", insert)
    return ok


def test_a_failing_file_bounds_the_backlog_and_refuses_loudly(
    tmp_path: Path, healthy: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = Ledger(str(tmp_path / "usage.sqlite3"), max_pending=8)
    try:
        with caplog.at_level(logging.WARNING, logger="prefixserve.ledger.ledger"):
            for i in range(3):
                ledger.record(rec(i))
            assert ledger.refusal() is None  # 3 of 8 wait: requests are served
            ledger.record(rec(3))
            why = ledger.refusal()
            assert why is not None and "4 usage records wait" in why  # half of max_pending
            for i in range(4, 10):
                ledger.record(rec(i))
            stats = ledger.stats()
            assert (stats.num_recorded, stats.num_pending, stats.num_refused, stats.num_written) == (8, 8, 2, 0)
            refused = [r.getMessage() for r in caplog.records if "refused UsageRecord" in r.getMessage()]
            assert [m.split("request_id='")[1].split("'")[0] for m in refused] == ["req-8", "req-9"]
            assert sum("new requests are refused with 503" in r.getMessage() for r in caplog.records) == 1

            healthy.set()
            ledger.flush(timeout=10)
            stats = ledger.stats()
            assert (stats.num_pending, stats.num_written, stats.num_refused, stats.num_dropped) == (0, 8, 2, 0)
            assert ledger.refusal() is None
            assert any("caught up" in r.getMessage() for r in caplog.records)
        ledger.record(rec(10))
        ledger.flush(timeout=10)
        assert ledger.stats().num_written == 9
        assert ledger.check_integrity() == 9
    finally:
        healthy.set()
        ledger.close()


def test_the_server_refuses_new_requests_while_the_ledger_is_backlogged(tmp_path: Path, healthy: threading.Event) -> None:
    ledger = Ledger(str(tmp_path / "usage.sqlite3"), max_pending=2)
    app = create_app(FakeEngine(), ServerConfig(api_keys=("sk-a",)), ledger)
    body = {"prompt": "abcd", "max_tokens": 2}
    headers = {"Authorization": "Bearer sk-a"}
    try:
        with TestClient(app) as client:
            first = client.post("/v1/completions", json=body, headers=headers)
            assert first.status_code == 200  # its record waits: 1 of 2, the refusal mark
            refused = client.post("/v1/completions", json=body, headers=headers)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
            error = refused.json()["error"]
            assert (error["code"], error["type"]) == ("ledger_backlog", "service_unavailable")
            assert "usage records wait" in error["message"]
            assert ledger.stats().num_recorded == 1  # the refused request made no record: it did no work

            healthy.set()
            ledger.flush(timeout=10)
            assert client.post("/v1/completions", json=body, headers=headers).status_code == 200
    finally:
        healthy.set()  # else closing the ledger waits for the failing file
        ledger.close()
    assert ledger.stats().num_written == 2
