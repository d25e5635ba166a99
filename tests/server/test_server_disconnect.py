"""A client that goes away aborts its request: the engine's iterator is closed, promptly, whether the
response was streaming or not, and on both ASGI disconnect paths (< 2.4: listen; >= 2.4: send fails)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from prefixserve.config import ServerConfig
from prefixserve.server.app import create_app
from tests.helpers.fake_engine import FakeEngine
from tests.server.conftest import KEY_A


async def drive(
    app: Any,
    path: str,
    body: dict[str, Any],
    *,
    spec: str,
    cut_after_chunks: int | None,
    cut_after_s: float | None = None,
) -> list[dict[str, Any]]:
    """Call the ASGI app like a server would; disconnect after n body chunks or after a delay."""
    payload = json.dumps(body).encode()
    gone = asyncio.Event()
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if gone.is_set() and spec >= "2.4":
            raise OSError("connection reset")
        sent.append(message)
        chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if cut_after_chunks is not None and len(chunks) >= cut_after_chunks:
            gone.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
        "headers": [(b"authorization", f"Bearer {KEY_A}".encode()), (b"content-type", b"application/json")],
    }

    async def cut_later() -> None:
        if cut_after_s is not None:
            await asyncio.sleep(cut_after_s)
            gone.set()

    timer = asyncio.create_task(cut_later())
    try:
        await asyncio.wait_for(app(scope, receive, send), timeout=10)
    except ClientDisconnect:
        pass  # how Starlette reports a failed send on the >= 2.4 path
    timer.cancel()
    return sent


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_disconnect_closes_the_engine_iterator(spec: str, path: str) -> None:
    engine = FakeEngine(token_delay=0.01)
    app = create_app(engine, ServerConfig(api_keys=(KEY_A,)))
    body: dict[str, Any] = {"max_tokens": 400, "stream": True}
    body.update(
        {"prompt": "abc"} if "chat" not in path else {"messages": [{"role": "user", "content": "abc"}]}
    )
    sent = asyncio.run(drive(app, path, body, spec=spec, cut_after_chunks=3))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    (events,) = engine.events.values()
    assert events == ["started", "closed"]
    assert len([m for m in sent if m.get("body")]) < 20  # stopped long before 400 tokens
    metrics = app.state.metrics.render().decode()
    assert 'prefixserve_requests_finished_total{finish_reason="abort"} 1.0' in metrics
    assert "prefixserve_requests_in_flight 0.0" in metrics


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_streaming_disconnect_closes_the_engine_iterator(path: str) -> None:
    engine = FakeEngine(token_delay=0.01)
    app = create_app(engine, ServerConfig(api_keys=(KEY_A,)))
    body: dict[str, Any] = {"max_tokens": 400}
    body.update(
        {"prompt": "abc"} if "chat" not in path else {"messages": [{"role": "user", "content": "abc"}]}
    )
    sent = asyncio.run(drive(app, path, body, spec="2.3", cut_after_chunks=None, cut_after_s=0.2))
    (events,) = engine.events.values()
    assert events == ["started", "closed"]
    assert sent[0]["status"] == 499
    assert "prefixserve_requests_in_flight 0.0" in app.state.metrics.render().decode()


def test_a_finished_stream_is_not_counted_as_aborted() -> None:
    engine = FakeEngine()
    app = create_app(engine, ServerConfig(api_keys=(KEY_A,)))
    sent = asyncio.run(
        drive(
            app,
            "/v1/completions",
            {"prompt": "abc", "max_tokens": 3, "stream": True},
            spec="2.3",
            cut_after_chunks=None,
        )
    )
    assert b"".join(m.get("body", b"") for m in sent).endswith(b"data: [DONE]\n\n")
    assert list(engine.events.values()) == [["started", "finished"]]
    assert 'finish_reason="length"' in app.state.metrics.render().decode()
