"""What the benchmark's client adds to every TTFT it reads: the TTFT of a server that answers at once.

A canned SSE reply (one content chunk, the finish and usage chunks, [DONE]) from a bare asyncio
server on 127.0.0.1, read by `client.BenchClient` (aiohttp) and by the same request on httpx, the
client `make bench` used before. Whatever either reads here is the instrument, not a server: a warm
TTFT of a few ms carries it whole. Run from the repository root:

    .venv/bin/python bench/client_floor.py [--requests N] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import httpx
from client import BenchClient
from servers import free_port

CANNED_SERVER = r"""
import asyncio, sys
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
FIRST = b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"},"finish_reason":null}]}\n\n'
LAST = (b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"length"}],'
        b'"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6,"prompt_tokens_details":{"cached_tokens":0}}}\n\n'
        b"data: [DONE]\n\n")
def chunk(b): return b"%x\r\n" % len(b) + b + b"\r\n"
async def handle(r, w):
    try:
        while True:
            head = await r.readuntil(b"\r\n\r\n")
            n = next(int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length"))
            await r.readexactly(n)
            w.write(HEAD)
            w.write(chunk(FIRST))
            w.write(chunk(LAST) + b"0\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        w.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    print("ready", flush=True)
    await server.serve_forever()
asyncio.run(main())
"""

MESSAGES = [{"role": "user", "content": "word " * 600}]  # a body of a 600-token prompt's size


async def bench_client(url: str, n: int) -> list[float]:
    client = BenchClient(url, "key", "canned")
    try:
        return [(await client.chat(MESSAGES, 4)).ttft_s * 1000 for _ in range(n)]
    finally:
        await client.aclose()


async def httpx_client(url: str, n: int) -> list[float]:
    """The request and the line loop of the client `make bench` had before (bench/client.py's history)."""
    body = {"model": "canned", "messages": MESSAGES, "max_tokens": 4, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    out = []
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": "Bearer key"}) as http:
        for _ in range(n):
            start, first = time.perf_counter(), None
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data:") and '"content":"' in line:
                        first = time.perf_counter()
            out.append(((first or time.perf_counter()) - start) * 1000)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60, help="requests a client and round (the first 5 unmeasured)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", CANNED_SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        url = f"http://127.0.0.1:{port}"
        for r in range(args.rounds):
            ours = asyncio.run(bench_client(url, args.requests))[5:]
            old = asyncio.run(httpx_client(url, args.requests))[5:]
            print(f"round {r + 1}: TTFT of a canned reply, median (p90) ms: BenchClient (aiohttp) "
                  f"{statistics.median(ours):.2f} ({sorted(ours)[int(0.9 * len(ours))]:.2f}), "
                  f"httpx {statistics.median(old):.2f} ({sorted(old)[int(0.9 * len(old))]:.2f})")
    finally:
        server.terminate()
        server.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
