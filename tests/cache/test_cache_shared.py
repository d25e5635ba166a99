"""The shared (Redis) tier against a real redis-server, with a fake codec (no model): round trip,
isolation, HMAC rejection of tampered / moved values, another secret or fingerprint never read, Redis
down or slow → miss and counted, back → hit, flush by namespace, with exact counts."""

from __future__ import annotations

import hashlib
import re
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from cache_fakes import NS_A, NS_A_OTHER_MODEL, NS_A_SALT, NS_B
from fingerprints import variants

from prefixserve.cache.shared import MAC_BYTES, SharedTier
from prefixserve.cache.tier import Loaded, LoadFailed
from prefixserve.config import SharedTierConfig
from prefixserve.types import FlushScope
from tests.helpers.redis_proc import RedisServer

SYS = tuple(range(100, 164))  # 64 tokens
SECRET = b"deployment-secret-0123456789"


@dataclass(frozen=True)
class Blob:
    data: bytes
    has_logits: bool = True


class BlobCodec:
    def encode(self, state: Blob) -> tuple[dict[str, Any], bytes]:
        return {"len": len(state.data)}, state.data

    def decode(self, meta: dict[str, Any], payload: memoryview, num_tokens: int) -> Blob:
        if meta["len"] != len(payload):
            raise ValueError("length")
        return Blob(bytes(payload))


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as r:
        yield r


@pytest.fixture
def client(server: RedisServer) -> Iterator[redis.Redis]:
    if server.proc is None:
        server.start()
    c = redis.Redis.from_url(server.url)
    c.flushall()
    yield c
    c.close()


def tier(server: RedisServer, secret: bytes = SECRET, fingerprint: str = "fp-1") -> SharedTier:
    return SharedTier(SharedTierConfig(server.url, secret, timeout_s=0.5), fingerprint, "0.1.0", BlobCodec())


def put(t: SharedTier, ns: Any, key: tuple[int, ...], data: bytes) -> None:
    assert t.offer(ns, key, Blob(data))
    assert t.wait_idle(10)
    t.check_integrity()


def get(t: SharedTier, ns: Any, prompt: tuple[int, ...], min_tokens: int = 1) -> Loaded | LoadFailed | None:
    fut = t.find(ns, prompt, min_tokens)
    return None if fut is None else fut.result(10)


def test_round_trip_longest_prefix_and_isolation(server: RedisServer, client: redis.Redis) -> None:
    a, b = tier(server), tier(server)  # two replicas
    put(a, NS_A, SYS, b"s" * 1000)
    put(a, NS_A, SYS + (1, 2, 3), b"u" * 500)
    put(b, NS_A, SYS, b"s" * 1000)  # already there: not sent again
    got = get(b, NS_A, SYS + (1, 2, 3, 4))
    assert isinstance(got, Loaded) and got.token_ids == SYS + (1, 2, 3) and got.state == Blob(b"u" * 500)
    got = get(b, NS_A, SYS + (1, 9))  # only the system prompt's entry is a prefix of this one
    assert isinstance(got, Loaded) and got.token_ids == SYS and got.state == Blob(b"s" * 1000)
    assert isinstance(get(b, NS_A, SYS + (1, 2, 3, 4), min_tokens=68), LoadFailed)  # none serves 68
    for other in (NS_B, NS_A_SALT, NS_A_OTHER_MODEL):  # another tenant, salt or model
        assert isinstance(get(b, other, SYS + (1, 2, 3)), LoadFailed)
    keys = sorted(k.decode() for k in client.keys("*"))
    # 2 values, 1 length index, 1 marker (at 64 tokens, naming the later entry): digests only
    assert len(keys) == 4 and all("tenant-a" not in k for k in keys)
    sa, sb = a.stats(), b.stats()
    assert (sa["redis_writes"], sb["redis_present"], sb["redis_writes"]) == (2, 1, 0)
    # the 68-token ask read the marked 67-token entry and found it too short: a hit, not a load
    assert (sb["redis_lookups"], sb["redis_hits"], sb["redis_loads"], sb["redis_load_failures"]) == (6, 3, 2, 1)
    assert sb["redis_load_seconds_total"] > 0 and sb["redis_up"] == 1
    a.close()
    b.close()


def test_a_marker_finds_an_entry_longer_than_the_shared_prefix(server: RedisServer, client: redis.Redis) -> None:
    a, b = tier(server), tier(server)
    long_sys = SYS + tuple(range(500, 564))  # 128 tokens: markers at 64 and 128
    put(a, NS_A, long_sys + (1, 2, 3), b"u" * 300)  # replica 1 saw one user of this system prompt
    put(a, NS_A, tuple(range(900, 1030)), b"o" * 10)  # another prompt: its length (130) is indexed too
    got = get(b, NS_A, long_sys + (7, 8), min_tokens=100)  # another user's prompt on replica 2
    assert isinstance(got, Loaded) and got.token_ids == long_sys + (1, 2, 3)  # RAM will serve its 128 tokens
    assert isinstance(get(b, NS_A, SYS + (7,) * 70, min_tokens=65), LoadFailed)  # shares only 64 < 65
    assert isinstance(get(b, NS_B, long_sys + (7, 8)), LoadFailed)  # markers live in the namespace
    a.close()
    b.close()


