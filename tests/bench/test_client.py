"""bench/client.py reads a streamed chat completion the same way from any server: SSE lines split
anywhere across TCP reads, the usage and finish chunks, and a server that closes its connection after
every streamed response (as llama-server does while announcing keep-alive), which a pooled connection
only shows by failing on its next request."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
# bench/ on the path for this import only (tests/bench/test_trace.py says why)
sys.path.insert(0, BENCH)
from client import BenchClient

sys.path.remove(BENCH)

TEXTS = ["Hel", "lo", " wörld"]


def _sse(obj: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _body() -> bytes:
    events = [_sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
    events += [_sse({"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]}) for t in TEXTS]
    events.append(_sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}))
    events.append(_sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                                 "prompt_tokens_details": {"cached_tokens": 5}}}))
    return b"".join(events) + b"data: [DONE]\n\n"


async def _serve(close_after_each: bool, requests: list[dict[str, object]]) -> tuple[asyncio.Server, int]:
    """A server sending `_body()` in 7-byte chunked pieces, each its own write after a pause;
    `close_after_each`: it drops the connection when the next request comes on it, unanswered."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                requests.append(json.loads(await reader.readexactly(length)))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                             b"keep-alive: timeout=5, max=100\r\n\r\n")
                body = _body()
                for i in range(0, len(body), 7):
                    piece = body[i : i + 7]
                    writer.write(b"%x\r\n" % len(piece) + piece + b"\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.001)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                if close_after_each:  # keep-alive announced, yet the next request on it finds it closing
                    await reader.readuntil(b"\r\n\r\n")
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("close_after_each", [False, True])
def test_a_stream_split_anywhere_is_read_whole_again_and_again(close_after_each: bool) -> None:
    async def run() -> None:
        requests: list[dict[str, object]] = []
        server, port = await _serve(close_after_each, requests)
        client = BenchClient(f"http://127.0.0.1:{port}", "key", "model-x")
        try:
            for _ in range(4):
                result = await client.chat([{"role": "user", "content": "hi"}], 3)
                assert result.text == "".join(TEXTS)
                assert result.num_content_chunks == 3 and result.num_completion_tokens == 3
                assert result.finish_reason == "length"
                assert result.cached_tokens == 5 and result.prompt_tokens == 7
                assert 0 < result.ttft_s <= result.content_times_s[-1] <= result.total_s
        finally:
            await client.aclose()
            server.close()
            await server.wait_closed()
        assert len(requests) == 4  # each answered once
        assert requests[0]["model"] == "model-x" and requests[0]["stream"] is True and requests[0]["max_tokens"] == 3

    asyncio.run(run())


def test_an_http_error_is_raised_with_its_body() -> None:
    async def run() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            payload = b'{"error":{"message":"no such model"}}'
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n" % len(payload) + payload)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = BenchClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "key", "m")
        try:
            with pytest.raises(RuntimeError, match="HTTP 404 .*no such model"):
                await client.chat([{"role": "user", "content": "hi"}], 1)
        finally:
            await client.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(run())
