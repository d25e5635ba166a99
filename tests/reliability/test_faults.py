"""Faults: clients that vanish, and a cache budget far below one prompt.

Disconnects (raw sockets, so the moment of the hang-up is ours; half close with FIN, half with RST):
- `mid_stream`: a streaming request, hung up after its third SSE event;
- `mid_prefill`: a prompt of 1,200 fresh token ids (prefilled in chunks over several engine steps), hung
  up after 5-30% of the time this server takes for that prefill (measured first), before any output
  arrived (checked: no SSE event, no JSON body; a stream's headers may be there); streaming or not;
- `before_first_byte`: hung up at once after sending the whole request, or after half its body;
- `queued`: while another client's long prompt is being prefilled, a request hung up 20 ms after it
  was sent: the engine takes both the request and its abort between two steps, so it is aborted
  while still queued, before any work on it.

After every case the server must be idle again (no session running or waiting, no request in
flight). Over the whole run: the RSS of the server stays within 10% of its level after a warm-up
round, the cache stays within its byte budget, every request that reached the engine is counted as
aborted by the engine and recorded once in the usage ledger (nothing lost, nothing invented), the
mid-prefill hang-ups really cut prefill short (fewer prompt tokens computed than sent), and the
ledger bills exactly what the engine computed: its prompt tokens sum to the engine's cached plus
computed prompt tokens, its cached and output tokens to the engine's (a request aborted while queued
bills nothing; one aborted mid-prefill the prompt tokens processed, cached and computed).
`make test` runs 64 cases (16 of each kind) after a 12-case warm-up; `make soak` runs 680 (170 each).
(Each case is checked on its own: idle again, nothing in flight, so sixteen a kind still cover each
variant, FIN or RST, streaming or not, half a body or all, about four times each; was 25, cut to fit the
suite in 30 minutes on a 2-core AVX2 machine.)
"""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import httpx
import pytest

from tests.reliability.client import (
    Target,
    connect,
    hang_up,
    health,
    openai_error,
    peek,
    raw_request,
    read_until_events,
    scrape,
    settled_rss,
    stream,
    wait_idle,
)
from tests.reliability.conftest import MAIN_CACHE_BYTES, scaled

pytestmark = pytest.mark.slow

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
KINDS = ("mid_stream", "mid_prefill", "before_first_byte", "queued")
PREFILL_IDS = 1200
WARMUP_PER_KIND = 3


def run_case(target: Target, kind: str, n: int, rng: random.Random, prefill_s: float) -> None:
    """One disconnect of `kind`; `prefill_s` is how long a PREFILL_IDS-token prefill takes here."""
    headers = target.auth("faults")
    reset = n % 2 == 1
    if kind == "mid_stream":
        body = {"prompt": f"[{n}:{rng.random()}] Write a long story about a lighthouse keeper.", "max_tokens": 64,
                "ignore_eos": True,
                "temperature": 0, "stream": True}  # fmt: skip
        s = connect(target)
        s.sendall(raw_request(CMPL, json.dumps(body).encode(), headers))
        got = read_until_events(s, 3)
        hang_up(s, reset)
        assert got.startswith(b"HTTP/1.1 200") and got.count(b"data: ") >= 3, got[-600:]
        return
    if kind == "mid_prefill":
        ids = [rng.randrange(1000, 40000) for _ in range(PREFILL_IDS)]
        body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "stream": n % 4 < 2}
        s = connect(target)
        s.sendall(raw_request(CMPL, json.dumps(body).encode(), headers))
        time.sleep(rng.uniform(0.05, 0.3) * prefill_s)
        so_far = peek(s)  # streaming: the 200 and its headers may be there already, but no output
        hang_up(s, reset)
        assert b"data: " not in so_far and b'"choices"' not in so_far, (
            f"output before the hang-up: {so_far!r}"
        )
        return
    body = {
        "messages": [{"role": "user", "content": f"[{n}] Say hello."}],
        "max_tokens": 8,
        "stream": n % 4 < 2,
    }
    raw = raw_request(CHAT, json.dumps(body).encode(), headers)
    if kind == "queued":
        long = {"prompt": [rng.randrange(1000, 40000) for _ in range(PREFILL_IDS)], "max_tokens": 1}
        status: list[int] = []
        busy = threading.Thread(target=lambda: status.append(
            httpx.post(target.base_url + CMPL, json=long, headers=headers, timeout=300).status_code))
        busy.start()
        time.sleep(0.25 * prefill_s)  # the long prefill is under way: the engine is inside a step
        s = connect(target)
        s.sendall(raw)
        time.sleep(0.02)
        hang_up(s, reset)
        busy.join()
        assert status == [200]
        return
    s = connect(target)
    s.sendall(raw[: len(raw) - 10] if n % 3 == 0 else raw)  # a third hang up in the middle of the body
    hang_up(s, reset)


