"""What a client sees when the bounded shutdown ends its request (docs/architecture.md, "Shutdown"),
on a real uvicorn GracefulServer in this process over a fake engine, so that it takes well under a
second and can reach the paths a real model cannot be made to take on purpose:

- the engine ends requests (`end_all`, the grace path): a Responses API stream gets `response.failed`
  with the 503's error and nothing after it (no `[DONE]`, as OpenAI's), a non-streaming one the 503;
- the engine does not end them (its step has not returned) or a request waits for a body never sent,
  and SETTLE_S later the shutdown cancels their tasks: each still gets its last word, the 503 in
  OpenAI's shape or the stream's error event (+ `[DONE]` for chat), not uvicorn's plain-text 500 or a
  stream cut without a reason (server/in_flight.py).

tests/reliability/test_shutdown_timeout.py covers the grace path end to end on the real model.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from prefixserve.config import ServerConfig
from prefixserve.server import shutdown
from prefixserve.server.app import create_app
from prefixserve.server.run import bind_socket
from prefixserve.types import Delta, FinishReason, Request
from tests.helpers.fake_engine import FakeEngine
from tests.server.conftest import KEY_A, FakeLedger, auth

SHUTTING_DOWN = {"message": "the server is shutting down", "type": "service_unavailable", "param": None,
                 "code": "service_unavailable"}
CHAT = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 400}
RESPONSE = {"input": "abc", "max_output_tokens": 400}


class ShutdownEngine(FakeEngine):
    """`end_all` ends each request at its next token (ABORT with the error, as AsyncEngine's), or,
    `stuck`, never: every request stops after 3 tokens, as behind an engine step that does not return."""

    def __init__(self, stuck: bool) -> None:
        super().__init__(token_delay=0.01)
        self.stuck = stuck
        self.ended_with: str | None = None
        self.end_all_calls = 0

    async def generate(self, request: Request) -> AsyncIterator[Delta]:
        inner = super().generate(request)
        try:
            n = 0
            async for delta in inner:
                if self.ended_with is not None:
                    yield Delta("", (), FinishReason.ABORT, delta.usage, error=self.ended_with)
                    return
                yield delta
                n += 1
                if self.stuck and n == 3:
                    await asyncio.Event().wait()  # until the request is closed
        finally:
            await inner.aclose()

    def end_all(self, error: str) -> None:
        self.end_all_calls += 1
        if not self.stuck:
            self.ended_with = error


class Served:
    """The app on a GracefulServer in a thread; `stop()` is SIGTERM's handler."""

    def __init__(self, engine: ShutdownEngine, grace_s: float) -> None:
        self.ledger = FakeLedger()
        app = create_app(engine, ServerConfig(api_keys=(KEY_A,)), self.ledger)
        self.endings = app.state.endings
        self.sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, lifespan="on", log_level="warning", access_log=False)
        self.server = shutdown.GracefulServer(config, engine, grace_s, endings=app.state.endings)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)
        self.thread.join(20)
        assert not self.thread.is_alive()


@pytest.fixture(autouse=True)
def quick_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutdown, "SETTLE_S", 0.3)


