"""The trace replay's exactness check, small and in process: 32 requests of a multi-turn trace built
as bench/trace_model.py builds the Mooncake trace's prompts give the same greedy tokens from an engine
whose cache is small enough to evict as from one with no cache (docs/exactness.md; the HTTP version
over the real trace is `bench/trace_bench.py --exact`)."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path

import pytest

# bench/ on the path for this import only (tests/bench/test_trace.py says why)
BENCH = str(Path(__file__).resolve().parents[2] / "bench")
sys.path.insert(0, BENCH)

from trace_model import (
    SMOLLM2_KV_BYTES_PER_TOKEN,
    Scale,
    TraceRequest,
    multi_turn_requests,
    output_tokens,
    parse_trace,
    prompt_ids,
    tenant_of,
)

sys.path.remove(BENCH)

from prefixserve.cache import PrefixCache
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine import AsyncEngine, EngineCore, metrics_snapshot
from prefixserve.types import Namespace, Request, SamplingParams
from tests.conftest import load_embedded, server_default_mode
from tests.helpers.engine_run import collect

pytestmark = pytest.mark.slow

NUM_CONVERSATIONS, NUM_TURNS = 8, 4
SCALE = Scale(block_tokens=8, max_output=12)


def conversation_trace() -> list[TraceRequest]:
    """8 conversations of 4 turns, interleaved turn by turn as the trace's are: block 0 shared by all
    (a system prompt), each turn two blocks longer than the last, its last block partial; the
    conversations alternate between two tenants."""
    lines = []
    for turn in range(NUM_TURNS):
        for conv in range(NUM_CONVERSATIONS):
            ids = [0] + [1000 * k + conv + 1 for k in range(1, 2 * turn + 3)]  # block 1's id: tenant by parity
            lines.append(json.dumps({"timestamp": 1000 * len(lines), "input_length": 512 * (len(ids) - 1) + 200,
                                     "output_length": 1024, "hash_ids": ids}))  # 16 tokens, capped at 12
    return parse_trace(lines)


def make_engine(max_bytes: int) -> AsyncEngine:
    model, runner = load_embedded(server_default_mode())
    core = EngineCore(runner, model.tokenizer, PrefixCache(CacheConfig(max_bytes=max_bytes)),
                      EngineConfig(prefill_chunk_tokens=128, max_batch_tokens=256), 2048, lambda r, d: None)
    return AsyncEngine(core, "smol", model.tokenizer, "test", model.arch.vocab_size)


def test_replayed_trace_is_exact_with_an_evicting_cache() -> None:
    requests = multi_turn_requests(conversation_trace(), 32)
    assert len(requests) == 32
    # room for about 9 prompts of ~40 tokens with their logits: the later turns shed logits, then evict
    budget = 9 * (40 * SMOLLM2_KV_BYTES_PER_TOKEN + 49_152 * 4)
    cached, plain = make_engine(budget), make_engine(0)

    async def replay(engine: AsyncEngine) -> list[tuple[list[int], int]]:
        out = []
        for r in requests:
            ns = Namespace("smol", f"t{tenant_of(r, 2)}")
            params = SamplingParams(max_tokens=output_tokens(r, SCALE), temperature=0.0)
            ids, usage = await collect(engine, Request(uuid.uuid4().hex, ns, tuple(prompt_ids(r, SCALE)), params))
            out.append((ids, usage.cached_tokens))
        await engine.shutdown()
        return out

    with_cache = asyncio.run(replay(cached))
    without = asyncio.run(replay(plain))
    assert [ids for ids, _ in with_cache] == [ids for ids, _ in without]
    assert all(n == 0 for _, n in without)
    num_cached = [n for _, n in with_cache]
    # the first request of each tenant misses; later turns find their history (each turn's prompt
    # begins with the last one's: its partial last block is a prefix of the full one) unless evicted
    assert num_cached[0] == 0 and sum(n > 8 for n in num_cached) >= NUM_CONVERSATIONS
    stats = cached.core.cache.stats()
    print(f"cached tokens {num_cached}; {stats.num_logits_shed} logits shed, {stats.num_evictions} evictions")
    assert stats.num_logits_shed > 0 and stats.num_evictions > 0
    values = metrics_snapshot.take(cached.core).values  # what /metrics exports as counters
    assert values["cache_logits_shed"] == stats.num_logits_shed
    assert values["cache_logits_shed_bytes"] == stats.num_logits_shed_bytes == stats.num_logits_shed * 49_152 * 4
    cached.core.cache.check_integrity()
