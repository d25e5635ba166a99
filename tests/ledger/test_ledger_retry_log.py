"""A commit that keeps failing (a full disk) is retried until it succeeds, and says so once with its
traceback and then one line every RETRY_LOG_EVERY tries, not a traceback every 2 s
(ledger/writer.py `retry_until_done`, `log_retry`)."""

from __future__ import annotations

import logging
import sqlite3

import pytest

from prefixserve.ledger import writer


def test_a_failing_commit_logs_its_traceback_once_then_a_line_now_and_then(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(writer.time, "sleep", lambda s: None)
    log = logging.getLogger("prefixserve.test-retry")
    tries = 2 * writer.RETRY_LOG_EVERY + 3

    def attempt() -> str:
        nonlocal tries
        tries -= 1
        if tries:
            raise sqlite3.OperationalError("database or disk is full")
        return "done"

    with caplog.at_level(logging.DEBUG, logger="prefixserve.test-retry"):
        assert writer.retry_until_done(attempt, lambda n: writer.log_retry(log, n, "commit of %d rows failed", 7)) == "done"
    records = [r for r in caplog.records if r.name == "prefixserve.test-retry"]
    assert [(r.levelname, r.exc_info is not None) for r in records] == [("ERROR", True), ("WARNING", False),
                                                                        ("WARNING", False)]
    assert records[0].getMessage() == "commit of 7 rows failed"
    assert records[2].getMessage() == f"commit of 7 rows failed (still, {2 * writer.RETRY_LOG_EVERY} tries)"
