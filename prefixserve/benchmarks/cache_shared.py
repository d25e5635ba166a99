"""`prefixserve bench cache`, the shared-tier part: TTFT on replica 2 for a prompt replica 1 computed
(served from Redis) against a cold prefill and a local RAM hit, and on replica 3 for another user of
the same system prompt (found by its markers), at ~600 and ~2,000 tokens.

Three in-process engines ("replicas", each with its own RAM cache, sharing the loaded model) and one
Redis: $PREFIXSERVE_BENCH_REDIS_URL, else a `redis-server` started here on a free port. Prints only.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prefixserve import __version__
from prefixserve.cache import PrefixCache
from prefixserve.cache.shared import SharedTier
from prefixserve.config import CacheConfig, EngineConfig, SharedTierConfig
from prefixserve.engine import EngineCore
from prefixserve.runner import ModelRunner
from prefixserve.runner.codec import SnapshotCodec
from prefixserve.types import Delta, FlushScope, Namespace, Request, SamplingParams

Print = Callable[[str], object]


def bench_shared(m, runner: ModelRunner, system_prompt: Callable[[int, str], str], quick: bool, print_fn: Print) -> None:
    """m: a LoadedModel; system_prompt(num_tokens, nonce) -> text."""
    with _redis() as url:
        if url is None:
            print_fn("\n## shared tier: skipped (no redis-server on PATH and no $PREFIXSERVE_BENCH_REDIS_URL)")
            return
        _bench(m, runner, system_prompt, url, 3 if quick else 5, print_fn)


def _bench(m, runner: ModelRunner, system_prompt: Callable[[int, str], str], url: str, reps: int,
           print_fn: Print) -> None:
    firsts: dict[str, float] = {}

    def emit(rid: str, d: Delta) -> None:
        if d.token_ids:
            firsts.setdefault(rid, time.perf_counter())

    config = SharedTierConfig(url, b"bench-secret-0123456789", prefix=f"bench{uuid.uuid4().hex[:8]}")
    tiers = [SharedTier(config, "bench", __version__, SnapshotCodec()) for _ in range(3)]
    replicas = [EngineCore(runner, m.tokenizer, PrefixCache(CacheConfig(max_bytes=4 << 30)), EngineConfig(), 8192,
                           emit, shared=t) for t in tiers]
    ns = Namespace("bench", "t")

    def ttft(core: EngineCore, ids: list[int]) -> float:
        rid = uuid.uuid4().hex
        t0 = time.perf_counter()
        core.add(Request(rid, ns, tuple(ids), SamplingParams(max_tokens=1, temperature=0.0)))
        while core.has_work():
            core.step()
        return firsts[rid] - t0

    print_fn(f"\n## shared tier (Redis at {url.split('@')[-1]}): TTFT of a prompt replica 1 computed, on other replicas")
    print_fn("| prompt | cold prefill (replica 1) | shared-tier hit, same prompt (replica 2) | of which Redis find + GET "
             "+ verify + decode | shared-tier hit, other user (replica 3) | local RAM hit (replica 2 again) | "
             "value bytes |")
    print_fn("|---|---:|---:|---:|---:|---:|---:|")
    for n in (600, 2000):
        cold, shared, load, other, ram = [], [], [], [], []
        w0 = tiers[0].stats()
        for _ in range(reps):
            system = system_prompt(n, uuid.uuid4().hex[:8])
            ids, ids_b = (m.tokenizer.render_chat([{"role": "system", "content": system},
                                                   {"role": "user", "content": user}])
                          for user in ("Which fee applies to account type 3?", "How do I close account 12?"))
            cold.append(ttft(replicas[0], ids))
            tiers[0].wait_idle(60)
            before = tiers[1].stats()["redis_load_seconds_total"]
            shared.append(ttft(replicas[1], ids))
            load.append(tiers[1].stats()["redis_load_seconds_total"] - before)
            other.append(ttft(replicas[2], ids_b))  # the marker leads to replica 1's entry; the rest is computed
            ram.append(ttft(replicas[1], ids))
            for t in tiers:
                t.wait_idle(60)
        w1 = tiers[0].stats()  # bytes per value replica 1 wrote at this size
        size = (w1["redis_write_bytes"] - w0["redis_write_bytes"]) / max(1.0, w1["redis_writes"] - w0["redis_writes"])
        c, s, lo, o, r = (statistics.median(x) * 1000 for x in (cold, shared, load, other, ram))
        print_fn(f"| {len(ids)} tokens | {c:,.0f} ms | {s:.1f} ms | {lo:.1f} ms | {o:.1f} ms | {r:.2f} ms | "
                 f"~{size / 1e6:.1f} MB |")
    tiers[0].flush(FlushScope(None, None))  # the bench's own key prefix only
    for t in tiers:
        t.close()



@contextmanager
def _redis() -> Iterator[str | None]:
    if os.environ.get("PREFIXSERVE_BENCH_REDIS_URL"):
        yield os.environ["PREFIXSERVE_BENCH_REDIS_URL"]
        return
    binary = shutil.which("redis-server") or shutil.which("redis-server", path="/usr/sbin:/usr/bin")
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="prefixserve-bench-redis-") as tmp:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", tmp,
                                 "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(200):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait()