class Call(threading.Thread):
    """One request in the background: its status, headers and whole body (every SSE payload, parsed)."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.raw = b""
        self.first = threading.Event()  # the response started

    def run(self) -> None:
        with httpx.Client(timeout=20) as c, c.stream("POST", self.url, json=self.body, headers=auth()) as r:
            self.status, self.headers = r.status_code, dict(r.headers)
            for chunk in r.iter_raw():
                self.raw += chunk
                self.first.set()

    def payloads(self) -> list[Any]:
        return [p if (p := line[6:]) == "[DONE]" else json.loads(p)
                for line in self.raw.decode().splitlines() if line.startswith("data: ")]


def wait_for(condition: Callable[[], bool], why: Callable[[], object] = lambda: None) -> None:
    """Until `condition()`, 10 s at most (then fail, saying `why()`)."""
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, why()
        time.sleep(0.005)


def start(srv: Served, engine: FakeEngine, calls: list[Call]) -> list[Call]:
    for c in calls:
        c.start()
    wait_for(lambda: len(engine.requests) >= len(calls) and all(c.first.is_set() for c in calls if c.body.get("stream")),
             lambda: (len(engine.requests), [c.raw for c in calls]))
    return calls


def body_never_sent(srv: Served) -> Iterator[bytes]:
    """A request whose body stops short of its Content-Length: the app waits for the rest. Yields once
    sent, then the whole answer the server wrote before closing."""
    with socket.create_connection(srv.sock.getsockname()[:2], timeout=20) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY_A.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"messa")
        yield b""
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        yield answer


def assert_503(status: int | None, headers: dict[str, str], body: bytes) -> None:
    assert status == 503 and headers["content-type"] == "application/json", (status, headers, body)
    assert headers["retry-after"] == "5" and json.loads(body) == {"error": SHUTTING_DOWN}


def test_a_responses_stream_the_engine_ends_gets_response_failed_and_nothing_after() -> None:
    engine = ShutdownEngine(stuck=False)
    srv = Served(engine, grace_s=0.1)
    url = srv.url + "/v1/responses"
    stream, plain = start(srv, engine, [Call(url, {**RESPONSE, "stream": True}), Call(url, RESPONSE)])
    srv.stop()
    stream.join(5)
    plain.join(5)
    assert engine.end_all_calls == 1  # the grace path: the engine ended both
    *before, last = stream.payloads()
    assert stream.status == 200 and before[0]["type"] == "response.created"
    assert any(e["type"] == "response.output_text.delta" for e in before)
    assert last["type"] == "response.failed" and "[DONE]" not in stream.raw.decode(), stream.raw[-300:]
    assert last["response"]["status"] == "failed"
    assert last["response"]["error"] == {"code": "service_unavailable", "message": "the server is shutting down"}
    assert_503(plain.status, plain.headers, plain.raw)
    assert [r.finish_reason for r in srv.ledger.records] == ["abort", "abort"]


def test_a_stream_the_engine_ends_tells_its_usage_before_the_error() -> None:
    """A client that asked for usage (`stream_options.include_usage`; the Responses API always) learns
    what the ended request was billed, the ledger's figures: the usage chunk, then the error event and
    `[DONE]` (was: no usage at all, a request the client could not reconcile with its bill)."""
    engine = ShutdownEngine(stuck=False)
    srv = Served(engine, grace_s=0.1)
    chat = Call(srv.url + "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    bare = Call(srv.url + "/v1/chat/completions", {**CHAT, "stream": True})
    response = Call(srv.url + "/v1/responses", {**RESPONSE, "stream": True})
    start(srv, engine, [chat, bare, response])
    srv.stop()
    for c in (chat, bare, response):
        c.join(5)
    billed = {r.request_id: r for r in srv.ledger.records}
    assert len(billed) == 3 and {r.finish_reason for r in billed.values()} == {"abort"}
    *_, usage, error, done = chat.payloads()
    assert (usage["choices"], error, done) == ([], {"error": SHUTTING_DOWN}, "[DONE]"), chat.raw[-400:]
    told = (usage["usage"]["prompt_tokens"], usage["usage"]["completion_tokens"])
    assert told[1] > 0 and told in {(r.prompt_tokens, r.completion_tokens) for r in billed.values()}
    assert not any("usage" in p and not p.get("choices") for p in bare.payloads()[:-1] if isinstance(p, dict))
    failed = response.payloads()[-1]["response"]
    assert failed["status"] == "failed" and failed["usage"]["output_tokens"] > 0
    assert failed["usage"]["output_tokens"] in {r.completion_tokens for r in billed.values()}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_requests_the_engine_never_ends_still_get_their_last_word_when_cancelled(path: str) -> None:
    engine = ShutdownEngine(stuck=True)
    srv = Served(engine, grace_s=0.1)
    body = CHAT if "chat" in path else RESPONSE
    stream, plain = start(srv, engine, [Call(srv.url + path, {**body, "stream": True}), Call(srv.url + path, body)])
    waiting = body_never_sent(srv)
    next(waiting)
    wait_for(lambda: len(srv.endings) == 3)  # the app has the body-less request (before: a shutdown that
    # came first closed the connection uvicorn had not yet parsed, with a reset: CI, stop 58)
    t0 = time.monotonic()
    srv.stop()
    elapsed = time.monotonic() - t0
    stream.join(5)
    plain.join(5)
    assert engine.end_all_calls == 1 and elapsed < 0.1 + 0.3 + 0.3 + 2, elapsed  # grace, settle, cancel, exit
    assert_503(plain.status, plain.headers, plain.raw)
    head, _, raw_body = next(waiting).partition(b"\r\n\r\n")
    lines = head.decode().lower().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert_503(int(lines[0].split()[1]), headers, raw_body)
    # both billed as aborts with what was computed (3 tokens each), as a client that leaves is
    assert sorted((r.finish_reason, r.completion_tokens) for r in srv.ledger.records) == [("abort", 3)] * 2
    payloads = stream.payloads()
    assert stream.status == 200 and len(payloads) >= 3, stream.raw
    if "chat" in path:
        assert payloads[-2:] == [{"error": SHUTTING_DOWN}, "[DONE]"], payloads[-3:]
        assert len("".join(p["choices"][0]["delta"].get("content") or "" for p in payloads[:-2])) == 3  # 3 tokens
    else:
        last = payloads[-1]
        assert last["type"] == "response.failed" and "[DONE]" not in payloads, payloads[-3:]
        assert last["response"]["error"] == {"code": "service_unavailable", "message": "the server is shutting down"}
