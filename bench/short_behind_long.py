"""Short requests while a long prompt prefills: the latency a tenant sees behind another's big prompt.

    .venv/bin/python bench/short_behind_long.py [--long-tokens 2000] [--clients 3] [--rounds 3] [--peer]

Starts ours (`prefixserve serve --no-ledger`; with --peer also `.peer/bin/llama-server` with `make
bench`'s flags, each measured alone), then, per round, sends one cold prompt of about --long-tokens
tokens (`/v1/completions`, streaming, 1 token) and, once it is under way, lets --clients clients each
send cold ~10-token prompts one after another (1 token each) until it answers. Prints the short
requests' time to first token (p50 / p90 / max, and how many) and the long prompt's. Environment
variables given to this script (e.g. `make bench-avx2`'s emulation) reach the servers. `make bench`
measures a harder case (100-token chat prompts behind 8,000 tokens): docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer import peer_cmd
from serve_bench import API_KEY, default_gguf
from servers import ServerProcess, free_port

WORDS = ["the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
         "not", "this", "are", "or", "from", "at", "which", "but", "have", "an", "they", "you", "were", "there"]


async def ttft(client: httpx.AsyncClient, prompt: str) -> float:
    """Seconds to the first streamed chunk with text of a greedy 1-token completion."""
    body = {"model": client.headers["x-bench-model"], "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - t0
    raise RuntimeError("no token came back")


async def _shorts(client: httpx.AsyncClient, long: asyncio.Task[float], who: str, out: list[float]) -> None:
    """One client's cold ~10-token requests, one after another, until `long` has answered."""
    k = 0
    while not long.done():
        out.append(await ttft(client, f"Client {who} asks {k}: name a colour."))
        k += 1


async def measure(base_url: str, long_tokens: int, clients: int, rounds: int, seed: int) -> dict[str, list[float]]:
    rng = random.Random(seed)
    shorts: list[float] = []
    longs: list[float] = []
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600) as client:
        models = (await client.get("/v1/models")).json()["data"]
        client.headers["x-bench-model"] = models[0]["id"]  # read back by `ttft`, sent along harmlessly
        await ttft(client, "Warm up.")
        for r in range(rounds):
            long_prompt = " ".join(rng.choice(WORDS) for _ in range(int(long_tokens * 0.95))) + f" Round {r}."
            long = asyncio.create_task(ttft(client, long_prompt))
            await asyncio.sleep(0.3)  # its prefill is under way

            await asyncio.gather(*(_shorts(client, long, f"{c} of round {r} {seed}", shorts) for c in range(clients)))
            longs.append(await long)
    return {"short": shorts, "long": longs}


def describe(name: str, got: dict[str, list[float]]) -> str:
    s = sorted(got["short"])
    p90 = s[min(len(s) - 1, int(0.9 * len(s)))] if s else float("nan")
    med = statistics.median(s) if s else float("nan")
    return (f"{name}: short requests n={len(s)} TTFT p50 {med * 1e3:.0f} ms, p90 {p90 * 1e3:.0f} ms, "
            f"max {max(s, default=float('nan')) * 1e3:.0f} ms; long prompt TTFT "
            + ", ".join(f"{v:.1f} s" for v in got["long"]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ours-cmd", default=".venv/bin/prefixserve serve --no-ledger")
    p.add_argument("--peer", action="store_true", help="also measure llama.cpp's llama-server")
    p.add_argument("--peer-bin", default=".peer/bin/llama-server")
    args = p.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="short-behind-long-"))
    port = free_port()
    ours = [*args.ours_cmd.split(), "--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY]
    with ServerProcess("ours", ours, port, API_KEY, logs / "ours.log") as server:
        print(describe("ours", asyncio.run(measure(server.base_url, args.long_tokens, args.clients, args.rounds, 1))),
              flush=True)
    if args.peer:
        port = free_port()
        peer = peer_cmd(args.peer_bin, default_gguf(), API_KEY)(port, 2, 2)
        with ServerProcess("peer", peer, port, API_KEY, logs / "peer.log") as server:
            print(describe("peer", asyncio.run(measure(server.base_url, args.long_tokens, args.clients, args.rounds, 2))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
