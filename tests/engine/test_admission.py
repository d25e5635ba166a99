"""What counts as queued for --max-queued-requests (engine/admission.py), and the session budget in
tokens: a request's prompt alone beyond it, and a budget too small to start with."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import Any

import pytest

from prefixserve.cache import PrefixCache
from prefixserve.config import MIN_SESSION_TOKENS, CacheConfig, ConfigError, EngineConfig
from prefixserve.engine import AsyncEngine, EngineCore
from prefixserve.engine.admission import AdmissionQueue, Counts, Room, Waiting, num_queued
from prefixserve.engine.session import kv_bytes_needed
from prefixserve.types import (
    Delta,
    FinishReason,
    InvalidRequest,
    Namespace,
    Overloaded,
    Request,
    SamplingParams,
)
from tests.conftest import load_embedded

NS = Namespace("smol", "t")


# ---- the count, without a model ---------------------------------------------------------------


def ws(*needs: int, slots: tuple[int, ...] = ()) -> list[Waiting]:
    """Waiting requests of these KV bytes (and slots, 1 each past those given)."""
    return [Waiting(f"w{next(IDS)}", need, slots[k] if k < len(slots) else 1) for k, need in enumerate(needs)]


def request_of(tenant_id: str = "", request_id: str = "") -> Waiting:
    """A 10-byte request of `tenant_id`."""
    return Waiting(request_id or f"w{next(IDS)}", 10, 1, tenant_id)


IDS = itertools.count()


def test_requests_that_free_slots_take_at_the_next_step_are_not_queued() -> None:
    """The QA case: one session running, 63 slots free, 6 requests arriving during its step."""
    assert num_queued(Room(num_running=1, num_free_slots=63, num_free_bytes=1 << 30), ws(*[100] * 6)) == 0
    assert num_queued(Room(num_running=1, num_free_slots=2, num_free_bytes=1 << 30), ws(*[100] * 6)) == 4
    assert num_queued(Room(num_running=64, num_free_slots=0, num_free_bytes=1 << 30), ws(100)) == 1


def test_what_the_session_bytes_cannot_hold_is_queued_and_holds_up_the_rest() -> None:
    """Admission goes in order and stops at the first request whose bytes do not fit (Scheduler.admit):
    a small one behind it waits too. The core's own queue comes before the inbox."""
    room = Room(num_running=1, num_free_slots=63, num_free_bytes=100, waiting=tuple(ws(60)))
    assert num_queued(room, ws(30, 20, 5)) == 2  # 60 and 30 fit; 20 does not, and 5 waits behind it
    # with nothing running the first request starts whatever its size; the next waits for it
    assert num_queued(Room(num_running=0, num_free_slots=64, num_free_bytes=10), ws(100, 1)) == 1


def test_a_request_with_n_choices_takes_n_slots() -> None:
    """n > 1 forks n - 1 sessions after the prompt: admission counts them before (QA: one n=16 request
    ran 16 sessions past --max-num-seqs 4 and held another tenant's request 12 s)."""
    room = Room(num_running=1, num_free_slots=3, num_free_bytes=1 << 30)
    assert num_queued(room, ws(100, 100, slots=(3, 1))) == 1  # n=3 takes the 3 free slots; the next waits
    assert num_queued(room, ws(100, 100, slots=(4, 1))) == 2  # n=4 does not fit beside what runs, and holds the rest
    idle = Room(num_running=0, num_free_slots=4, num_free_bytes=1 << 30)
    assert num_queued(idle, ws(100, 100, slots=(16, 1))) == 1  # any n while nothing runs; then nothing fits
    assert num_queued(Room(num_running=1, num_free_slots=2, num_free_bytes=1 << 30,
                           waiting=tuple(ws(5, slots=(2,)))), ws(1)) == 1  # the core's queue counts its slots too


def test_the_bound_counts_only_the_queued_and_a_refusal_counts_nothing() -> None:
    q = AdmissionQueue(Room(num_running=1, num_free_slots=1, num_free_bytes=1 << 30))
    for _ in range(3):  # one takes the free slot, two are queued: the limit
        q.submit(request_of(), limit=2)
    with pytest.raises(Overloaded) as refused:
        q.submit(request_of(), limit=2)
    assert refused.value.retry_after_s == 2
    assert q.counts() == Counts(num_waiting=3, num_queued=2) and q.peak == 4
    q.publish(Room(num_running=3, num_free_slots=61, num_free_bytes=1 << 30))  # a step admitted and forked
    assert q.counts() == Counts(num_waiting=3, num_queued=0)


