"""Nothing slow under the admission lock or on the engine thread, on the real engine: a slow Redis
flush runs beside the engine while another tenant's tokens stream; the first constrained request's
grammar compiler is built off the engine thread and `health()` never waits for it or for queueing a
request; a request's grammar compiles beside the steps, which go on a token a step; a request arriving as the engine dies ends at once instead of hanging."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import pytest

from prefixserve.cache import PrefixCache
from prefixserve.cache.entry import FlushResult
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine import AsyncEngine, EngineCore
from prefixserve.engine.grammar import GrammarCompiler
from prefixserve.types import (
    Constraint,
    FinishReason,
    FlushScope,
    InvalidRequest,
    Namespace,
    Request,
    SamplingParams,
    Unavailable,
)
from tests.conftest import load_embedded

pytestmark = pytest.mark.slow
FLUSH_S = 2.0


def make_engine() -> AsyncEngine:
    model, runner = load_embedded("int4")
    cfg = EngineConfig(prefill_chunk_tokens=64, max_batch_tokens=256, offer_finished_turns=False)
    core = EngineCore(runner, model.tokenizer, PrefixCache(CacheConfig(max_bytes=1 << 30)), cfg, 2048,
                      lambda r, d: None)
    return AsyncEngine(core, "smol", model.tokenizer, "test", model.arch.vocab_size)


def request(tenant: str, max_tokens: int = 300, constraint: Constraint | None = None) -> Request:
    tok = load_embedded("int4")[0].tokenizer
    ids = tok.render_chat([{"role": "user", "content": f"Tenant {tenant}: tell me a long story."}])
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=constraint is None, constraint=constraint)
    return Request(uuid.uuid4().hex, Namespace("smol", tenant), tuple(ids), sp)


class SlowRedis:
    """The shared tier as the engine sees it, whose flush takes FLUSH_S (a SCAN of a large keyspace)."""

    def __init__(self, complete: bool) -> None:
        self.complete = complete
        self.flush_thread: str | None = None

    def offer(self, ns: Namespace, token_ids: tuple[int, ...], state: Any) -> bool:
        return True

    def flush(self, scope: FlushScope) -> FlushResult:
        self.flush_thread = threading.current_thread().name
        time.sleep(FLUSH_S)
        return FlushResult(3, 300, self.complete)

    def stats(self) -> dict[str, float]:
        return {}

    def close(self, timeout: float) -> None:
        pass


@pytest.mark.parametrize("complete", [True, False])
def test_a_slow_redis_flush_runs_beside_the_engine(complete: bool) -> None:
    engine = make_engine()
    redis = SlowRedis(complete)
    engine.core.writer.shared = redis  # type: ignore[assignment]
    scope = FlushScope(tenant_id="a")

    async def go() -> tuple[Any, int, list[FlushScope], list[FlushScope]]:
        # long enough to outlast the flush at any decode speed (~1,800 tokens: 4-7 s at 250-450 tok/s)
        stream = engine.generate(request("b", max_tokens=1800))
        await stream.__anext__()  # decoding
        flush = asyncio.ensure_future(engine.flush_cache(scope))
        for _ in range(int(FLUSH_S * 50)):  # the engine thread takes the flush at its next turn
            await asyncio.sleep(0.01)
            if engine.core.loads._flushing or flush.done():
                break
        during = list(engine.core.loads._flushing)  # no session reads the scope from Redis meanwhile
        tokens = 0
        while not flush.done():
            tokens += len((await stream.__anext__()).token_ids)
        report = await flush
        await stream.aclose()
        for _ in range(100):  # the engine thread lets the scope be read again at its next turn
            if not engine.core.loads._flushing:
                break
            await asyncio.sleep(0.01)
        after = list(engine.core.loads._flushing)
        await engine.shutdown()
        return report, tokens, during, after

    report, tokens, during, after = asyncio.run(go())
    assert tokens >= 5, f"only {tokens} tokens streamed during a {FLUSH_S} s flush"
    assert redis.flush_thread is not None and redis.flush_thread != "prefixserve-engine"
    assert [t.tier for t in report.tiers] == ["ram", "redis"]
    assert (report.tiers[1].num_entries, report.tiers[1].complete) == (3, complete)  # incomplete: the server's 503
    assert during == [scope] and after == []


def test_the_first_constrained_request_and_queueing_never_block_health(monkeypatch: Any) -> None:
    """The grammar compiler (~0.4 s, here made 1 s) is built on a worker thread before the request is
    handed over; a slow `EngineCore.add` runs outside the admission lock. Meanwhile `health()`, the
    counts and another request's submission answer at once."""
    engine = make_engine()
    real_build = GrammarCompiler.for_tokenizer.__func__  # type: ignore[attr-defined]
    built_on: list[str] = []

    def slow_build(cls: type[GrammarCompiler], tokenizer: object, vocab_size: int) -> GrammarCompiler:
        built_on.append(threading.current_thread().name)
        time.sleep(1.0)
        return real_build(cls, tokenizer, vocab_size)

    monkeypatch.setattr(GrammarCompiler, "for_tokenizer", classmethod(slow_build))
    real_add = engine.core.add

    def slow_add(req: Request, matcher: Any = None) -> None:
        if req.namespace.tenant_id == "slow":
            time.sleep(1.0)
        real_add(req, matcher)

    monkeypatch.setattr(engine.core, "add", slow_add)

    async def probe(until: asyncio.Future[Any]) -> float:
        worst = 0.0
        while not until.done():
            t0 = time.monotonic()
            engine.health()
            engine._admission.counts()
            worst = max(worst, time.monotonic() - t0)
            await asyncio.sleep(0.01)
        return worst

    async def last(req: Request) -> Any:
        final = None
        async for d in engine.generate(req):
            final = d
        return final

    async def go() -> tuple[float, float, float, Any, Any]:
        constrained = asyncio.ensure_future(last(request("a", 20, Constraint("json_object"))))
        worst_build = await probe(constrained)
        slow = asyncio.ensure_future(last(request("slow", 2)))
        await asyncio.sleep(0.2)  # the engine thread is in the slow add
        t0 = time.monotonic()
        other = asyncio.ensure_future(last(request("c", 2)))
        await asyncio.sleep(0)  # its submission (counted into the inbox) happens in its first step
        submit_s = time.monotonic() - t0
        worst_add = await probe(slow)
        finals = await asyncio.gather(constrained, other)
        await engine.shutdown()
        return worst_build, worst_add, submit_s, finals, await slow

    worst_build, worst_add, submit_s, finals, slow_final = asyncio.run(go())
    assert built_on and built_on[0] != "prefixserve-engine"
    assert worst_build < 0.2 and worst_add < 0.2 and submit_s < 0.2, (worst_build, worst_add, submit_s)
    assert all(d.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for d in [*finals, slow_final])


