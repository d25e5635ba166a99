"""One tenant's `DELETE /v1/cache` against a Redis of 1 million keys, another tenant's warm TTFT meanwhile.

The shared tier's flush SCANs the whole keyspace for the tenant's keys (cache/shared.py `flush`); it runs
on a worker thread beside the engine (engine/control.py), so the other tenant's requests should not
wait for it. This measures that: a real redis-server (tests/helpers/redis_proc.py) filled with
`--keys` keys of other namespaces (what a busy deployment's Redis holds), one `prefixserve serve` on it
with two tenants; tenant bob's warm TTFT (the same streaming chat again, max_tokens 1, time to the
first content chunk, back to back) in windows that alternate: no flush, then while tenant alice's
flush runs (the idle window as long as the last flush), `--flushes` times.

Run: .venv/bin/python bench/flush_ttft.py [--keys 1000000] [--flushes 3]
Prints one line per flush, the two windows' figures and a JSON summary; docs/cache.md, "Shared tier", has the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import redis

from tests.helpers.redis_proc import RedisServer
from tests.helpers.server_proc import ServerProcess

ALICE, BOB = "sk-flush-alice", "sk-flush-bob"
SYSTEM = "You are a support assistant. " + " ".join(f"Rule {i}: be precise about topic {i}." for i in range(60))


def fill(url: str, num_keys: int) -> float:
    """`num_keys` small keys under the server's prefix, in 1,000 other namespaces. Seconds taken."""
    r = redis.Redis.from_url(url)
    t0 = time.perf_counter()
    for start in range(0, num_keys, 10_000):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(num_keys, start + 10_000)):
            pipe.set(f"prefixserve:m{i % 7}:t{i % 1000:04x}:s:p:{i:08x}", b"x" * 16)
        pipe.execute()
    assert r.dbsize() >= num_keys
    return time.perf_counter() - t0


def ttft(client: httpx.Client, model: str, key: str, user: str = "hello") -> float:
    body = {"model": model, "stream": True, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line and '"content":""' not in line:
                break
    return time.perf_counter() - t0


def flush_once(base_url: str) -> dict[str, float]:
    """Alice's `DELETE /v1/cache`: its seconds and HTTP status."""
    t0 = time.perf_counter()
    with httpx.Client(base_url=base_url, timeout=600) as c:
        r = c.request("DELETE", "/v1/cache", headers={"Authorization": f"Bearer {ALICE}"})
    return {"seconds": time.perf_counter() - t0, "status": float(r.status_code)}


def p90(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--flushes", type=int, default=3)
    args = ap.parse_args()
    with RedisServer(maxmemory="2gb") as rs:
        fill_s = fill(rs.url, args.keys)
        print(f"redis: {args.keys} keys in {fill_s:.1f} s", flush=True)
        server_args = ["--api-key", f"alice {ALICE}", "--api-key", f"bob {BOB}", "--no-ledger",
                       "--cache-redis-url", rs.url, "--cache-redis-key", "flush-bench-secret-0123456789"]
        with ServerProcess(server_args) as srv, httpx.Client(base_url=srv.base_url, timeout=300) as client:
            model = client.get("/v1/models", headers={"Authorization": f"Bearer {BOB}"}).json()["data"][0]["id"]
            for user in ("one", "two", "three"):  # alice's entries, in RAM and Redis
                ttft(client, model, ALICE, user)
            for _ in range(3):  # bob's prompt cached
                ttft(client, model, BOB)
            idle: list[float] = []
            during: list[float] = []
            flushes: list[dict[str, float]] = []
            window_s = 2.5
            with ThreadPoolExecutor(1) as pool:
                for _ in range(args.flushes):  # idle and flushing windows alternate, of the same length
                    ttft(client, model, ALICE, "again")  # something of alice's to delete
                    t_end = time.perf_counter() + 1.0  # unmeasured: its turn's background work settles
                    while time.perf_counter() < t_end:
                        ttft(client, model, BOB)
                    t_end = time.perf_counter() + window_s
                    while time.perf_counter() < t_end:
                        idle.append(ttft(client, model, BOB))
                    flush = pool.submit(flush_once, srv.base_url)
                    num = len(during)
                    while not flush.done():
                        during.append(ttft(client, model, BOB))
                    result = flush.result()
                    window_s = result["seconds"]
                    flushes.append({**result, "requests_during": float(len(during) - num)})
                    print(f"flush: {result['seconds']:.2f} s (HTTP {result['status']:.0f}), {len(during) - num} of "
                          "bob's requests during it", flush=True)
            print(f"idle: bob's warm TTFT median {statistics.median(idle) * 1e3:.1f} ms, p90 {p90(idle) * 1e3:.1f} ms "
                  f"({len(idle)} requests)", flush=True)
            print(f"during flushes: bob's warm TTFT median {statistics.median(during) * 1e3:.1f} ms, "
                  f"p90 {p90(during) * 1e3:.1f} ms ({len(during)} requests); p90 ratio {p90(during) / p90(idle):.2f}",
                  flush=True)
            print(json.dumps({"keys": args.keys, "idle_p90_ms": p90(idle) * 1e3, "during_p90_ms": p90(during) * 1e3,
                              "idle_median_ms": statistics.median(idle) * 1e3,
                              "during_median_ms": statistics.median(during) * 1e3, "flushes": flushes}))


if __name__ == "__main__":
    main()