def usage_totals(target: Target, tenant: str, since: int) -> dict[str, int]:
    """What the usage ledger holds for `tenant` since `since` (unix seconds): requests and tokens."""
    r = httpx.get(target.base_url + "/v1/usage", params={"start_time": since, "bucket_width": "1d"},
                  headers=target.auth(tenant), timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    names = ("num_model_requests", "input_tokens", "input_cached_tokens", "output_tokens")
    return {k: sum(res[k] for bucket in r.json()["data"] for res in bucket["results"]) for k in names}


def prefill_seconds(target: Target, rng: random.Random) -> float:
    """How long this server takes to prefill PREFILL_IDS fresh tokens (max_tokens=1: TTFT ~ total);
    the faster of two runs, since the first long prefill of a fresh server is the slowest."""
    times = []
    for _ in range(2):
        ids = [rng.randrange(1000, 40000) for _ in range(PREFILL_IDS)]
        t0 = time.perf_counter()
        r = httpx.post(target.base_url + CMPL, json={"prompt": ids, "max_tokens": 1},
                       headers=target.auth("faults"), timeout=300)  # fmt: skip
        assert r.status_code == 200, r.text
        times.append(time.perf_counter() - t0)
    return min(times)


def test_disconnects_free_their_sessions_and_nothing_grows(main: Target) -> None:
    seed = time.time_ns()  # fresh prompts on every run, even against a server that saw an earlier one
    rng = random.Random(seed)
    per_kind = scaled(16, 170)
    since = int(time.time()) - 1
    m_start = scrape(main)
    prefill_s = prefill_seconds(main, rng)
    warm = [kind for kind in KINDS for _ in range(WARMUP_PER_KIND)]
    for n, kind in enumerate(warm):
        run_case(main, kind, n, rng, prefill_s)
        wait_idle(main)
    base_rss = settled_rss(main)
    m0 = scrape(main)
    cases = [kind for kind in KINDS for _ in range(per_kind)]
    rng.shuffle(cases)
    idle_waits: list[float] = []
    max_cache_bytes = m0["prefixserve_cache_bytes"]
    for n, kind in enumerate(cases, start=len(warm)):
        run_case(main, kind, n, rng, prefill_s)
        idle_waits.append(wait_idle(main, timeout=60))
        if n % 10 == 0:
            max_cache_bytes = max(max_cache_bytes, scrape(main)["prefixserve_cache_bytes"])
    rss = settled_rss(main)
    m1 = scrape(main)
    max_cache_bytes = max(max_cache_bytes, m1["prefixserve_cache_bytes"])

    def delta(name: str, start: dict[str, float] = m0) -> float:
        return m1.get(name, 0.0) - start.get(name, 0.0)

    reached = delta("prefixserve_engine_requests_total")
    aborted = delta("prefixserve_requests_finished_total{finish_reason=abort}")
    print(f"\nfaults (seed {seed}): {len(cases)} disconnects ({per_kind} per kind) after {len(warm)} warm-up; "
          f"{int(reached)} reached the engine, {int(aborted)} counted aborted; prefill of {PREFILL_IDS} tokens "
          f"{prefill_s:.2f} s; RSS {base_rss / 2**20:.0f} -> {rss / 2**20:.0f} MiB; cache "
          f"{m1['prefixserve_cache_entries']:.0f} entries, max {max_cache_bytes / 2**20:.1f} MiB of "
          f"{MAIN_CACHE_BYTES / 2**20:.0f}; idle again within {max(idle_waits):.2f} s (max)")  # fmt: skip
    busy = per_kind  # the long prompts that keep the engine busy for `queued` finish normally
    assert per_kind * 2 + busy <= reached <= len(cases) + busy  # mid_stream, mid_prefill and busy certainly reach it
    assert aborted == reached - busy, "every disconnect that reached the engine must be counted as aborted"
    assert delta("prefixserve_engine_completion_tokens_total") >= per_kind * 2  # mid_stream: >= 2 each
    # Prefill was really cut short: fewer prompt tokens computed than the mid-prefill prompts alone hold
    # (beside the busy prompts, computed whole).
    assert delta("prefixserve_engine_computed_prompt_tokens_total") < per_kind * PREFILL_IDS + busy * PREFILL_IDS
    assert rss <= base_rss * 1.10, f"RSS grew from {base_rss} to {rss} bytes"
    assert max_cache_bytes <= MAIN_CACHE_BYTES
    assert m1["prefixserve_requests_in_flight"] == 0
    # The ledger holds one record per request the engine saw (calibration and warm-up included).
    ledger = usage_totals(main, "faults", since)
    assert ledger["num_model_requests"] == delta("prefixserve_engine_requests_total", m_start)
    # ... each billed with what the engine computed for it (worker truth, aborts included)
    engine_prompt = delta("prefixserve_engine_cached_tokens_total", m_start) + delta(
        "prefixserve_engine_computed_prompt_tokens_total", m_start)
    print(f"ledger: {ledger}; engine: prompt {engine_prompt:.0f} (cached "
          f"{delta('prefixserve_engine_cached_tokens_total', m_start):.0f}), completion "
          f"{delta('prefixserve_engine_completion_tokens_total', m_start):.0f}")  # fmt: skip
    assert ledger["input_tokens"] == engine_prompt == delta("prefixserve_engine_prompt_tokens_total", m_start)
    assert ledger["input_cached_tokens"] == delta("prefixserve_engine_cached_tokens_total", m_start)
    assert ledger["output_tokens"] == delta("prefixserve_engine_completion_tokens_total", m_start)
    assert health(main)["ok"]


# ---- a cache budget far smaller than one prompt ------------------------------------------------------

QUESTIONS = [
    "What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?",
    "What is 12 times 12?", "Write a haiku about rain.", "What does a compass show?",
]  # fmt: skip
COMPLETION_PROMPTS = ["The three laws of thermodynamics are", "def fibonacci(n):\n    "]


def greedy(
    target: Target, client: httpx.Client, item: str, is_chat: bool
) -> tuple[str, str | None, dict[str, Any]]:
    if is_chat:
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": item}],
            "max_tokens": 8,
            "temperature": 0,
        }
        r = stream(client, target.base_url + CHAT, body, target.auth("alice"))
    else:
        r = stream(client, target.base_url + CMPL, {"prompt": item, "max_tokens": 8, "temperature": 0},
                   target.auth("alice"))  # fmt: skip
    assert r.ok, r
    assert r.usage is not None
    return r.text, r.finish_reason, r.usage


