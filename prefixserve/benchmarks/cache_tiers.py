"""`prefixserve bench cache`, the tiers part: hit latency from RAM vs from disk, bytes per cached
system-prompt user with and without shared storage, and what the piece size costs (docs/cache.md)."""

from __future__ import annotations

import statistics
import tempfile
import time
import uuid
from collections.abc import Callable

from prefixserve import __version__
from prefixserve.cache import PrefixCache
from prefixserve.cache.disk import DiskTier
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine import EngineCore
from prefixserve.runner import ModelRunner
from prefixserve.runner.codec import SnapshotCodec
from prefixserve.runner.pieces import PieceStore
from prefixserve.types import Delta, Namespace, Request, SamplingParams

Print = Callable[[str], object]


def bench_tiers(m, runner: ModelRunner, system_prompt: Callable[[int, str], str], quick: bool, print_fn: Print) -> None:
    """m: a LoadedModel; system_prompt(num_tokens, nonce) -> text."""
    reps = 3 if quick else 5
    firsts: dict[str, float] = {}

    def emit(rid: str, d: Delta) -> None:
        if d.token_ids:
            firsts.setdefault(rid, time.perf_counter())

    with tempfile.TemporaryDirectory(prefix="prefixserve-bench-") as tmp:
        disk = DiskTier(tmp, 8 << 30, "bench", __version__, SnapshotCodec())
        core = EngineCore(runner, m.tokenizer, PrefixCache(CacheConfig(max_bytes=4 << 30)), EngineConfig(), 8192,
                          emit, disk=disk)
        ns = Namespace("bench", "t")

        def ttft(ids: list[int]) -> float:
            rid = uuid.uuid4().hex
            t0 = time.perf_counter()
            core.add(Request(rid, ns, tuple(ids), SamplingParams(max_tokens=1, temperature=0.0)))
            while core.has_work():
                core.step()
            return firsts[rid] - t0

        print_fn("\n## hit latency by tier (TTFT of an identical prompt, in process)")
        print_fn("| prompt | RAM hit | disk hit (file read + verify + decode + re-insert) | disk load alone |")
        print_fn("|---|---:|---:|---:|")
        for n in (600, 2000):
            ram, disk_hit, load = [], [], []
            for _ in range(reps):
                ids = m.tokenizer.render_chat([{"role": "system", "content": system_prompt(n, uuid.uuid4().hex[:8])},
                                               {"role": "user", "content": "Which fee applies to account type 3?"}])
                ttft(ids)  # cold: computes and writes through
                disk.wait_idle(60)
                ram.append(ttft(ids))
                core.cache.flush(lambda _ns: True)  # RAM forgets; the file stays
                before = disk.stats()["disk_load_seconds_total"]
                disk_hit.append(ttft(ids))
                load.append(disk.stats()["disk_load_seconds_total"] - before)
            r, d, lo = (statistics.median(x) * 1000 for x in (ram, disk_hit, load))
            print_fn(f"| {len(ids)} tokens | {r:.2f} ms | {d:.1f} ms | {lo:.1f} ms |")
        disk.close()

    _bench_bytes(m, runner, system_prompt, 10 if quick else 50, print_fn)
    _bench_piece_sizes(m, runner, system_prompt, reps, print_fn)


def _bench_bytes(m, runner: ModelRunner, system_prompt: Callable[[int, str], str], num_users: int,
                 print_fn: Print) -> None:
    core = EngineCore(runner, m.tokenizer, PrefixCache(CacheConfig(max_bytes=8 << 30)), EngineConfig(), 8192,
                      lambda r, d: None)
    system = system_prompt(2000, "bytes")
    ns = Namespace("bench", "t")
    for i in range(num_users):
        ids = m.tokenizer.render_chat([{"role": "system", "content": system},
                                       {"role": "user", "content": f"User {i}: how do I close account {i * 7}?"}])
        core.add(Request(uuid.uuid4().hex, ns, tuple(ids), SamplingParams(max_tokens=1, temperature=0.0)))
        while core.has_work():
            core.step()
    per_token = runner.kv_bytes_per_token()
    # without shared storage every entry held a private copy of its whole prefix (+ its logits)
    vocab_bytes = 4 * m.arch.vocab_size  # fp32 logits
    private = sum(e.num_tokens * per_token + (vocab_bytes if e.has_logits else 0) for e in core.cache.entries())
    shared = core.cache.num_bytes
    print_fn(f"\n## bytes per cached system-prompt user (2,000-token system prompt, {num_users} users, "
             f"{core.cache.num_entries} entries)")
    print_fn("| storage | cache bytes | bytes per user |")
    print_fn("|---|---:|---:|")
    print_fn(f"| private copy per entry (before) | {private:,} | {private // num_users:,} |")
    print_fn(f"| shared pieces (now) | {shared:,} | {shared // num_users:,} |")


def _bench_piece_sizes(m, runner: ModelRunner, system_prompt: Callable[[int, str], str], reps: int,
                       print_fn: Print) -> None:
    ids = m.tokenizer.render_chat([{"role": "system", "content": system_prompt(2000, "pieces")},
                                   {"role": "user", "content": "Hello"}])
    state = runner.new_state()
    runner.prefill(state, ids, 256)
    print_fn(f"\n## piece size: snapshot and restore of {len(ids)} tokens (median of {reps})")
    print_fn("| piece tokens | pieces | snapshot (new) | snapshot (all shared) | restore (a hit's copy) |")
    print_fn("|---:|---:|---:|---:|---:|")
    for piece_tokens in (32, 64, 128, 256, 2048):
        new, shared, restore = [], [], []
        for r in range(reps):
            store = PieceStore(piece_tokens)
            t0 = time.perf_counter()
            snap = store.snapshot(state, ids, r)
            t1 = time.perf_counter()
            store.snapshot(state, ids, r)
            t2 = time.perf_counter()
            snap.restore(len(ids), 16)
            t3 = time.perf_counter()
            new.append(t1 - t0)
            shared.append(t2 - t1)
            restore.append(t3 - t2)
        a, b, c = (statistics.median(x) * 1000 for x in (new, shared, restore))
        print_fn(f"| {piece_tokens} | {len(snap.pieces)} | {a:.1f} ms | {b:.1f} ms | {c:.1f} ms |")