def test_past_the_bound_only_a_tenant_holding_its_share_is_refused() -> None:
    """One tenant's flood gets the 429s: another tenant, waiting for less than its share of the bound
    (the bound divided among the tenants waiting), still queues past it."""
    q = AdmissionQueue(Room(num_running=1, num_free_slots=0, num_free_bytes=1 << 30))
    q.submit(request_of("a"), limit=2)
    q.submit(request_of("a"), limit=2)
    with pytest.raises(Overloaded):
        q.submit(request_of("a"), limit=2)  # a holds the whole bound
    q.submit(request_of("b"), limit=2)  # b holds nothing: queued past the bound
    for tenant in ("b", "a"):  # two tenants waiting: a share is 1, and each holds it
        with pytest.raises(Overloaded, match="share"):
            q.submit(request_of(tenant), limit=2)
    q.submit(request_of("c"), limit=2)
    assert q.counts() == Counts(num_waiting=4, num_queued=4)
    with pytest.raises(Overloaded):  # twice the bound: nobody queues more (QA: 12 keys made it 7x)
        q.submit(request_of("d"), limit=2)


def test_a_request_whose_client_left_counts_no_more_while_it_waits() -> None:
    """QA: a client timed out while its request waited behind a long prefill step, and its retry got a
    429 for the share the abandoned request still held, until the step ended."""
    full = Room(num_running=1, num_free_slots=0, num_free_bytes=1 << 30)
    q = AdmissionQueue(full)
    q.submit(request_of("bob", "b1"), limit=1)  # in the inbox
    with pytest.raises(Overloaded):
        q.submit(request_of("bob", "b2"), limit=1)
    q.forget("b1")  # its client left; the engine has not taken it yet
    assert q.counts() == Counts(num_waiting=0, num_queued=0)
    q.submit(request_of("bob", "b2"), limit=1)  # the retry queues
    # the same for one the engine took into its queue already (until it publishes a room without it)
    q = AdmissionQueue(Room(num_running=1, num_free_slots=0, num_free_bytes=1 << 30, waiting=(request_of("bob", "b1"),)))
    q.forget("b1")
    assert q.counts() == Counts(num_waiting=0, num_queued=0)
    q.submit(request_of("bob", "b2"), limit=1)
    q.forget("nobody")  # running or finished: nothing changes
    assert q.counts() == Counts(num_waiting=1, num_queued=1)


# ---- the real engine ----------------------------------------------------------------------------


def make_engine(**engine_kw) -> AsyncEngine:
    model, runner = load_embedded("int4")
    cfg = EngineConfig(prefill_chunk_tokens=64, max_batch_tokens=256, **engine_kw)
    core = EngineCore(runner, model.tokenizer, PrefixCache(CacheConfig(max_bytes=1 << 30)), cfg, 2048,
                      lambda r, d: None)
    return AsyncEngine(core, "smol", model.tokenizer, "test", model.arch.vocab_size)


def request(ids: list[int], max_tokens: int = 4) -> Request:
    return Request(uuid.uuid4().hex, NS, tuple(ids), SamplingParams(max_tokens=max_tokens, temperature=0.0))


def prompt(i: int) -> list[int]:
    model, _ = load_embedded("int4")
    return model.tokenizer.render_chat([{"role": "user", "content": f"Question {i}: name a colour."}])


async def last_delta(engine: AsyncEngine, req: Request) -> Delta:
    last = None
    async for d in engine.generate(req):
        last = d
    assert last is not None
    return last


@pytest.mark.slow
def test_a_burst_during_a_step_is_not_refused_while_session_slots_are_free() -> None:
    """QA: with --max-queued-requests 2 and --max-num-seqs 64, only 2-3 of a burst of 6 requests were
    admitted, those the engine thread had not yet taken from its inbox counting as queued. The engine
    thread is held off here (its lock, as a long prefill step holds it): all 6 wait, none is queued."""
    engine = make_engine(max_queued_requests=2, max_num_seqs=64)

    async def go() -> list[Delta]:
        engine._core_lock.acquire()
        try:
            tasks = [asyncio.ensure_future(last_delta(engine, request(prompt(i)))) for i in range(6)]
            await asyncio.sleep(0.1)  # every task has handed its request over
            h = engine.health()
            assert (h.num_waiting, h.num_queued) == (6, 0) and not any(t.done() for t in tasks)
        finally:
            engine._core_lock.release()
        finals = await asyncio.gather(*tasks)
        await engine.shutdown()
        return finals

    finals = asyncio.run(go())
    assert all(d.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for d in finals)