def test_the_compiler_is_built_on_a_thread_of_its_own() -> None:
    """`build_grammars_soon` (called once the server serves): the compiler is built off the calling
    thread and is the one the core then uses; a constrained request asking meanwhile gets the same
    build, not a second; a tokenizer that can have no compiler leaves none (the first constrained
    request reports it)."""
    engine = make_engine()
    threads: list[str] = []
    real_init = GrammarCompiler.__init__
    started, release = threading.Event(), threading.Event()

    def init(self: GrammarCompiler, hf: Any, vocab_size: int) -> None:
        threads.append(threading.current_thread().name)
        started.set()
        assert release.wait(60)
        real_init(self, hf, vocab_size)

    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(GrammarCompiler, "__init__", init)
            engine.build_grammars_soon()
            assert started.wait(60)
            asked: list[GrammarCompiler] = []
            waiter = threading.Thread(target=lambda: asked.append(engine.core.grammars()))
            waiter.start()  # waits for the build under way
            release.set()
            waiter.join(60)
        assert threads == ["prefixserve-grammar-build"]
        compiler = engine.core.grammars()
        assert asked == [compiler]
        vocab = engine.vocab_size
        assert compiler.matcher(Constraint("json_object")).allowed().shape == (vocab,)
    finally:
        asyncio.run(engine.shutdown())
    bare = make_engine()
    try:
        bare.core.tokenizer = object()  # type: ignore[assignment]  # not a transformers tokenizer
        bare.build_grammars_soon()
        with pytest.raises(InvalidRequest):  # the build's own refusal, or this call's
            bare.core.grammars()
    finally:
        asyncio.run(bare.shutdown())


