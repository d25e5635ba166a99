"""Load: 32 concurrent streaming clients for a bounded time, after a warm-up with the same load.

Each client loops until its phase ends: a streaming request (chat for even clients, completions for
odd ones; greedy for half of them, seeded sampling for the others; two cache salts), all sharing one
long system prompt so that prefix hits, boundary inserts and evictions (the 64 MiB budget holds only
a few such prompts) all happen under concurrency. /metrics is sampled every 250 ms throughout.

Holds: zero errors; every response carries usage with 0 <= cached_tokens <= prompt_tokens; the
cache's bytes never exceed its budget; the engine held all 32 at once (its own high-water mark); the server's own counters
agree with what the clients received (requests, prompt, cached and completion tokens: nothing lost,
nothing invented); the server's RSS after the run is within 10% of its level after the warm-up.
The warm-up repeats the same load until the RSS settles (the allocator keeps freed session memory
for reuse, so the first rounds raise it; a leak would keep raising it).
`make test`: warm-up phases of 10 s + 20 s of load; `make soak`: phases of 60 s + 300 s of load.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.reliability.client import (
    StreamResult,
    Target,
    astream,
    sample_metrics,
    scrape,
    settled_rss,
    wait_idle,
)
from tests.reliability.conftest import MAIN_CACHE_BYTES, scaled

pytestmark = pytest.mark.slow

NUM_CLIENTS = 32
MAX_TOKENS = 8
TOPICS = [
    "ferry timetables", "bicycle storage", "cabin prices", "pets on board", "missed departures", "on-board wifi",
    "ticket changes", "parking", "crossing times", "snacks", "night decks", "children travelling alone",
    "packing lists", "wheelchair access", "lockers", "weather delays",
]  # fmt: skip
SYSTEM = "You are the support assistant of the Prefix Harbour ferry company.\n" + "\n".join(
    f"Rule {i + 1}: when a passenger asks about {TOPICS[i % len(TOPICS)]}, answer in one short sentence "
    f"and mention route {i + 1} or cabin {100 + i} only if it is relevant."
    for i in range(12)
)


@dataclass(slots=True)
class Phase:
    results: list[StreamResult]
    samples: list[dict[str, float]]
    seconds: float


def request_for(client_id: int, n: int) -> tuple[str, dict[str, Any]]:
    """The n-th request of a client: (path, body)."""
    question = (
        f"Client {client_id}, question {n}: what should I know about {TOPICS[(client_id + n) % len(TOPICS)]}?"
    )
    sampling: dict[str, Any] = {"temperature": 0} if client_id % 4 < 2 else {"temperature": 0.8, "seed": n}
    body: dict[str, Any] = {"max_tokens": MAX_TOKENS, **sampling}
    if client_id % 8 >= 6:
        body["cache_salt"] = "load-salt"
    if client_id % 2 == 0:
        body["messages"] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return "/v1/chat/completions", body
    body["prompt"] = f"{SYSTEM}\n\nPassenger: {question}\nAssistant:"
    return "/v1/completions", body


async def client_loop(target: Target, client_id: int, deadline: float, out: list[StreamResult]) -> None:
    headers = target.auth("loader")
    async with httpx.AsyncClient(base_url=target.base_url, timeout=600) as c:
        n = 0
        while time.monotonic() < deadline:
            path, body = request_for(client_id, n)
            try:
                out.append(await astream(c, path, body, headers))
            except httpx.HTTPError as e:
                out.append(StreamResult(status=0, error=f"{type(e).__name__}: {e}"))
            n += 1


async def run_phase(target: Target, seconds: float) -> Phase:
    results: list[StreamResult] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_metrics(target, stop))
    t0 = time.monotonic()
    deadline = t0 + seconds
    await asyncio.gather(*(client_loop(target, i, deadline, results) for i in range(NUM_CLIENTS)))
    elapsed = time.monotonic() - t0
    stop.set()
    return Phase(results, await sampler, elapsed)


def check_phase(phase: Phase, name: str) -> None:
    errors = [r for r in phase.results if not r.ok]
    assert not errors, f"{name}: {len(errors)} of {len(phase.results)} failed, e.g. {errors[0]}"
    for r in phase.results:
        assert r.usage is not None
        prompt_tokens, cached = r.usage["prompt_tokens"], r.cached_tokens
        assert 0 <= cached <= prompt_tokens and prompt_tokens > 0, r.usage
        assert 1 <= r.usage["completion_tokens"] <= MAX_TOKENS, r.usage
        assert r.usage["total_tokens"] == prompt_tokens + r.usage["completion_tokens"]
    for s in phase.samples:
        assert s["prefixserve_cache_bytes"] <= MAIN_CACHE_BYTES, s["prefixserve_cache_bytes"]


def warm_up(target: Target, seconds: float) -> tuple[list[Phase], int]:
    """Phases of the same load until the settled RSS moves by under 3% (at least 2, at most 5
    phases): the allocator's high-water mark for this load is reached. Returns (phases, RSS)."""
    phases: list[Phase] = []
    rss = settled_rss(target)
    for _ in range(5):
        phases.append(asyncio.run(run_phase(target, seconds)))
        check_phase(phases[-1], f"warm-up {len(phases)}")
        prev, rss = rss, settled_rss(target)
        if len(phases) >= 2 and abs(rss - prev) < 0.03 * prev:
            break
    return phases, rss


