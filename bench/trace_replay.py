"""Replay a Mooncake-format production trace against any OpenAI-compatible server, with offline bounds.

Get the trace (data, not in this repository): `make trace` downloads kvcache-ai/Mooncake's
`FAST25-release/traces/{conversation,synthetic}_trace.jsonl` into bench/data/ (ignored by git), or
`make trace MOONCAKE_GIT=PATH/.git` reads them out of a git copy of that repository. Over HTTP
against ours and llama-server together, with the exactness check: bench/trace_bench.py.

Offline (no server; seconds): the trace's working set, the hit rate of an infinite cache, Belady's
optimum and a block LRU at budgets of 10/25/50% of the working set (or `--cache-max-bytes`), and the
server's own `PrefixCache` under each eviction policy at the same byte budget (bench/trace_sim.py):

    .venv/bin/python bench/trace_replay.py bench/data/conversation_trace.jsonl --offline --block-tokens 16

Replay (each request's prompt as token ids following the trace's block structure, bench/
trace_model.py; sent at its arrival time / `--speedup`, streamed, one API key per tenant):

    .venv/bin/python bench/trace_replay.py TRACE --base-url http://127.0.0.1:8471/v1 --limit 300 \
        --tenants 4 --write-keys keys.txt --cache-max-bytes 1.9G
    # keys.txt is the server's --api-keys-file (written by --write-keys, then exits)

Reports requests, prompt tokens, cached tokens (usage.prompt_tokens_details.cached_tokens), hit
rate, TTFT p50/p90/p99, throughput, and the offline figures for the same requests at the same scale.

Exactness (`--compare OTHER_URL`): the first `--limit` requests, one at a time, greedy, max_tokens
`--compare-tokens`, to both servers (e.g. cache on and `--cache-max-bytes 0`); every completion's
text must match.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trace_model import (
    SMOLLM2_KV_BYTES_PER_TOKEN,
    SMOLLM2_LOGITS_BYTES,
    Scale,
    TraceRequest,
    api_keys_file_text,
    output_tokens,
    parse_trace,
    prompt_ids,
    sample_conversations,
    scaled_blocks,
    tenant_key,
    tenant_of,
)
from trace_sim import (
    ServerRequest,
    SimResult,
    simulate_belady,
    simulate_block_lru,
    simulate_infinite,
    simulate_server,
    working_set_tokens,
)

from prefixserve.cache.eviction import EVICTION_POLICIES
from prefixserve.config import CacheConfig


def parse_bytes(text: str) -> int:
    """'1.5G', '200M', '4096' -> bytes (binary units)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


# ---------------------------------------------------------------- offline


@dataclass
class OfflineReport:
    scale: str
    num_requests: int
    prompt_tokens: int
    working_set_tokens: int
    working_set_bytes: int
    infinite_hit_rate: float
    budgets: list[dict[str, Any]] = field(default_factory=list)


def offline(
    requests: Sequence[TraceRequest],
    scale: Scale,
    num_tenants: int,
    tenant_block: int,
    fractions: Sequence[float],
    budget_bytes: Sequence[int],
    kv_bytes: int,
    logits_bytes: int,
    policies: Sequence[str],
    turns: bool,
) -> OfflineReport:
    """Bounds and policy simulations (bench/trace_sim.py) at each budget: `fractions` of the working
    set and explicit `budget_bytes`."""
    units = [scaled_blocks(r, scale, tenant_of(r, num_tenants, tenant_block)) for r in requests]
    ws = working_set_tokens(units)
    inf = simulate_infinite(units)
    server_reqs = [
        ServerRequest(tenant_of(r, num_tenants, tenant_block), tuple(prompt_ids(r, scale)), output_tokens(r, scale))
        for r in requests
    ]
    report = OfflineReport(scale.describe(), len(requests), inf.prompt_tokens, ws, ws * kv_bytes, inf.hit_rate)
    budgets = [(f"{f:.0%} of working set", int(f * ws * kv_bytes)) for f in fractions]
    budgets += [(f"{b / (1 << 20):.1f} MiB ({b / max(1, ws * kv_bytes):.1%} of working set)", b) for b in budget_bytes]
    for label, nbytes in budgets:
        tokens = nbytes // kv_bytes
        results: list[SimResult] = [simulate_belady(units, tokens), simulate_block_lru(units, tokens)]
        for policy in policies:
            config = CacheConfig(max_bytes=nbytes, eviction=policy)
            results.append(simulate_server(server_reqs, config, kv_bytes, logits_bytes, turns, f"server-{policy}"))
        report.budgets.append(
            {
                "budget": label,
                "budget_bytes": nbytes,
                "budget_tokens": tokens,
                "hit_rate": {r.name: round(r.hit_rate, 4) for r in results},
                "hit_tokens": {r.name: r.hit_tokens for r in results},
            }
        )
    return report