def test_cache_budget_far_below_one_prompt_still_serves_correct_answers(main: Target, tiny: Target) -> None:
    """`--cache-max-bytes 1000` cannot hold even one token's state: every request must miss
    (cached_tokens 0, also on an exact repeat), nothing may be cached, and every answer must equal
    the greedy answer of the normal server."""
    before = scrape(tiny)
    items = [(q, True) for q in QUESTIONS] + [(p, False) for p in COMPLETION_PROMPTS]
    with httpx.Client(timeout=300) as client:
        for item, is_chat in items:
            want = greedy(main, client, item, is_chat)
            for _ in range(2):
                text, finish, usage = greedy(tiny, client, item, is_chat)
                assert (text, finish) == want[:2], (item, text, want)
                assert usage["prompt_tokens_details"]["cached_tokens"] == 0
                assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
                    want[2]["prompt_tokens"], want[2]["completion_tokens"])  # fmt: skip
    after = scrape(tiny)
    assert after["prefixserve_cache_bytes"] == 0 and after["prefixserve_cache_entries"] == 0
    assert (
        after["prefixserve_engine_cache_rejected_too_large_total"]
        > before["prefixserve_engine_cache_rejected_too_large_total"]
    )
    assert after["prefixserve_cached_prompt_tokens_total"] == before["prefixserve_cached_prompt_tokens_total"]


# ---- one request's parameters cannot fail the others -------------------------------------------------


def test_a_near_zero_temperature_fails_nobody(main: Target) -> None:
    """temperature=5e-324 is a valid number in [0, 2]. Dividing logits by it overflows to inf and
    softmax to NaN; whatever the server does with that request (sample greedily, or refuse it with a
    400), it must not be a 500, and it must not fail another tenant's stream in flight."""
    result: dict[str, Any] = {}
    first = threading.Event()

    def bystander() -> None:
        body = {
            "prompt": "The history of the lighthouse",
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
        }
        with httpx.Client(timeout=300) as c:
            result["bob"] = stream(c, main.base_url + CMPL, body, main.auth("bob"), on_first=first.set)

    t = threading.Thread(target=bystander)
    t.start()
    assert first.wait(120)
    statuses = []
    for temperature in (5e-324, 1e-200, 1e-45):
        r = httpx.post(main.base_url + CHAT, headers=main.auth("alice"), timeout=300, json={
            "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 2, "temperature": temperature,
        })  # fmt: skip
        statuses.append(r.status_code)
        if r.status_code != 200:
            openai_error(r)
    t.join(300)
    bob = result["bob"]
    assert bob.ok and bob.finish_reason == "length" and bob.usage["completion_tokens"] == 24, bob
    assert all(s in (200, 400) for s in statuses), statuses
    wait_idle(main)
