"""A burst: C requests sent at once that open with one system prompt no server has seen, each with its
own question. Prints, per round, the wall time until the last answered, each request's latency and its
`cached_tokens` (prefixserve computes the system prompt once and serves it to the others: docs/
architecture.md, "Admission"). Against any OpenAI-compatible server, e.g. `make serve` (or llama.cpp's
llama-server, for comparison); from the repository root:

    .venv/bin/python bench/burst.py [--url http://127.0.0.1:8000] [--key KEY] [--clients 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

import httpx


def system_prompt(tag: str) -> str:
    rules = " ".join(f"Rule {i}: floor {i} is quiet after {20 + i % 4} o'clock." for i in range(60))
    return f"[{tag}] You are the concierge of the Harbour Hotel. {rules}"


async def one(c: httpx.AsyncClient, url: str, model: str, system: str, k: int) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    r = await c.post(f"{url}/v1/chat/completions", json={
        "model": model, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"When is floor {k} quiet?"}]})
    r.raise_for_status()
    usage = r.json()["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return time.perf_counter() - t0, usage["prompt_tokens"], cached


async def main(url: str, key: str, clients: int, rounds: int) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=600, headers=headers) as c:
        model = (await c.get(f"{url}/v1/models")).json()["data"][0]["id"]
        for r in range(rounds):
            system = system_prompt(uuid.uuid4().hex)
            t0 = time.perf_counter()
            results = await asyncio.gather(*(one(c, url, model, system, k) for k in range(clients)))
            wall = time.perf_counter() - t0
            print(f"round {r}: {clients} requests, {results[0][1]} prompt tokens each: last answered after {wall:.2f} s; "
                  f"latency s {sorted(round(x[0], 2) for x in results)}; cached_tokens {[x[2] for x in results]}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--key", default="unused-when-open")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    asyncio.run(main(a.url.rstrip("/"), a.key, a.clients, a.rounds))
