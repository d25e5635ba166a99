"""Micro-benchmark of the cache index: `python -m prefixserve.benchmarks.cache_index`, part of `prefixserve bench cache`.

Prompts look like chat traffic: groups of 50 share a 160-token system prompt, then differ in a
40..200-token user part. States are small fakes (KV-like, truncatable, with logits).
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable, Hashable

from prefixserve.cache.prefix_cache import PrefixCache
from prefixserve.config import CacheConfig
from prefixserve.types import Namespace

ENTRY_BYTES = 1000
SYSTEM_LEN = 160
PROMPTS_PER_SYSTEM = 50
NUM_PROBES = 1000


class _FakeState:
    __slots__ = ("_key", "num_tokens")
    truncatable = True
    has_logits = True
    nbytes = ENTRY_BYTES

    def __init__(self, num_tokens: int, key: int) -> None:
        self.num_tokens = num_tokens
        self._key = key

    def storage(self) -> list[tuple[Hashable, int]]:
        return [(self._key, ENTRY_BYTES)]


def bench_lookup(print_fn: Callable[[str], object] = print) -> None:
    """Print median and p99 lookup and insert cost in µs for caches of 100, 10k and 100k entries."""
    for num_entries in (100, 10_000, 100_000):
        started = time.perf_counter()
        samples = measure(num_entries)
        print_fn(f"{num_entries:>7} entries ({time.perf_counter() - started:.1f} s)")
        for name, values in samples.items():
            print_fn(f"  {name:<40} {_fmt(values)}")


def measure(num_entries: int) -> dict[str, list[int]]:
    """Per-call nanoseconds of lookups (hit, partial, miss) and inserts (with room, evicting) in a
    cache filled with `num_entries` chat-like prompts. Deterministic workload; GC off while timing."""
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a generational sweep over 100k entries would land in one sample
    try:
        return _measure(num_entries)
    finally:
        if gc_was_enabled:
            gc.enable()


def _measure(num_entries: int) -> dict[str, list[int]]:
    rng = random.Random(num_entries)
    vocab = list(range(49152))  # shared int objects, so 100k prompts stay small in memory
    num_systems = max(1, num_entries // PROMPTS_PER_SYSTEM)
    systems = [rng.choices(vocab, k=SYSTEM_LEN) for _ in range(num_systems)]

    def chat_prompt() -> tuple[int, ...]:
        return tuple(rng.choice(systems) + rng.choices(vocab, k=rng.randint(40, 200)))

    ns = Namespace("bench-model", "tenant")
    cache: PrefixCache[_FakeState] = PrefixCache(CacheConfig(max_bytes=num_entries * ENTRY_BYTES))
    prompts = [chat_prompt() for _ in range(num_entries)]
    states = [_FakeState(len(p), i) for i, p in enumerate(prompts)]
    samples: dict[str, list[int]] = {}
    samples["insert new key, room left"] = _time_each(cache.insert, ns, prompts, states)
    assert cache.num_entries == num_entries
    probes = {
        "lookup repeat (full hit)": [rng.choice(prompts) for _ in range(NUM_PROBES)],
        "lookup same system, new user (partial)": [chat_prompt() for _ in range(NUM_PROBES)],
        "lookup cold (miss)": [tuple(rng.choices(vocab, k=300)) for _ in range(NUM_PROBES)],
    }
    for name, queries in probes.items():
        samples[name] = _time_each(cache.lookup, ns, queries)
    evicting = [chat_prompt() for _ in range(NUM_PROBES)]
    more_states = [_FakeState(len(p), num_entries + i) for i, p in enumerate(evicting)]
    samples["insert new key, evicting LRU"] = _time_each(cache.insert, ns, evicting, more_states)
    return samples


def _time_each(
    fn: Callable[..., object], ns: Namespace, queries: list[tuple[int, ...]], *extra: list
) -> list[int]:
    samples = []
    for args in zip(queries, *extra):
        t0 = time.perf_counter_ns()
        fn(ns, *args)
        samples.append(time.perf_counter_ns() - t0)
    return samples


def _fmt(samples_ns: list[int]) -> str:
    ordered = sorted(samples_ns)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"median {statistics.median(ordered) / 1000:7.1f} µs   p99 {p99 / 1000:7.1f} µs"


if __name__ == "__main__":
    bench_lookup()
