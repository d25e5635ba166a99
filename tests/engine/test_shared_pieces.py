"""KV stored once along the prefix tree (runner/pieces.py) with the real model: entries assembled
from shared pieces resume bit-exactly, and N users of one system prompt cost one copy of it."""

from __future__ import annotations

import gc
import uuid

import pytest
import torch

from prefixserve.cache import PrefixCache
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine import EngineCore
from prefixserve.runner import StepItem
from prefixserve.runner.pieces import PieceStore
from prefixserve.types import FlushScope, Namespace, Request, SamplingParams
from tests.conftest import load_embedded
from tests.engine.test_engine_cache import SYSTEM

pytestmark = pytest.mark.slow
NS = Namespace("smol", "tenant-a")


def chat(tok, system: str, user: str) -> list[int]:
    return tok.render_chat([{"role": "system", "content": system}, {"role": "user", "content": user}])


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_entries_from_shared_pieces_resume_bitwise_exact() -> None:
    model, runner = load_embedded("int4")  # the server's default mode on this CPU
    tok = model.tokenizer
    prompts = [chat(tok, SYSTEM, u) for u in ("Can I return a jacket?", "What about shoes on clearance?",
                                              "Do you offer store credit after 40 days?")]
    shared = lcp(prompts[0], prompts[1])
    store, cache = PieceStore(), PrefixCache(CacheConfig(max_bytes=1 << 30))

    def insert(ids: list[int], n: int) -> None:
        st = runner.new_state()
        runner.prefill(st, ids[:n] if n < len(ids) else ids, 128)
        key = tuple(ids[:n])
        cache.insert(NS, key, store.snapshot(st, key, NS, cache.entry_lengths(NS, key)))
        cache.check_integrity()

    # the learning sequence: request 1 seeds, request 2 stores a boundary at the lcp, everyone their prompt
    insert(prompts[0], len(prompts[0]))
    insert(prompts[1], shared)
    for ids in prompts[1:]:
        insert(ids, len(ids))
    assert store.num_mismatched == 0
    entries = {e.token_ids: e for e in cache.entries()}
    boundary = entries[tuple(prompts[1][:shared])].state
    for ids in prompts[1:]:
        snap = entries[tuple(ids)].state
        below = [p for p in snap.pieces if p.end <= shared]
        assert [p.end for p in below] == [p.end for p in boundary.pieces]
        assert all(p.kv is q.kv for p, q in zip(below, boundary.pieces))  # the same memory, not a copy
    # bytes counted once: every distinct tensor once, plus each full-prompt entry's logits
    distinct = {id(p.kv): p.kv.untyped_storage().nbytes() for e in cache.entries() for p in e.state.pieces}
    logits = sum(e.state.logits.untyped_storage().nbytes() for e in cache.entries() if e.has_logits)
    assert cache.num_bytes == sum(distinct.values()) + logits

    # cached vs fresh at piece edges: the fresh run splits its prefill at the same depth in the same
    # chunks, so the comparison isolates the pieces (split invariance itself: tests/runner)
    for ids, depths in ((prompts[0], (65, len(prompts[0]) - 1)), (prompts[2], (shared - 1, shared, shared + 1))):
        snap = entries[tuple(ids)].state
        for d in depths:
            fresh = runner.new_state()
            runner.prefill(fresh, ids[:d], 128)
            resumed = snap.restore(d, len(ids) - d + 8)
            assert torch.equal(resumed.kv[:, :, :, :d], fresh.kv[:, :, :, :d]), f"KV at depth {d}"
            for st in (fresh, resumed):
                runner.prefill(st, ids[d:], 128)
            assert torch.equal(resumed.logits, fresh.logits), f"depth {d} of {len(ids)}"
            tokens: list[list[int]] = [[], []]
            for step in range(6):  # greedy, batched together: the same tokens
                for i, st in enumerate((fresh, resumed)):
                    tokens[i].append(int(torch.argmax(st.logits)))
                if step < 5:
                    runner.step([StepItem(st, [tokens[i][-1]], decode=True) for i, st in enumerate((fresh, resumed))])
            assert tokens[0] == tokens[1], f"depth {d} of {len(ids)}"
    for ids in prompts:  # a full hit's logits: those of the session that stored the entry
        ref = runner.new_state()
        runner.prefill(ref, ids, 128)
        assert torch.equal(entries[tuple(ids)].state.restore(len(ids), 4).logits, ref.logits)


def test_fifty_users_of_one_system_prompt_cost_one_copy_of_it() -> None:
    model, runner = load_embedded("int4")
    tok = model.tokenizer
    system = SYSTEM
    while len(tok.encode(system)) < 2000:
        system += " " + SYSTEM
    users = [f"Question {i}: may I return item number {i * 7} after {i + 3} days?" for i in range(50)]
    prompts = [chat(tok, system, u) for u in users]
    shared = lcp(prompts[0], prompts[1])
    assert shared >= 2000
    core = EngineCore(runner, tok, PrefixCache(CacheConfig(max_bytes=1 << 30)),
                      EngineConfig(prefill_chunk_tokens=256, max_batch_tokens=512, offer_finished_turns=False), 4096,
                      lambda r, d: None)  # entries of prompts only: finished turns are the turn tests' subject
    for ids in prompts:
        core.add(Request(uuid.uuid4().hex, NS, tuple(ids), SamplingParams(max_tokens=1, temperature=0.0)))
        while core.has_work():
            core.step()
    cache = core.cache
    cache.check_integrity()
    per_token = runner.kv_bytes_per_token()
    ideal = shared * per_token + sum(len(ids) - shared for ids in prompts) * per_token
    whole = sum(len(ids) for ids in prompts) * per_token  # one private copy per entry, as before
    print(f"\n50 users: {cache.num_bytes} B cached, ideal {ideal} B ({cache.num_bytes / ideal:.3f}x), "
          f"whole copies {whole} B; {cache.num_entries} entries, {core.pieces.num_shared} pieces shared")
    # 50 prompts, the boundary at the system prompt, and boundaries where users' questions share a
    # start ("Question 1" / "Question 1x")
    assert 51 <= cache.num_entries <= 60
    assert core.counters.num_cached_tokens >= 49 * shared
    assert cache.num_bytes <= 1.2 * ideal

    cache_entries, cache_bytes = cache.num_entries, cache.num_bytes
    report = core.flush(FlushScope("tenant-a"))
    assert (report.num_entries, report.num_bytes) == (cache_entries, cache_bytes)
    assert (cache.num_entries, cache.num_bytes) == (0, 0)
    gc.collect()
    assert len(core.pieces._live) == 0  # no piece outlives the entries that held it