def test_the_next_to_start_is_the_oldest_of_the_tenant_least_served() -> None:
    """FairShare: one tenant alone is first come, first served; between tenants the one with the
    fewest running goes first, among equals the one that started one least recently."""
    from types import SimpleNamespace

    from prefixserve.engine.admission import FairShare

    def session(tenant: str, k: int) -> Any:  # what FairShare reads of a Session
        return SimpleNamespace(request=Request(f"{tenant}{k}", Namespace("smol", tenant), (1, 2, 3),
                                               SamplingParams(max_tokens=1)), reserved_bytes=0)

    fair = FairShare()
    a = [session("a", k) for k in range(4)]
    b, c = session("b", 0), session("c", 0)
    assert fair.order([], a) == a
    names = lambda xs: [x.request.request_id for x in xs]
    assert names(fair.order([], [*a, b, c])) == ["a0", "b0", "c0", "a1", "a2", "a3"]
    assert names(fair.order(a[:2], [*a[2:], b])) == ["b0", "a2", "a3"]  # a runs two: b first
    fair.started(a[0])
    assert names(fair.order([], [*a[1:], b])) == ["b0", "a1", "a2", "a3"]  # equals: a started last
    fair.started(b)
    assert names(fair.order([], [*a[1:], c])) == ["c0", "a1", "a2", "a3"]  # c never started
    back = session("a", 9)
    back.reserved_bytes = 1  # back from a lower tier's load: it holds its reservation, and goes first
    assert names(fair.order([], [b, c, back])) == ["a9", "c0", "b0"]


@pytest.mark.slow
def test_a_tenants_burst_does_not_hold_another_tenants_request_behind_it() -> None:
    """One session slot, tenant a's four requests queued before tenant b's one: b's starts second,
    not fifth (it waited behind all of a's before)."""
    engine = make_engine(max_num_seqs=1)
    started: list[str] = []

    async def run(req: Request) -> None:
        async for d in engine.generate(req):
            if d.token_ids and req.request_id not in started:
                started.append(req.request_id)

    reqs = [Request(f"a{k}", Namespace("smol", "a"), tuple(prompt(k)),
                    SamplingParams(max_tokens=3, temperature=0.0)) for k in range(4)]
    reqs.append(Request("b0", Namespace("smol", "b"), tuple(prompt(9)), SamplingParams(max_tokens=3, temperature=0.0)))
    queued_together(engine, run, reqs)
    assert started == ["a0", "b0", "a1", "a2", "a3"]


def queued_together(engine: AsyncEngine, run: Any, reqs: list[Request]) -> None:
    """`run(request)` for each of `reqs`, all in the engine's queue before it takes any (its lock held,
    as a long step holds it); then the engine shuts down."""
    async def go() -> None:
        engine._core_lock.acquire()
        try:
            tasks = [asyncio.ensure_future(run(r)) for r in reqs]
            await asyncio.sleep(0.1)
        finally:
            engine._core_lock.release()
        await asyncio.gather(*tasks)
        await engine.shutdown()

    asyncio.run(go())


@pytest.mark.slow
def test_n_choices_take_n_slots_and_their_kv_is_reserved_before_they_fork() -> None:
    """Three slots: a request with n=3 takes them all and another tenant's request waits for them to
    free, instead of running beside its three forks; every reservation is returned. More choices than
    slots could never run: a 400 naming n."""
    engine = make_engine(max_num_seqs=3)
    finished: dict[str, float] = {}
    first: dict[str, float] = {}
    most = 0

    async def run(req: Request) -> None:
        nonlocal most
        async for d in engine.generate(req):
            most = max(most, engine.health().num_running)
            if d.token_ids:
                first.setdefault(req.request_id, time.monotonic())
            finished[req.request_id] = time.monotonic()

    big = Request("a", Namespace("smol", "a"), tuple(prompt(1)),
                  SamplingParams(max_tokens=8, temperature=1.0, seed=1, ignore_eos=True), num_choices=3)
    small = Request("b", Namespace("smol", "b"), tuple(prompt(2)), SamplingParams(max_tokens=2, temperature=0.0))
    queued_together(engine, run, [big, small])
    assert first["b"] > finished["a"] and most <= 3
    assert engine.core.scheduler.reserved_bytes == 0
    too_many = Request("c", NS, tuple(prompt(3)), SamplingParams(max_tokens=2), num_choices=4)
    with pytest.raises(InvalidRequest, match="3 at once") as refused:
        engine.validate(too_many)
    assert refused.value.param == "n"
    one = Request("x", NS, (1, 2, 3), SamplingParams(max_tokens=5))
    three = Request("x", NS, (1, 2, 3), SamplingParams(max_tokens=5), num_choices=3)
    assert kv_bytes_needed(three, 2048, 10) == 3 * kv_bytes_needed(one, 2048, 10) == 240


