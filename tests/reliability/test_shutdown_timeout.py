"""--shutdown-timeout (docs/architecture.md, "Shutdown"): after SIGTERM, requests in flight get that
long; then the engine ends the rest. A stream gets an OpenAI error event and `[DONE]`, a non-streaming
request a 503, the ledger records each as an abort with what was computed, and the process exits 0.
A second signal ends them at once. Each test starts its own server (the embedded model, a 1,024-token
context, a ledger in its data dir); test_sigterm covers requests that finish within the grace."""

from __future__ import annotations

import json
import signal
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.server_proc import ServerProcess
from tests.reliability.client import openai_error

pytestmark = pytest.mark.slow

KEY = "sk-shutdown-0123456789"
ADMIN = "sk-shutdown-admin-0123456789"  # reads /health's load figures
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "Count from one to one thousand in words."}]
PROMPT = "Once upon a time, in a land far away,"
LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0}  # minutes of decoding on 2 cores
SHUTTING_DOWN = {"message": "the server is shutting down", "type": "service_unavailable", "param": None,
                 "code": "service_unavailable"}


def server(grace_s: str) -> ServerProcess:
    return ServerProcess(["--api-key", f"alice {KEY}", "--admin-key", ADMIN, "--shutdown-timeout", grace_s, "--max-model-len", "1024",
                          "--cache-max-bytes", "1000"])


class Stream(threading.Thread):
    """A long chat stream read in the background: every SSE payload, in order."""

    def __init__(self, srv: ServerProcess) -> None:
        super().__init__(daemon=True)
        self.url = srv.base_url + "/v1/chat/completions"
        self.events: list[Any] = []  # parsed JSON, or the string "[DONE]"
        self.first = threading.Event()  # a chunk with content arrived
        self.status: int | None = None

    def run(self) -> None:
        body = {"messages": MESSAGES, "stream": True, "logprobs": True, **LONG}
        with httpx.Client(timeout=120) as c, c.stream("POST", self.url, json=body, headers=AUTH) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    payload = line[6:]
                    self.events.append(payload if payload == "[DONE]" else json.loads(payload))
                    if self.num_content() > 0:
                        self.first.set()

    def num_content(self) -> int:
        """Content chunks received."""
        return sum(1 for e in self.events if isinstance(e, dict) and e.get("choices")
                   and e["choices"][0]["delta"].get("content"))

    def num_tokens(self) -> int:
        """Tokens received: one logprobs entry each, sent with its token's text."""
        return sum(len((e["choices"][0].get("logprobs") or {}).get("content") or []) for e in self.events
                   if isinstance(e, dict) and e.get("choices"))


def wait_running(srv: ServerProcess, num: int) -> None:
    deadline = time.monotonic() + 60
    while httpx.get(srv.base_url + "/health", headers={"Authorization": f"Bearer {ADMIN}"}).json()["running"] < num:
        assert time.monotonic() < deadline, srv.log_tail()
        time.sleep(0.02)


def wait_log(srv: ServerProcess, text: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in srv.log_text():
        assert time.monotonic() < deadline, (text, srv.log_tail())
        time.sleep(0.02)


def ledger_rows(srv: ServerProcess) -> list[dict[str, Any]]:
    with sqlite3.connect(Path(srv.data_dir) / "usage.sqlite3") as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT * FROM usage_records ORDER BY id")]


def prompt_len(srv: ServerProcess, **body: Any) -> int:
    return int(httpx.post(srv.base_url + "/tokenize", json=body, headers=AUTH).json()["count"])


def assert_ended_by_shutdown(s: Stream) -> None:
    """Content chunks, then the error event, then [DONE]: ended cleanly, with a reason, no finish chunk."""
    assert s.status == 200 and s.num_content() > 0
    assert s.events[-2:] == [{"error": SHUTTING_DOWN}, "[DONE]"], s.events[-3:]
    assert not any(isinstance(e, dict) and e.get("choices") and e["choices"][0].get("finish_reason")
                   for e in s.events)


def test_requests_past_the_timeout_are_ended_recorded_and_the_server_exits_0() -> None:
    with server("1") as srv:
        assert srv.proc is not None
        chat_len = prompt_len(srv, messages=MESSAGES)
        completion_len = prompt_len(srv, prompt=PROMPT)
        s = Stream(srv)
        s.start()
        answers: list[httpx.Response] = []
        plain = threading.Thread(target=lambda: answers.append(httpx.post(
            srv.base_url + "/v1/completions", json={"prompt": PROMPT, **LONG}, headers=AUTH, timeout=120)))
        plain.start()
        assert s.first.wait(60), srv.log_tail()
        wait_running(srv, 2)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(30)
        elapsed = time.monotonic() - t0
        s.join(10)
        plain.join(10)
        log = srv.log_text()
        assert rc == 0, log[-4000:]
        assert 1.0 <= elapsed < 1.0 + 6.0, (elapsed, log[-4000:])  # the grace, then a step and the drain
        assert "SIGTERM: shutting down: 2 request(s) in flight, waiting up to 1 s" in log, log[-4000:]
        assert "shutdown timeout of 1 s reached: stopping the 2 request(s) still in flight" in log
        assert_ended_by_shutdown(s)
        (answer,) = answers
        assert answer.status_code == 503 and openai_error(answer) == SHUTTING_DOWN
        assert answer.headers["retry-after"] == "5"
        rows = ledger_rows(srv)
        assert [r["finish_reason"] for r in rows] == ["abort", "abort"], rows
        by_prompt = {r["prompt_tokens"]: r for r in rows}
        chat, completion = by_prompt[chat_len], by_prompt[completion_len]  # the whole prompts were computed
        # what the engine computed is what the stream got, its last text included (before the error event)
        assert chat["completion_tokens"] == s.num_tokens() > 0, (s.num_tokens(), chat)
        assert 0 < completion["completion_tokens"] < LONG["max_tokens"], completion
    print(f"\n--shutdown-timeout 1: exit 0 {elapsed:.1f} s after SIGTERM; stream ended after "
          f"{chat['completion_tokens']} tokens with the error event, the other a 503 after "
          f"{completion['completion_tokens']}; both in the ledger as aborts")


def test_a_second_signal_ends_the_grace_at_once() -> None:
    with server("60") as srv:
        assert srv.proc is not None
        s = Stream(srv)
        s.start()
        assert s.first.wait(60), srv.log_tail()
        srv.proc.send_signal(signal.SIGTERM)
        wait_log(srv, "SIGTERM: shutting down: 1 request(s) in flight, waiting up to 60 s (signal again to stop "
                      "them now)")
        time.sleep(0.5)
        assert srv.proc.poll() is None and s.is_alive()  # still streaming within the grace
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        rc = srv.proc.wait(30)
        elapsed = time.monotonic() - t0
        s.join(10)
        log = srv.log_text()
        assert rc == 0 and elapsed < 6.0, (rc, elapsed, log[-4000:])
        assert "SIGINT, a second signal: stopping the 1 request(s) in flight now" in log, log[-4000:]
        assert_ended_by_shutdown(s)
        (row,) = ledger_rows(srv)
        assert row["finish_reason"] == "abort" and row["completion_tokens"] == s.num_tokens() > 0, row
    print(f"\nsecond signal: exit 0 {elapsed:.1f} s after it (grace 60 s), the stream ended with the error event")
