"""One streaming chat-completion request, timed the same way for every server.

Both servers are driven by this code alone, so any difference in the numbers is the
server's. TTFT is measured from just before the request is sent to the arrival of the
first SSE chunk whose `delta.content` is a non-empty string.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


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
    """An httpx client bound to one server's base URL and API key."""

    def __init__(self, base_url: str, api_key: str, model: str, headers: dict[str, str] | None = None) -> None:
        """`headers`: more headers on every request (a gateway's routing key, bench/cluster_bench.py)."""
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {api_key}", **(headers or {})},
            timeout=httpx.Timeout(900.0, connect=10.0),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

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
        start = time.perf_counter()
        async with self._http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:500]
                raise RuntimeError(f"HTTP {response.status_code} from {self.base_url}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter() - start
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
