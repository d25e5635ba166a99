"""Pressure: 64 chat requests without `max_tokens` at once, then 200 more while they run.

A request without `max_tokens` may generate up to `--default-max-tokens` (1,024), and admission
reserves KV for prompt + that much (engine/session.py `kv_bytes_needed`) against
`--max-session-bytes`; the KV itself is allocated as tokens arrive. The server here runs with a
session budget of 1 GiB (about 40 such reservations for the embedded model) and a queue of 128, so
that both bounds act: sessions wait for budget, and what does not fit the queue is refused.

Holds: every response is either a complete 200 stream (usage included, finish_reason set) or a 429
in OpenAI's error shape with a `Retry-After` header, and some are refused (264 requests against
<= 64 running + 128 queued); the server's RSS, sampled every 50 ms throughout, stays under its
documented bound: RSS when idle + `--max-session-bytes` + `--cache-max-bytes` + 256 MiB for
everything per connection (docs/operations.md, "Under pressure"); afterwards it is healthy, idle, and serves a
new request.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.reliability.client import (
    StreamResult,
    Target,
    astream,
    health,
    rss_bytes,
    scrape,
    settled_rss,
    wait_idle,
)
from tests.reliability.conftest import ADMIN, MAIN_ENV, ServerSlot, as_target

pytestmark = pytest.mark.slow

FIRST_WAVE = 64
SECOND_WAVE = 200
QUEUE = 128
SESSION_BYTES = 1 << 30
CACHE_BYTES = 64 << 20
SLACK_BYTES = 256 << 20  # connections, request objects, asyncio buffers, allocator slack


@pytest.fixture(scope="module")
def pressure() -> Iterator[Target]:
    slot = ServerSlot(["--api-key", "sk-pressure-0123456789", *ADMIN, "--no-ledger", "--max-queued-requests", str(QUEUE),
                       "--max-session-bytes", str(SESSION_BYTES), "--cache-max-bytes", str(CACHE_BYTES)],
                      {"p": "sk-pressure-0123456789"}, MAIN_ENV)  # fmt: skip
    srv = slot.get()
    try:
        yield as_target(srv, slot.keys)
    finally:
        slot.close()


def question(i: int) -> dict[str, object]:
    """A chat request without max_tokens whose greedy answer is short (it ends with EOS by itself)."""
    return {"model": "SmolLM2-135M-Instruct", "temperature": 0,
            "messages": [{"role": "system", "content": "Answer with one word."},
                         {"role": "user", "content": f"Is {i} an even number? Yes or no?"}]}  # fmt: skip


async def burst(target: Target) -> list[StreamResult]:
    headers = target.auth("p")
    limits = httpx.Limits(max_connections=FIRST_WAVE + SECOND_WAVE + 8)
    async with httpx.AsyncClient(base_url=target.base_url, timeout=600, limits=limits) as client:
        first = [asyncio.create_task(astream(client, "/v1/chat/completions", question(i), headers))
                 for i in range(FIRST_WAVE)]  # fmt: skip
        await asyncio.sleep(0.5)  # the first wave is in; the second arrives while it runs
        second = [astream(client, "/v1/chat/completions", question(FIRST_WAVE + i), headers)
                  for i in range(SECOND_WAVE)]  # fmt: skip
        return list(await asyncio.gather(*first, *second))


def test_requests_without_max_tokens_stay_within_memory_and_queue_bounds(pressure: Target) -> None:
    idle_rss = settled_rss(pressure)
    peak = [idle_rss]
    done = threading.Event()

    def sample_rss() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes(pressure))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample_rss)
    sampler.start()
    t0 = time.perf_counter()
    try:
        results = asyncio.run(burst(pressure))
    finally:
        done.set()
        sampler.join()
    seconds = time.perf_counter() - t0
    streams = [r for r in results if r.status != 429]
    refused = [r for r in results if r.status == 429]
    bound = idle_rss + SESSION_BYTES + CACHE_BYTES + SLACK_BYTES
    lengths = sorted(r.usage["completion_tokens"] for r in streams if r.usage)
    print(f"\n{len(streams)} completed, {len(refused)} refused (429) in {seconds:.1f} s; completion tokens "
          f"{lengths[0]}..{lengths[-1]}; RSS idle {idle_rss / 2**20:.0f} MiB, peak {peak[0] / 2**20:.0f} MiB "
          f"(+{(peak[0] - idle_rss) / 2**20:.0f} MiB; bound {bound / 2**20:.0f} MiB)")  # fmt: skip
    assert len(streams) + len(refused) == FIRST_WAVE + SECOND_WAVE
    for r in streams:
        assert r.ok and r.status == 200 and r.usage is not None and r.finish_reason in ("stop", "length"), r
    assert refused, "264 requests against 64 running + 128 queued: some must be refused"
    for r in refused:
        err = json.loads(r.error or "")["error"]
        assert set(err) >= {"message", "type", "code"} and "retry" in err["message"].lower(), err
        assert r.retry_after is not None and int(r.retry_after) >= 1, r
    assert peak[0] <= bound, f"RSS peaked at {peak[0] / 2**20:.0f} MiB, over the bound {bound / 2**20:.0f} MiB"
    wait_idle(pressure)
    assert health(pressure)["ok"] is True
    assert scrape(pressure)["prefixserve_requests_in_flight"] == 0
    r = httpx.post(pressure.base_url + "/v1/chat/completions", json={**question(7), "max_tokens": 4},
                   headers=pressure.auth("p"), timeout=60)
    assert r.status_code == 200, r.text