@pytest.mark.slow
def test_a_request_the_session_bytes_cannot_start_is_queued() -> None:
    """Free slots are not enough: with room for one session's bytes, the second request waits (queued,
    1 of --max-queued-requests 1) and a third is refused; both accepted ones then complete."""
    _, runner = load_embedded("int4")
    per_token = runner.kv_bytes_per_token()
    ps = [prompt(i) for i in range(3)]
    one = max(len(p) for p in ps) + 4
    engine = make_engine(max_queued_requests=1, max_num_seqs=64,
                         max_session_bytes=max(one * 3 // 2, MIN_SESSION_TOKENS) * per_token)
    assert engine.max_session_tokens < 2 * one  # one session at a time

    async def go() -> list[Delta]:
        engine._core_lock.acquire()
        try:
            tasks = [asyncio.ensure_future(last_delta(engine, request(p))) for p in ps[:2]]
            await asyncio.sleep(0.1)
            h = engine.health()
            assert (h.num_waiting, h.num_queued) == (2, 1)
            metrics = engine.metrics()
            assert (metrics["waiting"], metrics["queued"]) == (2, 1)
            with pytest.raises(Overloaded, match="queued"):
                await last_delta(engine, request(ps[2]))
        finally:
            engine._core_lock.release()
        finals = await asyncio.gather(*tasks)
        h = engine.health()
        assert (h.num_running, h.num_waiting, h.num_queued) == (0, 0, 0)
        await engine.shutdown()
        return finals

    finals = asyncio.run(go())
    assert all(d.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for d in finals)
    assert engine.core.scheduler.reserved_bytes == 0


@pytest.mark.slow
def test_the_session_budget_in_tokens_and_what_it_refuses() -> None:
    """max_session_tokens is what the server fits a default max_tokens into. A prompt that leaves no
    room for one token is refused as the prompt alone; an explicit max_tokens too many, as before."""
    _, runner = load_embedded("int4")
    engine = make_engine(max_session_bytes=100 * runner.kv_bytes_per_token() + 7)
    assert engine.max_session_tokens == 100
    engine.validate(request(list(range(1, 100)), max_tokens=1))  # 99 + 1 fits exactly
    with pytest.raises(InvalidRequest, match="the prompt alone \\(100 tokens\\) exceeds the server's session budget"):
        engine.validate(request(list(range(1, 101)), max_tokens=1))
    with pytest.raises(InvalidRequest, match="lower max_tokens or shorten the prompt"):
        engine.validate(request(list(range(1, 51)), max_tokens=51))
    asyncio.run(engine.shutdown())


@pytest.mark.slow
def test_a_budget_below_a_small_request_is_refused_when_the_engine_is_built() -> None:
    """`--max-session-bytes 1` started, said ok on /health, and answered every request 400."""
    model, runner = load_embedded("int4")
    per_token = runner.kv_bytes_per_token()

    def core(budget: int) -> EngineCore:
        return EngineCore(runner, model.tokenizer, PrefixCache(CacheConfig(max_bytes=0)),
                          EngineConfig(max_session_bytes=budget), 2048, lambda r, d: None)

    with pytest.raises(ConfigError, match="^--max-session-bytes 1 holds 0 tokens of this model's KV"):
        core(1)
    with pytest.raises(ConfigError, match=f"holds {MIN_SESSION_TOKENS - 1} tokens"):
        core(MIN_SESSION_TOKENS * per_token - 1)
    assert core(MIN_SESSION_TOKENS * per_token).max_session_tokens == MIN_SESSION_TOKENS


@pytest.mark.slow
def test_pending_turn_refills_share_the_session_budget_and_give_way() -> None:
    """A finished turn's KV waits for its refill (engine/refill.py) outside any session: it counts in
    --max-session-bytes beside the running sessions' reservations, and a request that needs the room
    drops the oldest pending refills (optional work: the next turn computes what it would have
    served) rather than wait. QA: eight pending refills of long prompts held ~400 MiB past the
    memory bound of docs/operations.md (RSS 2,037 MiB against 1,622)."""
    model, runner = load_embedded("int4")
    per_token = runner.kv_bytes_per_token()
    ask = [model.tokenizer.render_chat([{"role": "user", "content": f"Tell me about colour number {i}. " * 20}])
           for i in range(3)]
    budget = (len(ask[0]) + 8) * per_token * 2 + 64 * per_token  # two of these sessions, not three
    core = EngineCore(runner, model.tokenizer, PrefixCache(CacheConfig(max_bytes=1 << 30)),
                      EngineConfig(prefill_chunk_tokens=64, max_batch_tokens=256, max_session_bytes=budget), 2048,
                      lambda r, d: None)

    def run(ids: list[int]) -> None:
        core.add(request(ids, max_tokens=8))
        while core.has_work():
            core.step()  # never `background`: the refills stay pending
            assert core.scheduler.reserved_bytes + core.refills.nbytes() <= budget

    def pending() -> list[int]:
        return [i for i, ids in enumerate(ask) for r in core.refills if r.token_ids[: len(ids)] == tuple(ids)]

    run(ask[0])
    run(ask[1])
    assert pending() == [0, 1] and core.scheduler.reserved_bytes == 0  # room for both
    run(ask[2])  # its reservation and both refills do not fit: the oldest went before its KV was allocated
    assert pending() == [1, 2]
