"""The engine with a tiny hybrid model: the learning sequence with snapshot-only states and recurrent
checkpoints, boundary entries on the grid, the next chat turn, isolation, and outputs equal to a
cache-less engine's (docs/hybrid.md)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from prefixserve.cache import PrefixCache
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine import AsyncEngine, EngineCore
from prefixserve.models import load_model
from prefixserve.models.hybrid.gated_delta import CELL
from prefixserve.runner import ModelRunner
from prefixserve.runner.hybrid_state import GRID, MAX_CHECKPOINTS, checkpoint_positions
from prefixserve.types import Namespace, Request, SamplingParams, Usage
from tests.conftest import TEST_DEVICE
from tests.helpers.engine_run import collect
from tests.hybrid.tiny import make_model

torch.set_num_threads(1)
SYSTEM = "You are a terse assistant for the Hybrid Test Suite. " * 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen35e"))
    make_model(folder, layers=4, seed=21)
    return load_model(folder, torch.float32, TEST_DEVICE)


def make_engine(model, max_bytes: int, chunk: int = 64) -> AsyncEngine:
    core = EngineCore(ModelRunner(model.decoder, 1), model.tokenizer, PrefixCache(CacheConfig(max_bytes=max_bytes)),
                      EngineConfig(prefill_chunk_tokens=chunk, max_batch_tokens=128), 2048, lambda r, d: None)
    return AsyncEngine(core, "tiny", model.tokenizer, "test", model.arch.vocab_size)


async def run(engine: AsyncEngine, ids: list[int], ns: Namespace, max_tokens: int = 8) -> tuple[list[int], Usage]:
    # the tests send the ids back as they got them (a random model's bytes need not be text)
    return await collect(engine, Request(uuid.uuid4().hex, ns, tuple(ids), SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True), text_history=False))


def test_learning_sequence_next_turn_and_isolation(model):
    tok = model.tokenizer
    prompts = [tok.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}])
               for u in ("Alpha question here?", "Bravo, tell me more.", "Charlie wants to know.",
                         "Alpha question here?")]
    shared = 0
    while prompts[0][shared] == prompts[1][shared]:
        shared += 1
    assert 200 < shared < len(prompts[1]) and shared % CELL  # the common prefix ends inside a cell
    ns, other = Namespace("tiny", "tenant-a"), Namespace("tiny", "tenant-b")

    cached, plain = make_engine(model, 1 << 30), make_engine(model, 0)

    async def scenario():
        results = []
        for p in prompts:
            results.append((await run(cached, p, ns), await run(plain, p, ns)))
        r1_out = results[0][0][0]
        turn2 = prompts[0] + r1_out + tok.encode("<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n")
        for _ in range(200):  # the turn's refill (its last token) runs while the engine idles
            if not cached.core.refills:
                break
            await asyncio.sleep(0.01)
        results.append((await run(cached, turn2, ns), await run(plain, turn2, ns)))
        results.append((await run(cached, prompts[2], other), await run(plain, prompts[2], other)))
        await cached.shutdown()
        await plain.shutdown()
        return results, None

    results, _ = asyncio.run(scenario())
    for (out, _), (ref, ref_usage) in results:
        assert out == ref  # exact: the cached engine answers as the cache-less one
        assert ref_usage.cached_tokens == 0
    cached_tokens = [u.cached_tokens for (_, u), _ in results]
    n1 = len(prompts[0])
    grid = shared - shared % GRID
    assert grid in checkpoint_positions(n1)  # request 1 kept a checkpoint there
    # 1: cold, stores its full prompt with its checkpoints; 2: resumes at the deepest checkpoint <= the
    # common prefix (the grid position a boundary entry would take: none is stored); 3: the same;
    # 4 = 1: whole prompt, no forward; turn 2: the finished turn (prompt + the whole reply, its last
    # token fed by a refill); another tenant: miss
    assert cached_tokens == [0, grid, grid, n1, n1 + 8, 0]
    cache = cached.core.cache
    assert cache.check_integrity() is None
    assert all(e.num_tokens != grid for e in cache.entries())  # no boundary entry: the checkpoint serves
    assert cache.get(ns, prompts[0]).points == tuple(checkpoint_positions(n1))  # type: ignore[union-attr]


def test_a_boundary_entry_on_the_grid_when_no_checkpoint_serves(model):
    """Request 1's common prefix with request 2 lies below all its checkpoints (a long user message):
    request 2 misses and stores a boundary entry at the grid position at or below the common prefix;
    request 3, whose message shares fewer tokens with 2's than 1's did, resumes there."""
    tok = model.tokenizer
    users = ("Alpha: " + "a long question about many things " * 12, "Bravo wants to know.", "Bro?")
    prompts = [tok.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}])
               for u in users]
    lcp12 = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1], strict=False)) if a != b)
    assert min(checkpoint_positions(len(prompts[0]))) > lcp12
    ns = Namespace("tiny", "tenant-g")
    cached, plain = make_engine(model, 1 << 30), make_engine(model, 0)

    async def scenario():
        out = [(await run(cached, p, ns), await run(plain, p, ns)) for p in prompts]
        await cached.shutdown()
        await plain.shutdown()
        return out

    results = asyncio.run(scenario())
    assert all(got[0] == ref[0] for got, ref in results)
    boundary = lcp12 - lcp12 % GRID
    assert [got[1].cached_tokens for got, _ in results] == [0, 0, boundary]
    assert cached.core.cache.get(ns, prompts[1][:boundary]) is not None
    assert cached.core.cache.check_integrity() is None


def test_the_budget_counts_checkpoints_and_refuses_an_entry_too_large(model):
    """An entry's checkpoints count against the byte budget: with a budget one byte short of request
    1's full entry (checkpoints included) it is refused and counted, the cache stays sound, and the
    answers are still those of a cache-less engine."""
    tok = model.tokenizer
    prompts = [tok.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}])
               for u in ("Alpha question here?", "Bravo, tell me more.")]
    ns = Namespace("tiny", "tenant-b")
    roomy, plain = make_engine(model, 1 << 30), make_engine(model, 0)

    async def measure():
        ref = [await run(plain, p, ns) for p in prompts]
        await run(roomy, prompts[0], ns, max_tokens=1)
        await roomy.shutdown()
        await plain.shutdown()
        return ref

    ref = asyncio.run(measure())
    entry = roomy.core.cache.get(ns, prompts[0])
    assert entry is not None and entry.points and entry.state.checkpoint_nbytes > 0
    assert entry.nbytes == sum(n for _, n in entry.state.storage())
    tight = make_engine(model, entry.nbytes - 1)

    async def scenario():
        out = [await run(tight, p, ns) for p in prompts]
        await tight.shutdown()
        return out

    got = asyncio.run(scenario())
    assert [g[0] for g in got] == [r[0] for r in ref]
    cache = tight.core.cache
    assert cache.get(ns, prompts[0]) is None and cache.stats().num_rejected_too_large >= 1
    assert cache.check_integrity() is None


def test_checkpoint_positions_bound_the_recomputation() -> None:
    """docs/hybrid.md's promise for runner/hybrid_state.py's positions: a prompt sharing lcp tokens
    resumes at a checkpoint whenever n - lcp <= 193 (n >= 257), and recomputes < 2 (n - lcp + 63)."""
    for n in range(2, 1200):
        points = checkpoint_positions(n)
        assert len(points) <= MAX_CHECKPOINTS and all(p % GRID == 0 and 0 < p < n for p in points)
        for lcp in range(1, n):
            at = max((p for p in points if p <= lcp), default=None)
            if n >= 257 and n - lcp <= 193:
                assert at is not None, (n, lcp)
            if at is not None:
                assert n - at < 2 * (n - lcp + GRID - 1), (n, lcp, at)