def test_tampered_value_is_dropped_and_counted(server: RedisServer, client: redis.Redis) -> None:
    t = tier(server)
    put(t, NS_A, SYS, b"x" * 4000)
    key = t.key(NS_A, SYS)
    raw = bytearray(client.get(key))
    raw[-MAC_BYTES - 100] ^= 0x01  # one payload bit
    client.set(key, bytes(raw))
    got = get(t, NS_A, SYS + (1,))
    assert isinstance(got, LoadFailed) and "HMAC" in got.reason
    assert client.exists(key) == 0  # dropped
    s = t.stats()
    assert (s["redis_rejected_values"], s["redis_load_failures"], s["redis_loads"]) == (1, 1, 0)
    t.close()


def test_another_secret_or_fingerprint_is_never_served_nor_disturbed(server: RedisServer, client: redis.Redis) -> None:
    """Replicas that cannot use each other's values (another secret: a typo, a rotation under way;
    another model bytes, dtype, kernel or CPU class) keep to their own key spaces: each serves its own,
    none reads, deletes or overwrites the other's (QA: a replica with a mistyped secret deleted every
    value the others wrote, and its own were then deleted by them)."""
    t = tier(server)
    put(t, NS_A, SYS, b"m" * 100)
    foreign = tier(server, secret=b"another-deployment-secret!!")
    other_dtype = tier(server, fingerprint="fp-2")  # same secret, another model bytes / dtype / kernel
    for other, data in ((foreign, b"f"), (other_dtype, b"d")):
        assert isinstance(get(other, NS_A, SYS + (1,)), LoadFailed)  # a miss: t's value is not theirs
        put(other, NS_A, SYS, data * 100)
        got = get(other, NS_A, SYS + (1,))
        assert isinstance(got, Loaded) and got.state == Blob(data * 100)
        assert other.stats()["redis_writes"] == 1
    got = get(t, NS_A, SYS + (1,))
    assert isinstance(got, Loaded) and got.state == Blob(b"m" * 100)
    for x in (t, foreign, other_dtype):
        s = x.stats()
        assert (s["redis_rejected_values"], s["redis_stale_values"]) == (0, 0), s
    # a tenant's flush reaches every key space of its secret; another secret names the tenant otherwise
    assert foreign.flush(FlushScope("tenant-a")).num_entries == 1
    assert t.flush(FlushScope("tenant-a")).num_entries == 2
    assert isinstance(get(t, NS_A, SYS + (1,)), LoadFailed) and client.keys("*") == []

    # a value moved to another key (another tenant's) fails its MAC: the key is signed too
    put(t, NS_A, SYS, b"m" * 100)
    client.set(t.key(NS_B, SYS), client.get(t.key(NS_A, SYS)))
    client.zadd(t.key(NS_B, SYS).rsplit(":", 1)[0] + ":len", {"64": 64})
    assert isinstance(get(t, NS_B, SYS + (1,)), LoadFailed) and t.stats()["redis_rejected_values"] == 1
    for x in (foreign, other_dtype, t):
        x.close()


