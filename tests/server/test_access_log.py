"""The access log line (server/middleware.py): uvicorn's fields, written once the response has
ended (uvicorn wrote it before the response's first bytes, on every request's way to its first token),
with the status the app sent, or 500 when the app raised before sending one."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import pytest

from prefixserve.server.middleware import RequestCounter
from prefixserve.server.operator.metrics import ServerMetrics

SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
         "query_string": b"a=1", "http_version": "1.1", "client": ("127.0.0.1", 5000), "headers": []}


def serve(app: Any, headers: list[tuple[bytes, bytes]] | None = None,
          started: list[Any] | None = None) -> list[tuple[str, Any]]:
    """Run `app` behind the middleware (the request carrying `headers`); the messages sent and the
    access lines logged, in order; each response start's headers appended to `started`."""
    seen: list[tuple[str, Any]] = []

    class Spy(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(("log", record.getMessage()))

    log = logging.getLogger("prefixserve.access")
    spy, level = Spy(), log.level
    log.addHandler(spy)
    log.setLevel(logging.INFO)

    async def send(message: Any) -> None:
        seen.append(("sent", message["type"]))
        if message["type"] == "http.response.start" and started is not None:
            started.append(dict(message["headers"]))

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    try:
        asyncio.run(RequestCounter(app, ServerMetrics())({**SCOPE, "headers": headers or []}, receive, send))
    except RuntimeError as e:  # re-raised to uvicorn, which answers the 500 itself
        seen.append(("raised", str(e)))
    finally:
        log.removeHandler(spy)
        log.setLevel(level)
    return seen


async def created(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"x", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def test_the_access_line_follows_the_response() -> None:
    started: list[Any] = []
    seen = serve(created, started=started)
    rid = started[0][b"x-request-id"].decode()
    assert re.fullmatch(r"req_[0-9a-f]{32}", rid) and started[0][b"content-type"] == b"text/plain"
    assert seen == [("sent", "http.response.start"), ("sent", "http.response.body"), ("sent", "http.response.body"),
                    ("log", f'127.0.0.1:5000 - "POST /v1/chat/completions?a=1 HTTP/1.1" 201 Created {rid}')]


def test_a_clients_request_id_is_kept_and_a_strange_one_replaced() -> None:
    """A gateway's X-Request-Id comes back and names the access line, so its logs and ours meet; one
    that could forge a log line or a header (spaces, quotes, control bytes, too long) is replaced."""
    started: list[Any] = []
    seen = serve(created, [(b"x-request-id", b"gw-7f3a:42")], started)
    assert started[0][b"x-request-id"] == b"gw-7f3a:42" and seen[-1][1].endswith(" 201 Created gw-7f3a:42")
    for strange in (b"a b", b'x" 200 OK', b"\x1b[31m", b"x" * 129, b""):
        started.clear()
        serve(created, [(b"x-request-id", strange)], started)
        assert re.fullmatch(rb"req_[0-9a-f]{32}", started[0][b"x-request-id"]), strange


def test_an_app_that_raised_is_logged_as_a_500() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("boom")

    [(kind, line), raised] = serve(app)
    assert kind == "log" and re.fullmatch(r'127\.0\.0\.1:5000 - "POST /v1/chat/completions\?a=1 HTTP/1\.1" 500 Internal Server Error '
                        r"req_[0-9a-f]{32}", line) and raised == ("raised", "boom")


def test_uvicorn_writes_no_access_line_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefixserve.server import run

    captured: dict[str, Any] = {}

    class Stop(Exception):
        pass

    class FakeServer:
        def __init__(self, config: Any, engine: Any, grace_s: float, **kwargs: Any) -> None:
            captured["access_log"] = config.access_log
            raise Stop

    from prefixserve.server import shutdown
    monkeypatch.setattr(shutdown, "GracefulServer", FakeServer)
    with pytest.raises(Stop):
        run.serve_app(lambda *a: None, "127.0.0.1", 0)
    assert captured["access_log"] is False
