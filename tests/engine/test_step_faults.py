"""The engine step as a transaction (engine/step_record.py), on the real engine: a fault injected once
in each phase of a step (admission's lookup, a hit's copy, a deferred restore, the forward, sampling,
the grammar matcher, an n > 1 fork, a RAM insert, a tier's write, a turn refill) either is undone and
retried (every request's tokens as a fault-free run's) or ends only the request it belongs to, with
the error and its usage so far. Three tenants' requests start in the same step; the other two always
produce exactly the fault-free run's tokens, the engine serves the next request, leaks no session
reservation or pin, and its thread idles (no spinning) afterwards."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from prefixserve.cache import PrefixCache
from prefixserve.cache.entry import FlushResult
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine import AsyncEngine, EngineCore, outputs
from prefixserve.engine.grammar import TokenMatcher
from prefixserve.runner.state import KVSnapshot
from prefixserve.types import Constraint, Delta, FinishReason, Namespace, Request, SamplingParams, Usage
from tests.conftest import load_embedded
from tests.helpers.engine_run import collect_to_last as collect

pytestmark = pytest.mark.slow
MAX_TOKENS = 10


class InjectedFault(Exception):
    pass


def make_engine(offer_turns: bool = False) -> AsyncEngine:
    model, runner = load_embedded("int4")
    cfg = EngineConfig(prefill_chunk_tokens=64, max_batch_tokens=256, offer_finished_turns=offer_turns)
    core = EngineCore(runner, model.tokenizer, PrefixCache(CacheConfig(max_bytes=1 << 30)), cfg, 2048,
                      lambda r, d: None)
    return AsyncEngine(core, "smol", model.tokenizer, "test", model.arch.vocab_size)


def request(ids: list[int], tenant: str, n: int = 1, constraint: Constraint | None = None) -> Request:
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=constraint is None, constraint=constraint)
    return Request(uuid.uuid4().hex, Namespace("smol", tenant), tuple(ids), sp, num_choices=n, text_history=False)




def prompts() -> list[list[int]]:
    tok = load_embedded("int4")[0].tokenizer
    return [tok.render_chat([{"role": "user", "content": f"Question {i}: name a colour, a fruit and a city."}])
            for i in range(4)]


@pytest.fixture(scope="module")
def reference() -> Any:
    """The tokens a fault-free engine generates for a prompt (a namespace of its own each time)."""
    engine = make_engine()
    memo: dict[tuple[int, ...], list[int]] = {}

    def ref(ids: list[int]) -> list[int]:
        if tuple(ids) not in memo:
            out, last = asyncio.run(collect(engine, request(ids, uuid.uuid4().hex)))
            assert last.finish_reason is FinishReason.LENGTH
            memo[tuple(ids)] = out
        return memo[tuple(ids)]

    yield ref
    asyncio.run(engine.shutdown())


def once(real: Callable[..., Any], when: Callable[..., bool], fired: list[str]) -> Callable[..., Any]:
    """`real`, raising InjectedFault the first time `when(*args)` holds (recorded in `fired`)."""

    def call(*args: Any, **kw: Any) -> Any:
        if not fired and when(*args, **kw):
            fired.append("fired")
            raise InjectedFault("injected fault")
        return real(*args, **kw)

    return call


class FakeTier:
    """A write-through tier that takes every write (the Redis tier's surface the engine uses)."""

    def __init__(self) -> None:
        self.written: list[tuple[Namespace, tuple[int, ...]]] = []

    def offer(self, ns: Namespace, token_ids: tuple[int, ...], state: Any) -> bool:
        self.written.append((ns, token_ids))
        return True

    def flush(self, scope: Any) -> FlushResult:
        return FlushResult()

    def stats(self) -> dict[str, float]:
        return {}

    def close(self, timeout: float) -> None:
        pass


def thread_cpu_seconds(engine: AsyncEngine) -> float:
    """CPU time the engine thread has used so far."""
    ident = engine._thread._thread.ident
    assert ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def run_scenario(engine: AsyncEngine, warmup: list[Request], reqs: list[Request], after: Request
                 ) -> tuple[list[tuple[list[int], Delta]], tuple[list[int], Delta], float]:
    """The warm-up requests one by one, then `reqs` all started in one step (the engine held off while
    they arrive, as a long step holds it), then `after`; and the engine thread's share of CPU over
    one second of idling afterwards."""

    async def go() -> tuple[list[tuple[list[int], Delta]], tuple[list[int], Delta], float]:
        for w in warmup:
            await collect(engine, w)
        engine._core_lock.acquire()
        try:
            tasks = [asyncio.ensure_future(collect(engine, r)) for r in reqs]
            await asyncio.sleep(0.2)
        finally:
            engine._core_lock.release()
        results = await asyncio.gather(*tasks)
        nxt = await collect(engine, after)
        await asyncio.sleep(0.3)
        cpu0, t0 = thread_cpu_seconds(engine), time.monotonic()
        await asyncio.sleep(1.0)
        share = (thread_cpu_seconds(engine) - cpu0) / (time.monotonic() - t0)
        return results, nxt, share

    return asyncio.run(go())


SCENARIOS = ["lookup", "copy", "deferred_restore", "forward", "sampling", "grammar", "fork", "insert",
             "tier_write", "refill"]


@pytest.mark.parametrize("phase", SCENARIOS)
def test_a_fault_in_any_phase_of_a_step_stays_with_its_request(phase: str, monkeypatch: Any, reference: Any) -> None:
    ps = prompts()
    engine = make_engine(offer_turns=phase == "refill")
    core = engine.core
    fired: list[str] = []
    a = request(ps[0], "a")
    warmup: list[Request] = []
    retried = phase in ("forward", "refill")  # undone and retried: the faulted request's tokens too are exact
    if phase == "lookup":
        monkeypatch.setattr(core.cache, "lookup", once(core.cache.lookup, lambda ns, ids: ns.tenant_id == "a", fired))
    elif phase in ("copy", "deferred_restore"):  # a partial hit's copy at admission; a full hit's, deferred
        warmup = [request(ps[0][:-4] if phase == "copy" else ps[0], "a")]
        monkeypatch.setattr(KVSnapshot, "restore", once(KVSnapshot.restore, lambda *args, **kw: True, fired))
    elif phase == "forward":  # the first batch of several sessions
        monkeypatch.setattr(core.runner, "step", once(core.runner.step, lambda items: len(items) > 1, fired))
    elif phase == "sampling":
        monkeypatch.setattr(outputs, "sample", once(outputs.sample, lambda logits, sp, gen: sp is a.sampling, fired))
    elif phase == "grammar":
        a = request(ps[0], "a", constraint=Constraint("json_object"))
        monkeypatch.setattr(TokenMatcher, "consume", once(TokenMatcher.consume, lambda *args: True, fired))
    elif phase == "fork":
        a = request(ps[0], "a", n=2)
        monkeypatch.setattr(outputs, "fork_choices", once(outputs.fork_choices, lambda *args: True, fired))
    elif phase == "insert":
        monkeypatch.setattr(core.cache, "insert", once(core.cache.insert, lambda ns, ids, st: ns.tenant_id == "a", fired))
    elif phase == "tier_write":
        tier = FakeTier()
        tier.offer = once(tier.offer, lambda ns, ids, st: ns.tenant_id == "a", fired)  # type: ignore[method-assign]
        core.writer.shared = tier  # type: ignore[assignment]
    elif phase == "refill":  # the previous turn's refill, finished at the next turn's admission
        first = request(ps[3], "a")
        turn = [*ps[3], *reference(ps[3])]
        a = request([*turn, *ps[0][-6:]], "a")
        warmup = [first]
        monkeypatch.setattr(core, "background", lambda eager=False: False)  # the refill waits for the next turn
        monkeypatch.setattr(core.refills, "run_layer", once(core.refills.run_layer, lambda: True, fired))
    b, c = request(ps[1], "b"), request(ps[2], "c")
    after = request(ps[1], "d")

    results, (next_out, next_last), share = run_scenario(engine, warmup, [a, b, c], after)
    (a_out, a_last), *others = results
    health = engine.health()
    leaked = (core.scheduler.reserved_bytes, core.num_running(), core.num_waiting(), core.has_work(),
              sum(e.num_pins for e in core.cache.entries()))
    asyncio.run(engine.shutdown())

    assert fired, f"the {phase} fault never fired"
    for (out, last), req in zip(others, (b, c)):  # other tenants: exactly the fault-free tokens
        assert last.finish_reason is FinishReason.LENGTH and last.error is None
        assert out == reference(list(req.prompt_ids))
    if retried:
        assert a_last.finish_reason is FinishReason.LENGTH and a_last.error is None
        assert a_out == reference(list(a.prompt_ids))
    else:  # ends with the error (an OpenAI 500) and the usage so far: what went out, nothing more
        assert a_last.finish_reason is FinishReason.ERROR and "InjectedFault: injected fault" in (a_last.error or "")
        assert a_last.usage is not None
        sent = len(a_out)
        if phase in ("lookup", "copy"):  # never admitted: nothing served
            assert a_last.usage == Usage(0, 0, 0) and sent == 0
        else:
            assert a_last.usage.prompt_tokens == len(a.prompt_ids)
            assert a_last.usage.completion_tokens == sent == (1 if phase in ("deferred_restore", "insert", "tier_write") else 0)
    assert next_last.finish_reason is FinishReason.LENGTH and next_out == reference(list(after.prompt_ids))
    assert leaked == (0, 0, 0, False, 0)
    assert health.ok
    assert share < 0.05, f"the engine thread used {share:.0%} of a core while idle"
