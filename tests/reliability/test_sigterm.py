"""SIGTERM drains: requests in flight when the signal lands complete normally, then the process
exits 0. Runs on the `tiny` server, which it ends (a later test asking for `tiny` gets a new one)."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import httpx
import pytest

from tests.helpers.server_proc import ServerProcess
from tests.reliability.client import StreamResult, Target, health, stream

pytestmark = pytest.mark.slow


def test_sigterm_finishes_in_flight_streams_then_exits_0(tiny: Target, tiny_server: ServerProcess) -> None:
    results: dict[str, StreamResult] = {}
    first = threading.Event()
    hello = [{"role": "user", "content": "Say hello."}]
    calls: dict[str, tuple[str, dict[str, Any]]] = {
        "decoding": ("/v1/completions", {"prompt": "Count slowly: one, two,", "max_tokens": 30}),
        "just-sent": ("/v1/chat/completions", {"messages": hello, "max_tokens": 12}),
    }

    def call(name: str) -> None:
        path, body = calls[name]
        body = {**body, "temperature": 0, "ignore_eos": True}
        on_first = first.set if name == "decoding" else None
        with httpx.Client(timeout=300) as c:
            results[name] = stream(c, tiny.base_url + path, body, tiny.auth("alice"), on_first=on_first)

    threads = {name: threading.Thread(target=call, args=(name,)) for name in calls}
    threads["decoding"].start()
    assert first.wait(120)
    threads["just-sent"].start()
    deadline = time.monotonic() + 60
    while (h := health(tiny))["running"] + h["waiting"] < 2:  # both are inside the engine
        assert time.monotonic() < deadline, h
        time.sleep(0.01)
    assert tiny_server.proc is not None
    tiny_server.proc.send_signal(signal.SIGTERM)
    for t in threads.values():
        t.join(300)
    for name, (_, body) in calls.items():
        r = results[name]
        assert r.ok and r.finish_reason == "length", (name, r)
        assert r.usage is not None and r.usage["completion_tokens"] == body["max_tokens"], (name, r.usage)
    assert tiny_server.terminate() == 0, tiny_server.log_tail()
    print(f"\nSIGTERM: 2 in-flight streams completed ({', '.join(calls)}), exit status 0")
