"""Cache costs: index lookup/insert at 100 / 10k / 100k entries, and in-process TTFT cold vs hits."""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable

import torch

from prefixserve.benchmarks.cache_index import bench_lookup
from prefixserve.cache import PrefixCache
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine import EngineCore
from prefixserve.models import load_model, resolve_dtype
from prefixserve.runner import ModelRunner
from prefixserve.types import Delta, Namespace, Request, SamplingParams


def bench_cache(quick: bool = False, num_threads: int | None = None, print_fn: Callable[[str], object] = print,
                only: str | None = None) -> None:
    """Every part, or with only="shared" just the shared tier's (Redis) TTFT table."""
    if num_threads:
        torch.set_num_threads(num_threads)
    if only is None:
        print_fn("## index: lookup and insert cost")
        bench_lookup(print_fn)
        print_fn("\n## in-process TTFT (engine, embedded model, auto dtype)")
        _bench_ttft(quick, print_fn)
    from prefixserve.benchmarks.cache_shared import bench_shared
    from prefixserve.benchmarks.cache_tiers import bench_tiers

    dtype = resolve_dtype("auto")  # as the server's default
    m = load_model(None, dtype)
    runner = ModelRunner(m.decoder)
    if only is None:
        bench_tiers(m, runner, lambda n, nonce: _system_prompt(m.tokenizer, n, nonce), quick, print_fn)
    bench_shared(m, runner, lambda n, nonce: _system_prompt(m.tokenizer, n, nonce), quick, print_fn)
    if only is None:
        from prefixserve.benchmarks.hybrid import bench_hybrid

        bench_hybrid(quick, print_fn)  # docs/hybrid.md


def _system_prompt(tokenizer, num_tokens: int, nonce: str) -> str:
    words = []
    i = 0
    text = f"[{nonce}] You are the assistant of the Lumen Bank help desk."
    while len(tokenizer.encode(text)) < num_tokens:
        i += 1
        words.append(f"Guideline {i}: when a client asks about account type {i}, verify identity, quote fee "
                     f"schedule {i * 3}, and escalate disputes above {i * 100} euros.")
        text = f"[{nonce}] You are the assistant of the Lumen Bank help desk. " + " ".join(words)
    return text


def _bench_ttft(quick: bool, print_fn: Callable[[str], object]) -> None:
    dtype = resolve_dtype("auto")  # as the server's default
    m = load_model(None, dtype)
    runner = ModelRunner(m.decoder)
    firsts: dict[str, float] = {}

    def emit(rid: str, d: Delta) -> None:
        if d.token_ids:  # the admission delta carries usage only
            firsts.setdefault(rid, time.perf_counter())

    core = EngineCore(runner, m.tokenizer, PrefixCache(CacheConfig(max_bytes=4 << 30)), EngineConfig(), 8192, emit)
    ns = Namespace("bench", "t")
    reps = 3 if quick else 5

    def ttft(ids: list[int]) -> float:
        rid = uuid.uuid4().hex
        t0 = time.perf_counter()
        core.add(Request(rid, ns, tuple(ids), SamplingParams(max_tokens=1, temperature=0.0)))
        while core.has_work():
            core.step()
        return firsts[rid] - t0

    print_fn("| system prompt | cold | full hit | partial hit (new user message) | cold / full hit |")
    print_fn("|---|---:|---:|---:|---:|")
    for n in (600, 2000):
        cold, full, partial = [], [], []
        for r in range(reps):
            system = _system_prompt(m.tokenizer, n, uuid.uuid4().hex[:8])

            def chat(user: str, system: str = system) -> list[int]:
                return m.tokenizer.render_chat([{"role": "system", "content": system}, {"role": "user", "content": user}])

            ids = chat("What is the fee for account type 3?")
            cold.append(ttft(ids))
            full.append(ttft(ids))
            partial.append(ttft(chat(f"Question {r}: how do I dispute a charge?")))
        c, f, p = (statistics.median(x) * 1000 for x in (cold, full, partial))
        print_fn(f"| {len(ids)} tokens | {c:.1f} ms | {f:.2f} ms | {p:.1f} ms | {c / f:.0f}x |")