def print_offline(report: OfflineReport) -> None:
    print(
        f"requests {report.num_requests}, prompt tokens {report.prompt_tokens:,}, working set "
        f"{report.working_set_tokens:,} tokens = {report.working_set_bytes / (1 << 20):,.1f} MiB of KV"
    )
    print(f"infinite cache: hit rate {report.infinite_hit_rate:.1%}")
    for b in report.budgets:
        rates = b["hit_rate"]
        best = rates.get("belady", 0.0)
        cells = ", ".join(
            f"{name} {rate:.1%}" + (f" ({rate / best:.0%} of Belady)" if best and name != "belady" else "")
            for name, rate in rates.items()
        )
        print(f"budget {b['budget']} = {b['budget_tokens']:,} tokens: {cells}")


# ---------------------------------------------------------------- replay


@dataclass
class Outcome:
    ok: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    late_s: float = 0.0  # how late it was sent against its scheduled time
    error: str = ""


async def _one(client: Any, model: str, prompt: list[int], max_tokens: int) -> Outcome:
    start = time.perf_counter()
    ttft = None
    usage = None
    completion = 0
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.choices and ttft is None:
                ttft = time.perf_counter() - start
            if chunk.usage is not None:
                usage = chunk.usage
    except Exception as exc:  # noqa: BLE001 -- a failed request is counted and reported, the replay goes on
        return Outcome(False, error=f"{type(exc).__name__}: {exc}"[:200])
    end = time.perf_counter()
    if usage is None:
        return Outcome(False, error="no usage in the stream", latency_s=end - start)
    details = getattr(usage, "prompt_tokens_details", None)
    cached = int(getattr(details, "cached_tokens", 0) or 0) if details is not None else 0
    completion = int(usage.completion_tokens or 0)
    return Outcome(True, int(usage.prompt_tokens), cached, completion, ttft or end - start, end - start)


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


async def replay(
    requests: Sequence[TraceRequest],
    scale: Scale,
    base_url: str,
    model: str | None,
    num_tenants: int,
    tenant_block: int,
    speedup: float,
    max_concurrency: int,
    timeout_s: float,
) -> dict[str, Any]:
    """Send every request at (its timestamp - the first's) / speedup; return the measured figures."""
    from openai import AsyncOpenAI

    clients = [
        AsyncOpenAI(base_url=base_url, api_key=tenant_key(t)[1], timeout=timeout_s, max_retries=0)
        for t in range(num_tenants)
    ]
    if model is None:
        model = (await clients[0].models.list()).data[0].id
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
    t0 = requests[0].timestamp_ms if requests else 0.0
    wall0 = time.perf_counter()

    async def send(req: TraceRequest) -> Outcome:
        due = (req.timestamp_ms - t0) / 1000 / speedup
        await asyncio.sleep(max(0.0, due - (time.perf_counter() - wall0)))
        client = clients[tenant_of(req, num_tenants, tenant_block)]
        prompt, max_tokens = prompt_ids(req, scale), output_tokens(req, scale)
        if gate is None:
            late = time.perf_counter() - wall0 - due
            out = await _one(client, model, prompt, max_tokens)
        else:
            async with gate:
                late = time.perf_counter() - wall0 - due
                out = await _one(client, model, prompt, max_tokens)
        out.late_s = late
        return out

    outcomes = await asyncio.gather(*(send(r) for r in requests))
    wall = time.perf_counter() - wall0
    for c in clients:
        await c.close()
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft_s for o in ok]
    prompt_tokens = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            errors[o.error] = errors.get(o.error, 0) + 1
    return {
        "base_url": base_url,
        "model": model,
        "requests": len(outcomes),
        "ok": len(ok),
        "errors": errors,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "completion_tokens": sum(o.completion_tokens for o in ok),
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p90_s": _percentile(ttfts, 90),
        "ttft_p99_s": _percentile(ttfts, 99),
        "latency_p50_s": _percentile([o.latency_s for o in ok], 50),
        "send_late_p90_s": _percentile([o.late_s for o in outcomes], 90),
        "wall_s": wall,
        "requests_per_s": len(ok) / wall if wall else 0.0,
        "prompt_tokens_per_s": prompt_tokens / wall if wall else 0.0,
        "computed_prompt_tokens_per_s": (prompt_tokens - cached) / wall if wall else 0.0,
        "completion_tokens_per_s": sum(o.completion_tokens for o in ok) / wall if wall else 0.0,
    }


