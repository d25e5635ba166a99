"""The engine with the real model: the learning sequence, and cached output == uncached output."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from prefixserve.cache import PrefixCache
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine import AsyncEngine, EngineCore
from prefixserve.types import Namespace, Request, SamplingParams, Usage
from tests.conftest import load_embedded, refeeds
from tests.helpers.engine_run import assert_fresh_prefill, collect, echoed

pytestmark = pytest.mark.slow

SYSTEM = "You are Atlas, the support assistant of Northwind Outfitters. " + " ".join(
    f"Policy {i}: items in department {i} may be returned within {i + 20} days with a receipt; "
    f"store credit is offered after that, and clearance items of department {i} are final sale."
    for i in range(1, 21)
)


def make_engine(max_bytes: int, mode: str = "int4", chunk: int = 128) -> AsyncEngine:
    """mode: see tests/conftest.py; int4 is what the server runs by default on this CPU."""
    model, runner = load_embedded(mode)
    core = EngineCore(runner, model.tokenizer, PrefixCache(CacheConfig(max_bytes=max_bytes)),
                      EngineConfig(prefill_chunk_tokens=chunk, max_batch_tokens=256), 2048, lambda r, d: None)
    return AsyncEngine(core, "smol", model.tokenizer, "test", model.arch.vocab_size)


async def run(engine: AsyncEngine, ids: list[int], ns: Namespace, max_tokens: int = 12,
              text_history: bool = True) -> tuple[list[int], Usage]:
    return await collect(engine, Request(uuid.uuid4().hex, ns, tuple(ids), SamplingParams(
        max_tokens=max_tokens, temperature=0.0), text_history=text_history))


def chat(tok, user: str) -> list[int]:
    return tok.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])


def test_learning_sequence_and_exact_outputs():
    cached = make_engine(1 << 30)
    plain = make_engine(0)
    tok = cached.tokenizer
    users = ["Can I return a jacket after 30 days?", "What about clearance shoes?", "Do you offer store credit?",
             "Can I return a jacket after 30 days?"]
    prompts = [chat(tok, u) for u in users]
    shared = 0
    while prompts[0][shared] == prompts[1][shared]:
        shared += 1
    assert shared >= 500
    ns = Namespace("smol", "tenant-a")

    async def go():
        results = [await run(cached, p, ns) for p in prompts]
        refs = [await run(plain, p, ns) for p in prompts]
        other_tenant = await run(cached, prompts[0], Namespace("smol", "tenant-b"))
        other_salt = await run(cached, prompts[0], Namespace("smol", "tenant-a", "s1"))
        await cached.shutdown()
        await plain.shutdown()
        return results, refs, other_tenant, other_salt

    results, refs, other_tenant, other_salt = asyncio.run(go())
    cached_counts = [u.cached_tokens for _, u in results]
    assert cached_counts[0] == 0  # request 1 seeds
    assert cached_counts[1] == shared  # request 2 primes from the longest common prefix (KV truncates)
    assert cached_counts[2] >= shared  # request 3 onward hit
    assert cached_counts[3] == len(prompts[3])  # identical prompt: full hit, no forward at all
    for (out, u), (ref_out, ref_u) in zip(results, refs):
        assert out == ref_out  # caching never changes an output
        assert ref_u.cached_tokens == 0 and u.prompt_tokens == ref_u.prompt_tokens
    assert other_tenant[1].cached_tokens == 0 and other_tenant[0] == refs[0][0]
    assert other_salt[1].cached_tokens == 0
    assert cached.core.cache.check_integrity() is None


@pytest.mark.parametrize("mode", ["bf16", "int4"])
@pytest.mark.parametrize("think", [True, False])
def test_next_chat_turn_hits_its_own_history(mode, think):
    """Turn 2 hits turn 1's prompt AND whole reply in every mode: dense decode states are exact as
    they are but for the reply's last token (never fed: a one-token refill feeds it); 4-bit decoded
    replies are re-fed by prefill (in the background while the engine idles,
    `think`; or when turn 2 arrives first, at its admission, and then billed to turn 2 as computed)
    and the entry is bitwise a fresh prefill."""
    engine = make_engine(1 << 30, mode)
    plain = make_engine(0, mode)
    tok = engine.tokenizer
    ns = Namespace("smol", "t")
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi! Who are you?"}]

    async def go():
        out, u1 = await run(engine, tok.render_chat(first), ns, max_tokens=24)
        if think:  # a person reads the reply before answering: the refill runs while the engine idles
            for _ in range(200):
                if not engine.core.refills:
                    break
                await asyncio.sleep(0.05)
            assert not engine.core.refills
        reply = tok.decode(out)
        second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Thanks."}]
        ids2 = tok.render_chat(second)
        pending = bool(engine.core.refills)
        out2, u2 = await run(engine, ids2, ns)
        ref2, _ = await run(plain, ids2, ns)
        await engine.shutdown()
        await plain.shutdown()
        return u1, u2, tok.render_chat(first), out, out2 == ref2, pending

    u1, u2, ids1, out, same, pending = asyncio.run(go())
    assert u1.cached_tokens == 0
    # the turn's key: the reply as its text encodes where the model split it otherwise, else as
    # sampled; a refill feeds it in every mode (dense decode never fed the last sampled token)
    back = echoed(engine.tokenizer, ids1, out)
    turn = tuple(ids1) + (back if back is not None and list(back) != out else tuple(out))
    if pending:  # the refill ran at turn 2's admission: cached in the end, but computed for turn 2
        assert not think
        assert len(ids1) <= u2.cached_tokens < len(turn)  # its exact part only: the prompt (4-bit), more (dense)
        assert not refeeds(mode) or u2.cached_tokens == len(ids1)
    else:
        assert u2.cached_tokens >= len(turn)
    assert same  # and the cached second turn answers exactly like an uncached one
    # the turn's entry holds exactly the state a fresh prefill of prompt + reply gives
    hit = engine.core.cache.lookup(ns, turn + (0,))
    assert hit.num_cached_tokens == len(turn)
    _, runner = load_embedded(mode)
    assert_fresh_prefill(runner, hit.entry.state, turn, 128)
    assert engine.core.cache.check_integrity() is None


@pytest.mark.parametrize("mode", ["bf16", "int4"])
def test_a_repeated_turn_is_not_cached_again(mode, monkeypatch):
    """The same request again (greedy: the same reply) finds its turn cached: no refill is queued
    and no second snapshot is taken, so the engine is free for the next request
    at once; another turn still is."""
    engine = make_engine(1 << 30, mode)
    tok = engine.tokenizer
    ns = Namespace("smol", "t")
    offered: list[int] = []
    orig_offer, orig_store = engine.core.refills.offer, engine.core.writer.store
    monkeypatch.setattr(engine.core.refills, "offer", lambda n, ids, *a: (offered.append(len(ids)), orig_offer(n, ids, *a)))
    monkeypatch.setattr(engine.core.writer, "store", lambda n, ids, st: (offered.append(len(ids)), orig_store(n, ids, st)))
    ids = tok.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi! Who are you?"}])

    async def settle():
        for _ in range(200):
            if not engine.core.refills:
                return
            await asyncio.sleep(0.05)

    async def go():
        out1, _ = await run(engine, ids, ns, text_history=False)  # keyed as sampled (the length checked below)
        await settle()
        after_first = list(offered)
        out2, u2 = await run(engine, ids, ns, text_history=False)
        await settle()
        after_repeat = list(offered)
        await run(engine, ids[:-3] + ids[-2:], ns, text_history=False)  # another prompt: its own turn is offered
        await settle()
        await engine.shutdown()
        return out1, out2, u2, after_first, after_repeat, list(offered)

    out1, out2, u2, after_first, after_repeat, after_other = asyncio.run(go())
    assert out1 == out2 and u2.cached_tokens == len(ids)
    turn_len = len(ids) + len(out1)  # the whole reply in every mode
    assert turn_len in after_first  # the first turn was offered (prompt + reply)
    assert after_repeat == after_first  # the repeat offered nothing
    assert len(after_other) > len(after_repeat)
    assert engine.core.cache.check_integrity() is None


def test_concurrent_sessions_share_one_entry_and_stay_exact():
    engine = make_engine(1 << 30)
    plain = make_engine(0)
    tok = engine.tokenizer
    ns = Namespace("smol", "t")
    prompts = [chat(tok, f"Question number {i}: what is policy {i}?") for i in range(6)]

    async def go():
        await run(engine, prompts[0], ns, max_tokens=2)  # seed
        await run(engine, prompts[1], ns, max_tokens=2)  # boundary
        many = await asyncio.gather(*(run(engine, p, ns) for p in prompts))
        refs = await asyncio.gather(*(run(plain, p, ns) for p in prompts))
        await engine.shutdown()
        await plain.shutdown()
        return many, refs

    many, refs = asyncio.run(go())
    for (out, u), (ref_out, _) in zip(many, refs):
        assert u.cached_tokens > 500
        assert out == ref_out


def test_a_turn_refill_stores_its_turn_a_piece_at_a_time():
    """A finished 4-bit turn's refill stores the turn between the engine's steps one piece per call
    (a bitwise compare with the prompt's cached piece, or a copy), not in one call that grows with
    the turn (measured in the server: 48 ms for a 4,000-token turn, 97 ms for 8,000), so a request
    arriving meanwhile waits one piece. The entry goes in with the last piece, and it is the state a
    fresh prefill of the turn gives."""
    from prefixserve.runner.pieces import PIECE_TOKENS, piece_edges

    model, runner = load_embedded("int4")  # the refill queue itself: any mode (offered directly below)
    cache = PrefixCache(CacheConfig(max_bytes=1 << 30))
    core = EngineCore(runner, model.tokenizer, cache, EngineConfig(prefill_chunk_tokens=128, max_batch_tokens=256),
                      2048, lambda r, d: None)
    ns = Namespace("smol", "t")
    ids = model.tokenizer.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi!"}])
    turn = tuple(ids) + tuple(ids[10:22])  # prompt + a 12-token "reply"
    st = runner.new_state(len(turn))
    runner.prefill(st, list(ids), 128)
    core.writer.store(ns, tuple(ids), st)  # the prompt's entry, as after its first token
    num_pieces = len(piece_edges(len(turn), PIECE_TOKENS, cache.entry_lengths(ns, turn)))
    core.refills.offer(ns, turn, st, len(ids))
    store_calls = 0
    while core.refills:
        assert cache.lookup(ns, turn + (0,)).num_cached_tokens == len(ids)  # not in before the last piece
        full = st.num_tokens == len(turn)  # the re-fed reply is in: what is left is the store
        core.refills.run_layer()
        store_calls += full
    assert num_pieces > 5 and store_calls == num_pieces
    hit = cache.lookup(ns, turn + (0,))
    assert hit.num_cached_tokens == len(turn)
    assert_fresh_prefill(runner, hit.entry.state, turn, 128)
    assert cache.check_integrity() is None


def test_a_repeated_turn_pending_its_refill_is_not_queued_again(monkeypatch):
    """The same request again before the first one's refill ran (back to back): its turn is on its
    way to the cache, so it is not queued a second time (each copy re-feeds the reply, or with dense
    decode its last token, and compares every piece with the cache's, background work that a request
    arriving meanwhile waits behind); the turn is cached once the one refill has run."""
    engine = make_engine(1 << 30, "int4")
    tok = engine.tokenizer
    ns = Namespace("smol", "t")
    offered: list[int] = []
    orig_offer = engine.core.refills.offer
    monkeypatch.setattr(engine.core.refills, "offer", lambda n, ids, *a: (offered.append(len(ids)), orig_offer(n, ids, *a)))
    monkeypatch.setattr(engine.core, "background", lambda eager=False: False)  # the refill waits until released
    ids = tok.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi! Who are you?"}])

    async def go():
        out = [await run(engine, ids, ns, text_history=False) for _ in range(3)]  # keyed as sampled
        pending = len(engine.core.refills)
        monkeypatch.undo()
        for _ in range(200):
            if not engine.core.refills:
                break
            await asyncio.sleep(0.05)
        await engine.shutdown()
        return out, pending

    out, pending = asyncio.run(go())
    assert out[0][0] == out[1][0] == out[2][0]
    assert offered == [len(ids) + len(out[0][0])] and pending == 1
    assert engine.core.cache.lookup(ns, tuple(ids) + tuple(out[0][0]) + (0,)).num_cached_tokens == len(ids) + len(out[0][0])
    assert engine.core.cache.check_integrity() is None
