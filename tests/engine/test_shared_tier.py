"""The shared tier through two in-process engines ("replicas", one real redis-server): replica 2
serves a prompt replica 1 computed from Redis with the same tokens, without holding up another
session while it loads; with Redis killed it recomputes the same tokens with no error; a replica of
another dtype never serves the other's values."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest

from prefixserve import __version__
from prefixserve.cache import PrefixCache
from prefixserve.cache.shared import SharedTier
from prefixserve.config import CacheConfig, EngineConfig, SharedTierConfig
from prefixserve.engine import EngineCore
from prefixserve.runner.codec import SnapshotCodec
from prefixserve.types import Delta, Namespace, Request, SamplingParams, Usage, lcp
from tests.conftest import load_embedded
from tests.helpers.redis_proc import RedisServer

pytestmark = pytest.mark.slow
NS = Namespace("smol", "tenant-a")


@pytest.fixture
def redis_url() -> Iterator[RedisServer]:
    with RedisServer() as r:
        yield r


def make_core(url: str, out: dict[str, list[Delta]], mode: str = "int4") -> EngineCore:
    model, runner = load_embedded(mode)
    tier = SharedTier(SharedTierConfig(url, b"engine-test-secret-0123"), runner.decoder.kernel_fingerprint(),
                      __version__, SnapshotCodec(runner.decoder.device))
    return EngineCore(runner, model.tokenizer, PrefixCache(CacheConfig(max_bytes=1 << 30)),
                      EngineConfig(prefill_chunk_tokens=128, max_batch_tokens=256), 2048,
                      lambda rid, d: out.setdefault(rid, []).append(d), shared=tier)


def add(core: EngineCore, ids: list[int]) -> str:
    rid = uuid.uuid4().hex
    core.add(Request(rid, NS, tuple(ids), SamplingParams(max_tokens=6, temperature=0.0)))
    return rid


def result(out: dict[str, list[Delta]], rid: str) -> tuple[list[int], Usage]:
    deltas = out[rid]
    assert deltas[-1].finish_reason is not None and deltas[-1].usage is not None
    return [t for d in deltas for t in d.token_ids], deltas[-1].usage


def run(core: EngineCore) -> None:
    while core.has_work():
        core.step()


def test_replica_two_loads_from_redis_without_blocking_and_survives_redis_dying(redis_url: RedisServer) -> None:
    model, _ = load_embedded("int4")
    tok = model.tokenizer
    p = tok.render_chat([{"role": "user", "content": "List three colours of the rainbow, briefly. " * 6}])
    q = tok.render_chat([{"role": "user", "content": "Name a large mammal."}])
    r = tok.render_chat([{"role": "user", "content": "Describe a quiet harbour at dawn. " * 6}])
    out: dict[str, list[Delta]] = {}
    one, two = make_core(redis_url.url, out), make_core(redis_url.url, out)
    assert one.shared is not None and two.shared is not None
    cold = add(one, p)
    run(one)
    assert one.shared.wait_idle(30)
    ref_tokens, ref_usage = result(out, cold)
    assert ref_usage.cached_tokens == 0

    gate = threading.Event()
    slow_find = two.shared._find
    two.shared._find = lambda ns, ids, m: (  # type: ignore[method-assign]
        gate.wait(30) if len(ids) == len(p) else None, slow_find(ns, ids, m))[1]  # hold back p's read only
    warm, other = add(two, p), add(two, q)
    while other not in out or out[other][-1].finish_reason is None:
        two.step()  # the other session runs to its end while the Redis read is held back
    assert warm not in out and len(two.loads.sessions()) == 1
    gate.set()
    run(two)
    assert result(out, warm) == (ref_tokens, Usage(len(p), len(ref_tokens), len(p)))  # whole prompt from Redis
    assert two.shared.stats()["redis_loads"] == 1
    two.cache.check_integrity()

    # Redis dies: a prompt replica 1 wrote before is recomputed on replica 2, same tokens, no error
    cold_r = add(one, r)
    run(one)
    assert one.shared.wait_idle(30)
    redis_url.kill()
    again = add(two, r)
    run(two)
    # only RAM serves it: the chat template's header, shared with p and q whose entries replica 2 holds
    header = max(lcp(r, p), lcp(r, q))
    assert 0 < header < 32
    assert result(out, again) == (result(out, cold_r)[0], Usage(len(r), len(result(out, cold_r)[0]), header))
    stats = two.shared.stats()
    assert (stats["redis_up"], stats["redis_loads"]) == (0, 1) and stats["redis_errors"] >= 1
    for core in (one, two):
        assert core.shared is not None
        core.shared.close()


def test_a_value_written_under_another_dtype_is_never_served(redis_url: RedisServer) -> None:
    """The real fingerprints (`Decoder.kernel_fingerprint`) of an fp32 and a bf16 replica differ, so
    they keep to their own key spaces: the bf16 replica never reads the fp32 replica's value, computes
    the prompt itself, and leaves that value for the fp32 replicas (docs/cache.md, "Shared tier")."""
    out: dict[str, list[Delta]] = {}
    fp32, bf16 = make_core(redis_url.url, out, "fp32"), make_core(redis_url.url, out, "bf16")
    assert fp32.shared is not None and bf16.shared is not None
    assert fp32.shared.fingerprint != bf16.shared.fingerprint
    tok = load_embedded("bf16")[0].tokenizer
    p = tok.render_chat([{"role": "user", "content": "List three colours of the rainbow, briefly. " * 6}])
    rid = add(fp32, p)
    run(fp32)
    assert fp32.shared.wait_idle(30) and fp32.shared.stats()["redis_writes"] >= 1
    rid = add(bf16, p)
    run(bf16)
    assert result(out, rid)[1].cached_tokens == 0
    stats = bf16.shared.stats()
    assert (stats["redis_hits"], stats["redis_loads"], stats["redis_stale_values"], stats["redis_rejected_values"]) == (
        0, 0, 0, 0), stats
    fp32_b = make_core(redis_url.url, out, "fp32")  # another fp32 replica: the value is still there for it
    again = add(fp32_b, p)
    run(fp32_b)
    assert result(out, again)[1].cached_tokens > 0 and fp32_b.shared is not None
    assert fp32_b.shared.stats()["redis_loads"] >= 1
    for core in (fp32, bf16, fp32_b):
        assert core.shared is not None
        core.shared.close()