def test_32_concurrent_streams_hold_every_bound(main: Target) -> None:
    warm, warm_rss = warm_up(main, scaled(10, 60))
    m0 = scrape(main)
    load = asyncio.run(run_phase(main, scaled(20, 300)))
    wait_idle(main)
    rss = settled_rss(main)
    m1 = scrape(main)
    check_phase(load, "load")

    def delta(name: str) -> float:
        return m1.get(name, 0.0) - m0.get(name, 0.0)

    got = load.results
    # the engine's own high-water mark of requests running + waiting (taken at every submission):
    # the 250 ms samples below see it only by chance (a request between two of a client's, or in
    # the HTTP layer, is in neither), and came out at 23-31 of 32 on the 2-core Ice Lake
    peak = m1["prefixserve_engine_peak_requests"]
    sampled = max(
        s["prefixserve_num_requests_running"] + s["prefixserve_num_requests_waiting"] for s in load.samples
    )
    max_bytes = max(s["prefixserve_cache_bytes"] for s in load.samples)
    num_prompt = sum(r.usage["prompt_tokens"] for r in got if r.usage)
    num_cached = sum(r.cached_tokens for r in got)
    num_completion = sum(r.usage["completion_tokens"] for r in got if r.usage)
    ttfts = sorted(r.ttft_s for r in got if r.ttft_s is not None)
    warm_s = sum(p.seconds for p in warm)
    print(f"\nload: {NUM_CLIENTS} streaming clients for {load.seconds:.0f} s (after {len(warm)} warm-up phases, "
          f"{warm_s:.0f} s, {sum(len(p.results) for p in warm)} requests): "
          f"{len(got)} requests, 0 errors, {num_completion / load.seconds:.1f} generated tok/s, cached "
          f"{num_cached}/{num_prompt} prompt tokens, TTFT p50 {ttfts[len(ttfts) // 2]:.2f} s, peak {peak:.0f} in "
          f"the engine ({sampled:.0f} in a 250 ms sample), cache max {max_bytes / 2**20:.1f} MiB of {MAIN_CACHE_BYTES / 2**20:.0f} "
          f"({delta('prefixserve_engine_cache_evictions_total'):.0f} evictions, "
          f"{delta('prefixserve_engine_cache_logits_shed_total'):.0f} logits shed), RSS warm {warm_rss / 2**20:.0f} MiB -> "
          f"after {rss / 2**20:.0f} MiB")  # fmt: skip
    assert peak >= NUM_CLIENTS
    assert num_cached > 0  # the shared system prompt is served from the cache
    # the budget was binding: entries evicted, or logits shed to avoid it (docs/cache.md, "Logits before KV")
    assert delta("prefixserve_engine_cache_evictions_total") + delta("prefixserve_engine_cache_logits_shed_total") > 0
    # The server's counters match what the clients saw.
    assert delta("prefixserve_engine_requests_total") == len(got)
    assert delta("prefixserve_prompt_tokens_total") == num_prompt
    assert delta("prefixserve_cached_prompt_tokens_total") == num_cached
    assert delta("prefixserve_completion_tokens_total") == num_completion
    assert abs(rss - warm_rss) <= 0.10 * warm_rss, f"RSS {warm_rss} after warm-up, {rss} after the load"
