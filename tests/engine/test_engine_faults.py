"""Serving under pressure, on the real engine: injected faults stay local, usage on abort is what was
computed, admission waits for the session memory budget, a full queue answers Overloaded."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import torch

from prefixserve.cache import PrefixCache
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine import AsyncEngine, EngineCore
from prefixserve.types import (
    Delta,
    FinishReason,
    InvalidRequest,
    Namespace,
    Overloaded,
    Request,
    SamplingParams,
    Unavailable,
    Usage,
)
from tests.conftest import load_embedded
from tests.helpers.engine_run import collect_to_last as collect

pytestmark = pytest.mark.slow
NS = Namespace("smol", "t")
POISON = 4242  # a token id whose presence in a batch makes the injected fault fire


def make_engine(**engine_kw) -> AsyncEngine:
    model, runner = load_embedded("int4")
    cfg = EngineConfig(prefill_chunk_tokens=64, max_batch_tokens=256, **engine_kw)
    core = EngineCore(runner, model.tokenizer, PrefixCache(CacheConfig(max_bytes=1 << 30)), cfg, 2048,
                      lambda r, d: None)
    return AsyncEngine(core, "smol", model.tokenizer, "test", model.arch.vocab_size)


def request(ids: list[int], max_tokens: int = 8, rid: str | None = None, ignore_eos: bool = False) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    return Request(rid or uuid.uuid4().hex, NS, tuple(ids), sp)




def prompts() -> list[list[int]]:
    model, _ = load_embedded("int4")
    tok = model.tokenizer
    return [tok.render_chat([{"role": "user", "content": f"Question {i}: name a colour and a fruit."}])
            for i in range(3)]


def test_a_failing_batch_fails_only_the_request_that_causes_it(monkeypatch):
    ps = prompts()
    bad = ps[0][:-3] + [POISON] + ps[0][-3:]
    clean = make_engine()

    async def reference():
        refs = [await collect(clean, request(p)) for p in ps[1:]]
        await clean.shutdown()
        return refs

    refs = asyncio.run(reference())
    engine = make_engine()
    real_step = engine.core.runner.step

    def step(items):
        if any(POISON in it.token_ids for it in items):
            raise RuntimeError("injected fault: poisoned batch")
        return real_step(items)

    monkeypatch.setattr(engine.core.runner, "step", step)

    async def go():
        results = await asyncio.gather(*(collect(engine, request(p)) for p in (bad, *ps[1:])))
        health = engine.health()
        await engine.shutdown()
        return results, health

    results, health = asyncio.run(go())
    (_, bad_last), *good = results
    assert bad_last.finish_reason is FinishReason.ERROR and "poisoned batch" in (bad_last.error or "")
    for (out, last), (ref_out, _) in zip(good, refs):
        assert last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and last.error is None
        assert out == ref_out  # the batch was retried session by session: same tokens, exactly
    assert health.ok and "poisoned batch" in health.detail


def test_inbox_and_abort_faults_stay_local(monkeypatch):
    engine = make_engine()
    ps = prompts()
    real_add, real_abort = engine.core.add, engine.core.abort

    def add(req, matcher=None):
        if req.request_id == "refused":
            raise RuntimeError("injected fault in add")
        return real_add(req, matcher)

    def abort(rid):
        real_abort(rid)
        raise RuntimeError("injected fault in abort")

    monkeypatch.setattr(engine.core, "add", add)
    monkeypatch.setattr(engine.core, "abort", abort)

    async def go():
        _, refused = await collect(engine, request(ps[0], rid="refused"))
        gen = engine.generate(request(ps[1], max_tokens=64))
        await gen.__anext__()
        await gen.aclose()  # the client leaves: abort raises on the engine thread
        out, last = await collect(engine, request(ps[2]))
        health = engine.health()
        await engine.shutdown()
        return refused, last, out, health

    refused, last, out, health = asyncio.run(go())
    assert refused.finish_reason is FinishReason.ERROR and "injected fault in add" in (refused.error or "")
    assert last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and 1 <= len(out) <= 8
    assert health.ok


def test_an_unrecoverable_fault_ends_every_open_stream_within_two_seconds(monkeypatch):
    engine = make_engine()
    ps = prompts()

    async def go():
        streams = [engine.generate(request(p, max_tokens=400, ignore_eos=True)) for p in ps]
        for g in streams:
            await g.__anext__()
        monkeypatch.setattr(engine.core, "has_work", lambda: (_ for _ in ()).throw(RuntimeError("loop broke")))
        t0 = time.monotonic()
        lasts = []
        for g in streams:
            last = None
            async for d in g:
                last = d
            lasts.append(last)
        elapsed = time.monotonic() - t0
        with pytest.raises(Unavailable):
            await collect(engine, request(ps[0]))
        health = engine.health()
        await engine.shutdown()
        return lasts, elapsed, health

    lasts, elapsed, health = asyncio.run(go())
    assert elapsed < 2.0
    assert all(d.finish_reason is FinishReason.ERROR and "loop broke" in (d.error or "") for d in lasts)
    assert not health.ok and "loop broke" in health.detail


def test_usage_on_abort_is_what_was_computed():
    engine = make_engine(max_num_seqs=1)
    finals: dict[str, Delta] = {}
    emit = engine.core.emit

    def record(rid: str, d: Delta) -> None:
        if d.finish_reason is not None:
            finals[rid] = d
        emit(rid, d)

    engine.core.emit = record
    ps = prompts()
    long_prompt = ps[0] * 20  # about ten prefill chunks of 64 tokens

    async def go():
        first = engine.generate(request(ps[1], max_tokens=400, rid="decoding", ignore_eos=True))
        await first.__anext__()  # admitted, decoding
        queued = engine.generate(request(ps[2], rid="queued"))
        task = asyncio.ensure_future(queued.__anext__())
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await queued.aclose()  # aborted while waiting for admission
        await first.aclose()  # aborted mid-decode
        mid = engine.generate(request(long_prompt, max_tokens=4, rid="prefilling"))
        await mid.__anext__()  # the admission delta: prefill has started
        await asyncio.sleep(0.1)
        await mid.aclose()  # aborted mid-prefill
        _, done = await collect(engine, request(ps[0], rid="done"))
        abandoned = {rid: await engine.abandoned_usage(rid) for rid in ("queued", "decoding", "prefilling")}
        again = await engine.abandoned_usage("queued")
        metrics = engine.metrics()
        await engine.shutdown()
        return done, abandoned, again, metrics

    done, abandoned, again, metrics = asyncio.run(go())
    assert finals["queued"].usage == Usage(0, 0, 0)  # bills nothing
    dec = finals["decoding"].usage
    assert dec is not None and dec.prompt_tokens == len(ps[1]) and dec.completion_tokens >= 1
    pre = finals["prefilling"].usage
    assert pre is not None and 0 < pre.prompt_tokens < len(long_prompt) and pre.completion_tokens == 0
    assert pre.cached_tokens <= pre.prompt_tokens
    assert done.usage is not None and done.usage.prompt_tokens == len(ps[0])
    assert all(finals[r].finish_reason is FinishReason.ABORT for r in ("queued", "decoding", "prefilling"))
    for rid in ("queued", "decoding", "prefilling"):  # what the server records for a client that left
        assert abandoned[rid] == finals[rid].usage
    assert again is None  # handed over once
    # /metrics' prompt tokens are what usage billed (the mid-prefill abort's tokens reached, not its
    # prompt's length), cached + computed; the names carry no doubled engine_ (docs/cache.md)
    billed = sum(d.usage.prompt_tokens for d in finals.values() if d.usage is not None)
    assert metrics["prompt_tokens"] == billed == metrics["cached_tokens"] + metrics["computed_prompt_tokens"]
    assert metrics["requests"] == 4 and not any(k.startswith("engine_") for k in metrics)


def test_admission_waits_for_the_session_budget_and_refuses_what_never_fits():
    _, runner = load_embedded("int4")
    per_token = runner.kv_bytes_per_token()
    ps = prompts()
    one = (len(ps[0]) + 8) * per_token
    engine = make_engine(max_session_bytes=one + one // 2)  # room for one such session at a time
    seen: list[int] = []

    async def watch():
        while True:
            seen.append(engine.core.num_running())
            await asyncio.sleep(0.005)

    async def go():
        w = asyncio.ensure_future(watch())
        results = await asyncio.gather(*(collect(engine, request(p)) for p in ps))
        w.cancel()
        with pytest.raises(InvalidRequest, match="session budget"):
            await collect(engine, request(ps[0], max_tokens=1000))
        await engine.shutdown()
        return results

    results = asyncio.run(go())
    assert all(last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for _, last in results)
    assert max(seen) == 1


def test_a_full_queue_answers_overloaded():
    engine = make_engine(max_num_seqs=1, max_queued_requests=1)
    ps = prompts()

    async def go():
        running = engine.generate(request(ps[0], max_tokens=400, ignore_eos=True))  # still running below
        await running.__anext__()
        waiting = asyncio.ensure_future(collect(engine, request(ps[1], max_tokens=2)))
        await asyncio.sleep(0.3)
        with pytest.raises(Overloaded):
            await collect(engine, request(ps[2]))
        await running.aclose()
        _, last = await waiting
        await engine.shutdown()
        return last

    assert asyncio.run(go()).finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_pooled_kv_buffers_share_the_session_budget():
    """Finished sessions' buffers kept for reuse (runner/state.py KVPool) count against
    --max-session-bytes with the admitted sessions' reservations: admitting a session trims the pool
    to what the budget leaves, so the documented memory bound holds with the pool full."""
    model, runner = load_embedded("int4")
    per_token = runner.kv_bytes_per_token()
    p = prompts()[0]
    need = (len(p) + 8) * per_token  # what request(p) reserves (prompt + max_tokens)
    budget = need + 3 * 32 * per_token
    core = EngineCore(runner, model.tokenizer, PrefixCache(CacheConfig(max_bytes=1 << 30)),
                      EngineConfig(prefill_chunk_tokens=64, max_batch_tokens=256, max_session_bytes=budget),
                      2048, lambda r, d: None)
    pool = runner.kv_pool
    pool.trim(0)
    for _ in range(4):  # 4 x 32 tokens pooled: more than the budget leaves beside the session
        pool.give(torch.empty(*runner.state_shape[:3], 32, runner.state_shape[3], dtype=runner.decoder.dtype))
    assert pool.bytes == 4 * 32 * per_token
    core.add(request(p))
    core.step()
    assert core.scheduler.reserved_bytes == need and 0 < pool.bytes <= budget - need
    while core.has_work():
        core.step()
    pool.trim(0)


def test_end_all_ends_running_and_queued_requests_billing_what_was_computed():
    """The bounded shutdown's cut (server/shutdown.py): every request held ends at once with ABORT, the
    error for its client and its usage so far; a request after it is refused; the engine still drains."""
    engine = make_engine(max_num_seqs=1)
    ps = prompts()

    async def go():
        running = engine.generate(request(ps[0], max_tokens=400, rid="running", ignore_eos=True))
        out: list[int] = []
        while len(out) < 3:  # decoding
            out += (await running.__anext__()).token_ids
        queued = asyncio.ensure_future(collect(engine, request(ps[1], rid="queued")))
        await asyncio.sleep(0.3)  # waiting for the one session slot
        engine.end_all("the server is shutting down")
        last = None
        async for d in running:
            out += d.token_ids
            last = d
        queued_out, queued_last = await queued
        with pytest.raises(Unavailable):
            await collect(engine, request(ps[2]))
        health = engine.health()
        await engine.shutdown()  # drains: nothing left
        return out, last, queued_out, queued_last, health

    out, last, queued_out, queued_last, health = asyncio.run(go())
    for d in (last, queued_last):
        assert d is not None and d.finish_reason is FinishReason.ABORT and d.error == "the server is shutting down"
    assert last.usage == Usage(prompt_tokens=len(ps[0]), completion_tokens=len(out), cached_tokens=last.usage.cached_tokens)
    assert 3 <= len(out) < 400
    assert queued_out == [] and queued_last.usage == Usage(0, 0, 0)  # bills nothing
    assert health.ok and health.num_running == health.num_waiting == 0
