"""What the reliability tests need from a live server: a `Target` (URL, pid, keys), streaming calls
with TTFT, raw-socket requests for disconnect faults, /metrics and /health readings, RSS.

Everything here talks HTTP to 127.0.0.1 only; nothing imports the server. The functions take a
`Target` rather than a `ServerProcess`, so they also drive a server started by hand.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass(frozen=True, slots=True)
class Target:
    """A live server: where it listens, its pid (for RSS), and the keys it was started with."""

    base_url: str
    pid: int
    keys: dict[str, str] = field(default_factory=dict)  # tenant name -> API key
    admin_key: str | None = None  # reads /metrics (with API keys, no other key does)

    @property
    def host_port(self) -> tuple[str, int]:
        url = httpx.URL(self.base_url)
        assert url.host == "127.0.0.1" and url.port is not None
        return url.host, url.port

    def auth(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}


# ---- responses ----------------------------------------------------------------------------------


def openai_error(response: httpx.Response) -> dict[str, Any]:
    """The `error` object of an OpenAI-shaped error body; AssertionError naming what is wrong otherwise."""
    try:
        body = response.json()
    except ValueError:
        raise AssertionError(f"{response.status_code}: body is not JSON: {response.text[:200]!r}") from None
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err, dict) and set(err) == ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    return err


@dataclass(slots=True)
class StreamResult:
    """One streaming call: status, TTFT (first chunk carrying output), text, final usage, errors."""

    status: int
    ttft_s: float | None = None
    total_s: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None  # an HTTP error body or an SSE error event
    done: bool = False  # saw `data: [DONE]`
    retry_after: str | None = None  # the Retry-After header of a refusal

    @property
    def cached_tokens(self) -> int:
        assert self.usage is not None, self
        return int(self.usage["prompt_tokens_details"]["cached_tokens"])

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.done and self.usage is not None


def _chunk_output(obj: dict[str, Any]) -> tuple[str | None, str | None]:
    """(text, finish_reason) of one completions or chat chunk; text None for a chunk without output."""
    if not obj.get("choices"):
        return None, None
    choice = obj["choices"][0]
    if "text" in choice:
        return choice["text"], choice.get("finish_reason")
    return choice.get("delta", {}).get("content") or None, choice.get("finish_reason")


def _observe_event(
    result: StreamResult, payload: str, t0: float, on_first: Callable[[], None] | None = None
) -> None:
    if payload == "[DONE]":
        result.done = True
        return
    obj = json.loads(payload)
    if "error" in obj:
        result.error = json.dumps(obj["error"])
        return
    text, finish = _chunk_output(obj)
    if text is not None and result.ttft_s is None:
        result.ttft_s = time.perf_counter() - t0
        if on_first is not None:
            on_first()
    result.text += text or ""
    result.finish_reason = finish or result.finish_reason
    if obj.get("usage"):
        result.usage = obj["usage"]


def stream(client: httpx.Client, path: str, body: dict[str, Any], headers: dict[str, str],
           on_first: Callable[[], None] | None = None) -> StreamResult:  # fmt: skip
    """POST a streaming request (usage included) and read it to the end. TTFT is measured from just
    before the request is sent to the first chunk that carries output text (the server opens the
    response only once the first token exists, so headers alone say nothing). `on_first` is called
    when that chunk arrives."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    with client.stream("POST", path, json=body, headers=headers) as r:
        result = StreamResult(status=r.status_code)
        if r.status_code != 200:
            r.read()
            result.error = r.text
        else:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    _observe_event(result, line[6:], t0, on_first)
    result.total_s = time.perf_counter() - t0
    return result


async def astream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str]
) -> StreamResult:
    """`stream` for asyncio callers."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    async with client.stream("POST", path, json=body, headers=headers) as r:
        result = StreamResult(status=r.status_code, retry_after=r.headers.get("retry-after"))
        if r.status_code != 200:
            await r.aread()
            result.error = r.text
        else:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    _observe_event(result, line[6:], t0)
    result.total_s = time.perf_counter() - t0
    return result


# ---- raw sockets: disconnect faults ---------------------------------------------------------------


def raw_request(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode("latin-1") + b"\r\n" + body


def connect(target: Target, timeout: float = 60.0) -> socket.socket:
    s = socket.create_connection(target.host_port, timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def hang_up(s: socket.socket, reset: bool) -> None:
    """Close the connection: a FIN, or (reset=True) an RST as a crashed client would leave."""
    if reset:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def peek(s: socket.socket) -> bytes:
    """What the server has sent on `s` so far (up to 64 KiB), without consuming or waiting for it."""
    s.setblocking(False)
    try:
        return s.recv(65536, socket.MSG_PEEK)
    except BlockingIOError:
        return b""
    finally:
        s.setblocking(True)


def read_until_events(s: socket.socket, num_events: int, timeout: float = 120.0) -> bytes:
    """Read the response until `num_events` SSE `data:` events have arrived (or the stream ends)."""
    s.settimeout(timeout)
    buf = b""
    while buf.count(b"\ndata: ") + buf.startswith(b"data: ") < num_events:
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


# ---- server state ---------------------------------------------------------------------------------


def scrape(target: Target) -> dict[str, float]:
    """/metrics as {name or name{label=value,...}: value} (counters under their `_total` name)."""
    r = httpx.get(target.base_url + "/metrics", headers=target.admin, timeout=30)
    assert r.status_code == 200, r.text
    text = r.text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


def count_5xx(metrics: dict[str, float]) -> float:
    return sum(
        v for k, v in metrics.items() if k.startswith("prefixserve_http_requests_total{") and "5xx" in k
    )


def health(target: Target) -> dict[str, Any]:
    """/health as the operator reads it: with the admin key, the load figures too (running, waiting)."""
    headers = {"Authorization": f"Bearer {target.admin_key}"} if target.admin_key else {}
    r = httpx.get(target.base_url + "/health", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    assert body["ok"] is True, body
    return body


def wait_idle(target: Target, timeout: float = 60.0) -> float:
    """Wait until no session is running or waiting and no request is in flight; returns seconds waited.
    AssertionError with the last reading if that does not happen within `timeout`."""
    t0 = time.monotonic()
    while True:
        h = health(target)
        m = scrape(target)
        if h["running"] == 0 and h["waiting"] == 0 and m.get("prefixserve_requests_in_flight") == 0:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"server not idle after {timeout:.0f} s: health={h}, "
                                 f"in_flight={m.get('prefixserve_requests_in_flight')}")  # fmt: skip
        time.sleep(0.1)


def rss_bytes(target: Target) -> int:
    return int(psutil.Process(target.pid).memory_info().rss)


def settled_rss(target: Target, num_samples: int = 5, interval_s: float = 0.2) -> int:
    """Median RSS over a second, once idle (a single reading can catch a transient allocation)."""
    wait_idle(target)
    samples = []
    for _ in range(num_samples):
        samples.append(rss_bytes(target))
        time.sleep(interval_s)
    return int(statistics.median(samples))


async def sample_metrics(
    target: Target, stop: asyncio.Event, interval_s: float = 0.25
) -> list[dict[str, float]]:
    """Scrape /metrics every `interval_s` until `stop` is set (for bounds that must hold throughout)."""
    samples: list[dict[str, float]] = []
    async with httpx.AsyncClient(base_url=target.base_url, headers=target.admin, timeout=30) as c:
        while not stop.is_set():
            text = (await c.get("/metrics")).text
            flat: dict[str, float] = {}
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if not sample.labels:
                        flat[sample.name] = float(sample.value)
            samples.append(flat)
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass
    return samples
