"""AsyncEngine.metrics() while a step runs: it never waits for the step (it used to wait up to 2 s
for the step lock, on the server's event loop), and a request's figures are there once its final
Delta has been seen."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from prefixserve.cache import PrefixCache
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine import AsyncEngine, EngineCore
from prefixserve.types import Delta, Namespace, Request, SamplingParams
from tests.conftest import load_embedded

pytestmark = pytest.mark.slow
NS = Namespace("smol", "t")
STEP_S = 1.0  # how long the first step holds the engine's lock


def make_engine() -> AsyncEngine:
    model, runner = load_embedded("int4")
    core = EngineCore(runner, model.tokenizer, PrefixCache(CacheConfig(max_bytes=1 << 30)),
                      EngineConfig(prefill_chunk_tokens=64, max_batch_tokens=256), 2048, lambda r, d: None)
    return AsyncEngine(core, "smol", model.tokenizer, "test", model.arch.vocab_size)


def test_metrics_never_wait_for_a_step_and_count_a_finished_request() -> None:
    engine = make_engine()
    in_step = threading.Event()
    step = engine.core.step

    def slow_step() -> None:  # a long prefill step, as the engine thread runs it: under the lock
        if not in_step.is_set():
            in_step.set()
            time.sleep(STEP_S)
        step()
        if not engine.core.has_work():  # the last step goes on after the final Delta left (say, a prefill)
            time.sleep(STEP_S / 2)

    engine.core.step = slow_step  # type: ignore[method-assign]
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    req = Request("m1", NS, tuple(ids), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))

    async def go() -> tuple[float, dict[str, float], Delta, dict[str, float]]:
        stream = engine.generate(req)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.to_thread(in_step.wait, 10.0)
        t0 = time.monotonic()
        during = engine.metrics()
        waited = time.monotonic() - t0
        last = await first
        async for last in stream:
            pass
        after = engine.metrics()  # at once: no sleep between the final Delta and the read
        await engine.shutdown()
        return waited, during, last, after

    waited, during, last, after = asyncio.run(go())
    assert waited < 0.05, f"metrics() waited {waited:.3f} s for the step"
    assert during["requests"] == 1 and during["completion_tokens"] == 0  # the view before the step
    assert last.finish_reason is not None and last.usage is not None
    assert after["requests"] == 1
    assert after["prompt_tokens"] == last.usage.prompt_tokens == after["cached_tokens"] + after["computed_prompt_tokens"]
    assert after["completion_tokens"] == last.usage.completion_tokens == 3
    assert after["running"] == 0 and after["waiting"] == 0 and after["oldest_wait_seconds"] == 0.0


def test_free_memory_goes_back_once_the_engine_has_been_idle_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc keeps freed KV in its arenas; the engine hands the free pages back (malloc_trim) once it
    has been idle TRIM_AFTER_IDLE_S after work: once per idle spell, never between back-to-back requests."""
    from prefixserve.engine import async_engine

    trims: list[float] = []
    monkeypatch.setattr(async_engine, "TRIM_AFTER_IDLE_S", 1.0)
    monkeypatch.setattr(async_engine, "release_free_memory", lambda: trims.append(time.monotonic()))
    engine = make_engine()
    model, _ = load_embedded("int4")
    ids = tuple(model.tokenizer.render_chat([{"role": "user", "content": "Name a colour."}]))

    async def go() -> tuple[int, int]:
        for _ in range(3):  # back to back
            async for _d in engine.generate(Request(f"r{len(trims)}{time.monotonic()}", Namespace("m", "t"), ids,
                                                    SamplingParams(max_tokens=2, temperature=0.0))):
                pass
        between = len(trims)
        await asyncio.sleep(3.0)  # past the idle time, and a few of the loop's 0.5 s waits
        after = len(trims)
        await engine.shutdown()
        return between, after

    between, after = asyncio.run(go())
    assert (between, after) == (0, 1)