def print_replay(r: dict[str, Any]) -> None:
    print(f"replay against {r['base_url']} (model {r['model']}): {r['ok']} of {r['requests']} requests ok")
    for err, n in r["errors"].items():
        print(f"  {n} x {err}")
    print(
        f"prompt tokens {r['prompt_tokens']:,}, cached {r['cached_tokens']:,}: hit rate {r['hit_rate']:.1%}; "
        f"completion tokens {r['completion_tokens']:,}"
    )
    print(
        f"TTFT p50 {r['ttft_p50_s'] * 1000:.0f} ms, p90 {r['ttft_p90_s'] * 1000:.0f} ms, "
        f"p99 {r['ttft_p99_s'] * 1000:.0f} ms; latency p50 {r['latency_p50_s'] * 1000:.0f} ms; "
        f"sent late p90 {r['send_late_p90_s'] * 1000:.0f} ms"
    )
    print(
        f"wall {r['wall_s']:.1f} s: {r['requests_per_s']:.2f} req/s, {r['prompt_tokens_per_s']:,.0f} prompt tok/s "
        f"({r['computed_prompt_tokens_per_s']:,.0f} computed), {r['completion_tokens_per_s']:.1f} completion tok/s"
    )


# ---------------------------------------------------------------- compare


def compare(
    requests: Sequence[TraceRequest],
    scale: Scale,
    base_url: str,
    other_url: str,
    model: str | None,
    num_tenants: int,
    tenant_block: int,
    max_tokens: int,
) -> dict[str, Any]:
    """Each request, in order and one at a time, greedy with `max_tokens`, to both servers; the
    texts must be equal. Returns counts and the first mismatches."""
    from openai import OpenAI

    def clients(url: str) -> list[OpenAI]:
        return [OpenAI(base_url=url, api_key=tenant_key(t)[1], max_retries=0) for t in range(num_tenants)]

    ours, theirs = clients(base_url), clients(other_url)
    if model is None:
        model = ours[0].models.list().data[0].id
    same = cached = 0
    mismatches: list[dict[str, Any]] = []
    for i, req in enumerate(requests):
        t = tenant_of(req, num_tenants, tenant_block)
        prompt = prompt_ids(req, scale)
        a = ours[t].completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        b = theirs[t].completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        details = a.usage.prompt_tokens_details if a.usage is not None else None
        cached += (details.cached_tokens or 0) if details is not None else 0
        if a.choices[0].text == b.choices[0].text:
            same += 1
        else:
            mismatches.append({"request": i, "ours": a.choices[0].text, "other": b.choices[0].text})
    return {"requests": len(requests), "equal": same, "cached_tokens": cached, "mismatches": mismatches[:5]}


