"""One streaming chat-completion request, timed the same way for every server.

Both servers are driven by this code alone, so any difference in the numbers is the
server's. TTFT is measured from just before the request is sent to the arrival of the
first SSE chunk whose `delta.content` is a non-empty string.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass(slots=True)
class StreamResult:
    """What one streamed request measured. Times are seconds from the request's start."""

    ttft_s: float
    total_s: float
    num_content_chunks: int
    content_times_s: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None  # the last chunk's `usage`, when the server streamed one

    @property
    def num_completion_tokens(self) -> int:
        """Tokens generated: the server's usage count when it sent one, else the chunk count."""
        if self.usage and isinstance(self.usage.get("completion_tokens"), int):
            return max(int(self.usage["completion_tokens"]), self.num_content_chunks)
        return self.num_content_chunks

    @property
    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        value = details.get("cached_tokens")
        return int(value) if isinstance(value, int) else None

    @property
    def prompt_tokens(self) -> int | None:
        value = (self.usage or {}).get("prompt_tokens")
        return int(value) if isinstance(value, int) else None

    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first one divided by the time after the first one."""
        if self.num_content_chunks < 2:
            return None
        span_s = self.content_times_s[-1] - self.content_times_s[0]
        if span_s <= 0:
            return None
        # When a server bundles several tokens in one chunk, its usage count is the truth.
        num_tokens = self.num_completion_tokens
        return (num_tokens - 1) / span_s

    def to_json(self) -> dict[str, Any]:
        return {
            "ttft_s": self.ttft_s,
            "total_s": self.total_s,
            "num_content_chunks": self.num_content_chunks,
            "num_completion_tokens": self.num_completion_tokens,
            "decode_tokens_per_s": self.decode_tokens_per_s(),
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "text_head": self.text[:120],
        }


class BenchClient:
    """An aiohttp session bound to one server's base URL and API key, opened on first use in the
    running event loop.

    aiohttp, as vLLM's `benchmark_serving` uses, rather than httpx: against a server that answers at
    once (a canned SSE reply on 127.0.0.1) httpx's pure-Python HTTP/1.1 path added 1.6 ms to every
    TTFT and aiohttp's C parser 0.3 ms (the 2-core Zen 3, `bench/client_floor.py`), and on 2 cores the
    client's CPU also competes with the server it measures. A warm TTFT is a few ms: the instrument
    must not be half of what it reads."""

    def __init__(self, base_url: str, api_key: str, model: str, headers: dict[str, str] | None = None) -> None:
        """`headers`: more headers on every request (a gateway's routing key, bench/cluster_bench.py)."""
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._headers = {"Authorization": f"Bearer {api_key}", **(headers or {})}
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _open(self) -> aiohttp.ClientSession:
        """The session of the running loop (a new one when called from another loop: peer.py runs each
        tuning measurement in its own `asyncio.run`)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=900.0, connect=10.0),
                connector=aiohttp.TCPConnector(limit=64),
            )
            self._loop = loop
        return self._session

    async def aclose(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None

    async def _post(self, body: dict[str, Any]) -> tuple[float, aiohttp.ClientResponse]:
        """Send `body`; (the time it was sent, the response with its status and headers read). A pooled
        connection the server closed after its last response (llama-server closes one after every
        streamed response, yet announces keep-alive) is retried once on a new connection, timed from
        the retry: httpx looked at a pooled connection before reusing it, aiohttp finds out by failing."""
        session = self._open()
        url = self.base_url + "/v1/chat/completions"
        start = time.perf_counter()
        try:
            return start, await session.post(url, json=body)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):  # a stale pooled connection
            start = time.perf_counter()
            return start, await session.post(url, json=body)

    async def chat(self, messages: list[dict[str, str]], max_tokens: int) -> StreamResult:
        """Send one greedy streaming chat completion and time it; raise on an HTTP error."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        content_times_s: list[float] = []
        pieces: list[str] = []
        finish_reason: str | None = None
        usage: dict[str, Any] | None = None
        start, response = await self._post(body)
        async with response:
            if response.status != 200:
                detail = (await response.read()).decode(errors="replace")[:500]
                raise RuntimeError(f"HTTP {response.status} from {self.base_url}: {detail}")
            pending = b""
            done = False
            # read to the body's end (not just [DONE]): a response read whole leaves its connection
            # to the pool, as a client in production would
            async for data in response.content.iter_any():  # what arrived; split into lines here
                now = time.perf_counter() - start
                lines = (pending + data).split(b"\n")
                pending = lines.pop()
                for raw in lines:
                    line = raw.decode().rstrip("\r")
                    if done or not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        done = True
                        continue
                    chunk = json.loads(payload)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        content = (choice.get("delta") or {}).get("content")
                        if isinstance(content, str) and content:
                            content_times_s.append(now)
                            pieces.append(content)
                        if choice.get("finish_reason"):
                            finish_reason = choice["finish_reason"]
        total_s = time.perf_counter() - start
        ttft_s = content_times_s[0] if content_times_s else total_s
        return StreamResult(
            ttft_s=ttft_s,
            total_s=total_s,
            num_content_chunks=len(content_times_s),
            content_times_s=content_times_s,
            text="".join(pieces),
            finish_reason=finish_reason,
            usage=usage,
        )