def test_a_constrained_requests_grammar_compiles_beside_the_steps(monkeypatch: Any) -> None:
    """The compiler exists (the server builds it once it serves, AsyncEngine.build_grammars_soon: its build
    holds the GIL, so from any thread it would pause the engine); the request's grammar compiles on a
    worker thread. Here the compile is
    held until another tenant's stream has had 5 more tokens: compiled inside the engine's turn, that
    stream would stop. Counted in steps, that stream gets exactly one token in every step from its
    first to its last, before, while and after the constrained request joins the batch."""
    engine = make_engine()
    engine.core.grammars()  # as the server has once it serves
    real_matcher = GrammarCompiler.matcher
    release = threading.Event()
    compiled_on: list[str] = []

    def held_matcher(self: GrammarCompiler, constraint: Constraint) -> Any:
        compiled_on.append(threading.current_thread().name)
        assert release.wait(120), "the other stream stopped while the grammar compiled"
        return real_matcher(self, constraint)

    monkeypatch.setattr(GrammarCompiler, "matcher", held_matcher)
    tokens_in: list[tuple[int, str, int]] = []  # (step, request id, tokens) of each delta the engine emits
    real_emit = engine.core.emit

    def emit(rid: str, delta: Any) -> None:
        tokens_in.append((engine.core.counters.num_steps, rid, len(delta.token_ids)))
        real_emit(rid, delta)

    engine.core.emit = emit
    other, constrained = request("b", 40), request("a", 12, Constraint("json_object"))

    async def last(req: Request) -> Any:
        final = None
        async for d in engine.generate(req):
            final = d
        return final

    async def go() -> tuple[int, Any, Any]:
        stream = engine.generate(other)
        await stream.__anext__()
        joined = asyncio.ensure_future(last(constrained))
        while not compiled_on:
            await asyncio.sleep(0.01)
        during = 0
        for _ in range(5):  # the compile is held meanwhile
            during += len((await asyncio.wait_for(stream.__anext__(), 60)).token_ids)
        release.set()
        final = None
        async for d in stream:
            final = d
        result = await joined
        await engine.shutdown()
        return during, final, result

    during, final, result = asyncio.run(go())
    assert compiled_on and compiled_on[0] != "prefixserve-engine"
    assert during == 5
    assert final.finish_reason is FinishReason.LENGTH and result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    steps = [step for step, rid, n in tokens_in if rid == other.request_id for _ in range(n)]
    assert steps == list(range(steps[0], steps[0] + 40))  # one token a step: no step without one
    batched = {step for step, rid, n in tokens_in if rid == constrained.request_id and n}
    assert batched and batched <= set(steps)  # the constrained request ran in the same steps


@pytest.mark.parametrize("die_first", [True, False])
def test_a_request_arriving_as_the_engine_dies_ends_at_once(die_first: bool, monkeypatch: Any) -> None:
    """The engine dies while a request opens its stream, before or after the stream is registered:
    the request is refused (Unavailable) at once, never left waiting for an engine that is gone."""
    engine = make_engine()
    real_open = engine._streams.open

    def die() -> None:
        monkeypatch.setattr(engine.core, "has_work", lambda: (_ for _ in ()).throw(RuntimeError("loop broke")))
        engine._wake.set()
        deadline = time.monotonic() + 5.0
        while engine._dead is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine._dead is not None

    def open_as_the_engine_dies(rid: str) -> Any:
        if die_first:
            die()
            return real_open(rid)
        q = real_open(rid)
        die()
        return q

    monkeypatch.setattr(engine._streams, "open", open_as_the_engine_dies)

    async def first_delta() -> None:
        gen = engine.generate(request("a", 2))
        with pytest.raises(Unavailable, match="loop broke"):
            await asyncio.wait_for(gen.__anext__(), 2.0)
        await engine.shutdown()

    asyncio.run(first_delta())
    assert engine._streams.ids() == []