def test_redis_down_is_a_miss_counted_and_back_is_a_hit(server: RedisServer, client: redis.Redis) -> None:
    t = tier(server)
    put(t, NS_A, SYS, b"x" * 100)
    server.kill()
    t0 = time.monotonic()
    assert isinstance(get(t, NS_A, SYS + (1,)), LoadFailed)  # connection refused: a miss
    assert get(t, NS_A, SYS + (1,)) is None  # in back-off: not even tried
    assert not t.offer(NS_A, SYS + (5,), Blob(b"y"))  # writes are dropped, never queued
    flushed = t.flush(FlushScope("tenant-a"))  # in the back-off: not tried, and said to be incomplete
    assert (flushed.num_entries, flushed.complete) == (0, False)
    assert time.monotonic() - t0 < 2.0
    s = t.stats()
    assert s["redis_up"] == 0 and s["redis_errors"] >= 1 and s["redis_dropped_writes"] == 1
    server.start()  # an empty Redis (no persistence): the tier is used again after its back-off
    deadline = time.monotonic() + 10
    while not t.offer(NS_A, SYS, Blob(b"x" * 100)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert t.wait_idle(10)
    got = get(t, NS_A, SYS + (1,))
    assert isinstance(got, Loaded) and got.state == Blob(b"x" * 100) and t.stats()["redis_up"] == 1
    assert t.flush(FlushScope("tenant-a")).complete
    t.close()


def test_a_slow_redis_is_a_miss_within_the_timeout_and_is_used_again(server: RedisServer, client: redis.Redis) -> None:
    """Redis slow (SIGSTOP: connections are accepted, nothing is answered): a read gives up at the
    socket timeout (0.5 s here), a miss and counted, then the back-off skips Redis; once it answers
    again the value written before is served (docs/cache.md, "Degrades, never fails")."""
    t = tier(server)
    put(t, NS_A, SYS, b"x" * 100)
    server.pause()
    try:
        t0 = time.monotonic()
        got = get(t, NS_A, SYS + (1,))
        assert isinstance(got, LoadFailed) and got.reason == "Redis unavailable"
        assert 0.4 < time.monotonic() - t0 < 2.0  # waited for the timeout, no longer
        assert get(t, NS_A, SYS + (1,)) is None  # in back-off: not even tried
        assert not t.offer(NS_A, SYS + (5,), Blob(b"y"))
        s = t.stats()
        assert s["redis_up"] == 0 and s["redis_errors"] == 1 and s["redis_dropped_writes"] == 1
        assert (s["redis_loads"], s["redis_hits"]) == (0, 0)
    finally:
        server.resume()
    deadline = time.monotonic() + 10
    while (got := get(t, NS_A, SYS + (1,))) is None or isinstance(got, LoadFailed):
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    assert isinstance(got, Loaded) and got.state == Blob(b"x" * 100) and t.stats()["redis_up"] == 1
    t.close()


def test_flush_deletes_the_scope_of_every_model(server: RedisServer, client: redis.Redis) -> None:
    t = tier(server)
    for ns in (NS_A, NS_A_SALT, NS_A_OTHER_MODEL, NS_B):
        put(t, ns, SYS, b"z" * 100)
    r = t.flush(FlushScope("tenant-a", "salt-1"))
    assert r.num_entries == 1 and r.num_bytes == len(client.get(t.key(NS_A, SYS)))
    assert isinstance(get(t, NS_A_SALT, SYS), LoadFailed) and isinstance(get(t, NS_A, SYS), Loaded)
    assert t.flush(FlushScope("tenant-a")).num_entries == 2  # unsalted, both models
    assert isinstance(get(t, NS_A_OTHER_MODEL, SYS), LoadFailed) and isinstance(get(t, NS_B, SYS), Loaded)
    assert len(client.keys("*")) == 3  # bob's value, its length index and its marker
    assert t.flush(FlushScope(None, None)).num_entries == 1 and client.keys("*") == []
    assert t.stats()["redis_flushed"] == 4
    t.close()


def test_a_write_that_lands_after_a_flush_leaves_nothing_of_it(server: RedisServer, client: redis.Redis) -> None:
    t = tier(server)
    long_sys = SYS + tuple(range(500, 564))  # 128 tokens: markers at 64 and 128
    put(t, NS_A, SYS + (1,), b"k" * 50)  # an entry of the namespace written after the flush: marker at 64 kept
    kept_marker = client.get(f"{t.key(NS_A, SYS).rsplit(':', 1)[0]}:p:{t.keys.tokens(SYS)}")
    with t._lock:  # the flush lands while a write queued before it (epoch 0) is in flight
        t._epoch += 1
        t._flushes.append((t._epoch, FlushScope("tenant-a")))
    t._write(NS_A, long_sys + (2,), Blob(b"w" * 80), 0)  # the writer thread's call, made here to fix the order
    assert client.get(t.key(NS_A, long_sys + (2,))) is None  # the value went
    base = t.key(NS_A, SYS).rsplit(":", 1)[0]
    assert client.get(f"{base}:p:{t.keys.tokens(long_sys)}") is None  # its own marker went
    # the 64-token marker named the late write (last writer wins); it went too, the older entry's is
    # findable by its length, and nothing of the late entry's length is left in the index
    assert client.get(f"{base}:p:{t.keys.tokens(SYS)}") is None and kept_marker is not None
    assert client.zrange(f"{base}:len", 0, -1) == [b"65"]
    got = get(t, NS_A, SYS + (1, 5))
    assert isinstance(got, Loaded) and got.token_ids == SYS + (1,)
    assert t.stats()["redis_writes"] == 1  # the late write is not counted as stored
    t.close()


def test_a_value_evicted_by_redis_is_skipped_not_an_error(server: RedisServer, client: redis.Redis) -> None:
    """allkeys-lru may evict a value and keep its length index or marker (docs/cache.md, "Bound"):
    that GET finds nothing and the next candidate is read; no error, no back-off."""
    t = tier(server)
    put(t, NS_A, SYS, b"s" * 100)
    put(t, NS_A, SYS + (1, 2, 3), b"u" * 100)
    client.delete(t.key(NS_A, SYS + (1, 2, 3)))  # as Redis's LRU would
    got = get(t, NS_A, SYS + (1, 2, 3, 4))
    assert isinstance(got, Loaded) and got.token_ids == SYS
    client.delete(t.key(NS_A, SYS))
    assert isinstance(get(t, NS_A, SYS + (1, 2, 3, 4)), LoadFailed)
    s = t.stats()
    assert (s["redis_hits"], s["redis_loads"], s["redis_errors"], s["redis_rejected_values"], s["redis_up"]) == (
        1, 1, 0, 0, 1)
    t.close()


def test_a_full_redis_drops_the_write_and_stays_up() -> None:
    with RedisServer(maxmemory="2mb", policy="noeviction") as full:
        t = tier(full)
        put(t, NS_A, SYS, b"x" * (4 << 20))  # over maxmemory: Redis answers OOM
        s = t.stats()
        assert (s["redis_writes"], s["redis_dropped_writes"], s["redis_errors"], s["redis_up"]) == (0, 1, 1, 1)
        assert isinstance(get(t, NS_A, SYS), LoadFailed)  # a miss, and Redis is still used
        put(t, NS_A, SYS, b"y" * 100)
        assert isinstance(get(t, NS_A, SYS), Loaded) and t.stats()["redis_writes"] == 1
        t.close()


def test_the_metrics_are_the_documented_ones(server: RedisServer, client: redis.Redis) -> None:
    """`/metrics` shows `stats()` as prefixserve_engine_cache_<name> (engine/async_engine.py): the
    names are exactly docs/cache.md's list under "Metrics"."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "cache.md").read_text()
    listed = re.search(r"prefixserve_engine_cache_redis_\{([a-z_,]+)\}", doc)
    assert listed is not None
    t = tier(server)
    assert {k.removeprefix("redis_") for k in t.stats()} == set(listed.group(1).split(","))
    assert all(k.startswith("redis_") for k in t.stats())
    t.close()


def test_key_names_are_keyed_by_the_secret(server: RedisServer, client: redis.Redis) -> None:
    """Without the secret a key name confirms no guessed prompt or tenant: the unkeyed digests of the
    known tokens, of their 64-token prefix and of the tenant appear in no key; another deployment
    (another secret) names the same entry otherwise in every part; replicas of one secret alike."""
    t, replica = tier(server), tier(server)
    other = tier(server, secret=b"another-deployment-secret!!")
    prompt = SYS + tuple(range(300, 340))  # a marker at 64 tokens
    put(t, NS_A, prompt, b"v" * 100)
    put(other, NS_A, prompt, b"v" * 100)
    names = b" ".join(client.keys("*")).decode()
    assert names.count(":p:") == 2  # one marker each
    unkeyed = [hashlib.blake2b(array("i", ids).tobytes(), digest_size=16).hexdigest() for ids in (prompt, SYS)]
    unkeyed += [hashlib.sha256(f"prefixserve:{kind}\0{value}".encode()).hexdigest()[:32]
                for kind, value in (("tenant", NS_A.tenant_id), ("model", NS_A.model_id), ("salt", NS_A.cache_salt))]
    assert not any(u in names for u in unkeyed)
    assert replica.key(NS_A, prompt) == t.key(NS_A, prompt)  # replicas share entries
    mine, theirs = t.key(NS_A, prompt).split(":")[1:], other.key(NS_A, prompt).split(":")[1:]
    assert all(a != b for a, b in zip(mine, theirs, strict=True))  # space, tenant, salt, model, tokens
    got = get(replica, NS_A, prompt + (1,))
    assert isinstance(got, Loaded) and got.token_ids == prompt
    for x in (t, replica, other):
        x.close()


def test_a_value_of_another_runtime_identity_is_never_served(
        server: RedisServer, client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica whose runtime identity differs in any part (runner/identity.py: torch's version or
    build, our code, the CPU's model or flags, the native build, dtype, kernels, threads, version) or
    whose model differs finds none of the values of this one, and leaves them be."""
    fp, others = variants(tmp_path, monkeypatch)
    t = tier(server, fingerprint=fp)
    put(t, NS_A, SYS, b"m" * 100)
    for what, other_fp in others.items():
        other = tier(server, fingerprint=other_fp)
        assert isinstance(get(other, NS_A, SYS + (1,)), LoadFailed), what
        other.close()
    got = get(t, NS_A, SYS + (1,))
    assert isinstance(got, Loaded) and got.state == Blob(b"m" * 100)
    assert (t.stats()["redis_rejected_values"], t.stats()["redis_stale_values"]) == (0, 0)
    t.close()