# ---------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, help="a Mooncake-format JSONL trace (e.g. conversation_trace.jsonl)")
    p.add_argument("--sample", type=int, default=1, help="keep 1 in K conversations, by block --tenant-block (default 1: all)")
    p.add_argument("--part", type=int, default=0, help="which of the --sample parts (default 0)")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests (after --sample)")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per 512-token trace block (default 16)")
    p.add_argument("--max-prompt-tokens", type=int, default=8_192 - 64, help="prompt cap (default 8128)")
    p.add_argument("--max-output", type=int, default=16, help="output length cap (default 16)")
    p.add_argument("--tenants", type=int, default=1, help="API keys the requests are spread over (default 1)")
    p.add_argument("--tenant-block", type=int, default=1, help="block whose id mod K picks the tenant (default 1)")
    p.add_argument("--seed", type=int, default=0, help="token content seed")
    p.add_argument("--offline", "--dry-run", action="store_true", help="only the simulations, no server")
    p.add_argument("--fractions", default="0.1,0.25,0.5", help="offline budgets as fractions of the working set")
    p.add_argument("--cache-max-bytes", type=parse_bytes, default=None, help="also simulate this budget (bytes)")
    p.add_argument("--kv-bytes-per-token", type=int, default=SMOLLM2_KV_BYTES_PER_TOKEN)
    p.add_argument("--logits-bytes", type=int, default=SMOLLM2_LOGITS_BYTES)
    p.add_argument("--no-turns", action="store_true", help="simulate no finished-turn entries")
    p.add_argument("--policies", default=",".join(EVICTION_POLICIES), help="server eviction policies to simulate")
    p.add_argument("--base-url", default="http://127.0.0.1:8471/v1")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--speedup", type=float, default=1.0, help="replay arrival times this many times faster")
    p.add_argument("--max-concurrency", type=int, default=0, help="requests in flight at most (0: no limit)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--write-keys", type=Path, default=None, help="write the --api-keys-file for --tenants and exit")
    p.add_argument("--compare", default=None, metavar="OTHER_URL", help="exactness check against another server")
    p.add_argument("--compare-tokens", type=int, default=8)
    p.add_argument("--json", type=Path, default=None, help="also write the figures as JSON here")
    args = p.parse_args(argv)

    if args.write_keys is not None:
        args.write_keys.write_text(api_keys_file_text(args.tenants))
        args.write_keys.chmod(0o600)
        print(f"wrote {args.tenants} keys to {args.write_keys}")
        return 0
    scale = Scale(args.block_tokens, args.max_prompt_tokens, args.max_output, args.seed)
    with args.trace.open() as f:
        requests = sample_conversations(parse_trace(f), args.sample, args.tenant_block, args.part)[: args.limit]
    print(f"trace {args.trace}: {len(requests)} requests, {args.tenants} tenant(s) by block {args.tenant_block}")
    print(f"scale: {scale.describe()}")
    out: dict[str, Any] = {"trace": str(args.trace), "scale": asdict(scale), "tenants": args.tenants}

    if args.compare:
        result = compare(
            requests, scale, args.base_url, args.compare, args.model, args.tenants, args.tenant_block,
            args.compare_tokens,
        )
        print(f"compare {args.base_url} vs {args.compare}: {result['equal']} of {result['requests']} equal "
              f"(cached tokens on the first: {result['cached_tokens']:,})")
        for m in result["mismatches"]:
            print(f"  request {m['request']}: {m['ours']!r} != {m['other']!r}")
        out["compare"] = result
        _dump(args.json, out)
        return 0 if result["equal"] == result["requests"] else 1

    if not args.offline:
        result = asyncio.run(
            replay(requests, scale, args.base_url, args.model, args.tenants, args.tenant_block, args.speedup,
                   args.max_concurrency, args.timeout)
        )
        print_replay(result)
        out["replay"] = result
    fractions = [float(x) for x in args.fractions.split(",") if x.strip()]
    budgets = [args.cache_max_bytes] if args.cache_max_bytes is not None else []
    policies = [x for x in args.policies.split(",") if x.strip()]
    started = time.perf_counter()
    report = offline(
        requests, scale, args.tenants, args.tenant_block, fractions if args.offline or not budgets else [],
        budgets, args.kv_bytes_per_token, args.logits_bytes, policies, not args.no_turns,
    )
    print_offline(report)
    print(f"(offline simulations took {time.perf_counter() - started:.1f} s)")
    out["offline"] = asdict(report)
    _dump(args.json, out)
    return 0


def _dump(path: Path | None, out: dict[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(out, indent=2, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
