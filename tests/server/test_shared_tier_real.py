"""The shared tier over HTTP with the real model: two `prefixserve serve` replicas sharing one real
redis-server. Replica 2's first request on a prompt replica 1 computed is served from Redis and
answers as a `--cache-max-bytes 0` server does; other tenants and salts miss on both; DELETE
/v1/cache removes the tenant's Redis keys; Redis killed under streaming load over both replicas
fails no request, local hits go on, and a restarted Redis is used again."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from prefixserve.cache.tier import TierKeys
from tests.helpers.redis_proc import RedisServer
from tests.helpers.server_proc import ServerProcess

pytestmark = pytest.mark.slow
KEY_A, KEY_B = "sk-a-0123456789", "sk-b-9876543210"
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "Northwind Outfitters return policy. " + " ".join(
    f"Rule {i}: department {i} allows returns in {i + 20} days." for i in range(1, 13))
P1 = SYSTEM + " Summarise rule 3."


def complete(srv: ServerProcess, key: str, prompt: str, salt: str | None = None) -> tuple[str, int, int]:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(srv.openai_url + "/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                   timeout=300)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return r.json()["choices"][0]["text"], usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def stream(srv: ServerProcess, prompt: str, first: threading.Event | None = None) -> tuple[bool, int]:
    """(ok, cached_tokens) of one streamed completion read to [DONE]; `first` is set at its first chunk."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    usage, done = None, False
    with httpx.stream("POST", srv.openai_url + "/completions", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {KEY_A}"}) as r:
        if r.status_code != 200:
            return False, 0
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                if first is not None:
                    first.set()
                obj = json.loads(line[6:])
                if "error" in obj:
                    return False, 0
                usage = obj.get("usage") or usage
    return done and usage is not None, 0 if usage is None else usage["prompt_tokens_details"]["cached_tokens"]


def metric(srv: ServerProcess, name: str) -> float:
    for line in srv.metrics().splitlines():
        if line.startswith((f"prefixserve_engine_cache_redis_{name} ", f"prefixserve_engine_cache_redis_{name}_total ")):
            return float(line.split()[1])
    raise AssertionError(f"redis_{name} not in /metrics")


def settle(*servers: ServerProcess) -> None:
    """Wait until every queued value (prompts and re-fed finished turns) has been sent."""
    deadline = time.monotonic() + 60
    while True:
        before = [metric(s, "writes") + metric(s, "present") for s in servers]
        time.sleep(1.0)
        if all(metric(s, "pending_writes") == 0 for s in servers) and before == [
                metric(s, "writes") + metric(s, "present") for s in servers]:
            return
        assert time.monotonic() < deadline, "writes did not settle"


def wait_metric(srv: ServerProcess, name: str, at_least: float, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while metric(srv, name) < at_least:
        assert time.monotonic() < deadline, f"redis_{name} stayed below {at_least}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, ServerProcess, ServerProcess,
                                                                        ServerProcess]]:
    key_file = Path(tmp_path_factory.mktemp("secret")) / "redis.key"
    key_file.write_text("a-deployment-secret-of-32-bytes!\n")
    with RedisServer() as rs:
        args = ["--api-key", f"alice {KEY_A}", "--api-key", f"bob {KEY_B}", "--admin-key", "sk-admin-555555", "--no-ledger", "--num-threads", "1"]
        shared = ["--cache-redis-url", rs.url, "--cache-redis-key-file", str(key_file)]
        servers = [ServerProcess(args + shared), ServerProcess(args + shared),
                   ServerProcess(args + ["--cache-max-bytes", "0"])]
        threads = [threading.Thread(target=s.start) for s in servers]  # three model loads at once
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        try:
            for s in servers:
                assert s.proc is not None and s.proc.poll() is None, s.log_tail()
            yield rs, servers[0], servers[1], servers[2]
        finally:
            for s in servers:
                s.__exit__(None, None, None)


def test_replica_two_is_served_from_redis_exactly_and_isolation_holds(cluster: Any) -> None:
    rs, r1, r2, nocache = cluster
    reference = complete(nocache, KEY_A, P1)
    text, cached, n = complete(r1, KEY_A, P1)
    assert (text, cached) == (reference[0], 0)
    wait_metric(r1, "writes", 1)
    assert complete(r2, KEY_A, P1) == (reference[0], n, n)  # the whole prompt from Redis, the same answer
    assert metric(r2, "loads") == 1 and metric(r2, "load_seconds_total") > 0
    # another tenant or salt misses on both replicas (each asked once, before its own entry exists)
    for srv, key, salt in ((r1, KEY_B, None), (r2, KEY_B, "z"), (r1, KEY_A, "s"), (r2, KEY_A, "t")):
        assert complete(srv, key, P1, salt) == (reference[0], 0, n)
    assert metric(r1, "rejected_values") == metric(r2, "rejected_values") == 0

    # replica 1 served one user of a system prompt; replica 2's first, other user finds that entry by
    # its 64-token markers and is served the shared part from Redis, answering as the cache-less server
    doc = "Zephyr Bank fees. " + " ".join(f"Account type {i} costs {i + 4} euros a month." for i in range(1, 16))
    complete(r1, KEY_A, doc + " Which account costs 9 euros?")
    settle(r1)
    loads = metric(r2, "loads")
    text, cached, n = complete(r2, KEY_A, doc + " What does type 2 cost?")
    assert (text, n) == complete(nocache, KEY_A, doc + " What does type 2 cost?")[::2]
    assert cached >= 128 and metric(r2, "loads") == loads + 1  # the document is ~165 tokens: markers at 64, 128

    # DELETE /v1/cache on replica 1 removes alice's keys from Redis (all her salts), bob's stay
    settle(r1, r2)
    client = redis.Redis.from_url(rs.url)
    keys = TierKeys.from_secret(b"a-deployment-secret-of-32-bytes!")  # the names under the deployment's secret
    alice, bob = (f"prefixserve:*:{keys.digest('tenant', t)}:*" for t in ("alice", "bob"))  # in any key space
    alice_values = [k for k in client.scan_iter(match=alice) if not k.endswith(b":len") and b":p:" not in k]
    bob_keys = sorted(client.scan_iter(match=bob))
    assert len(alice_values) >= 3 and len(bob_keys) >= 4  # unsalted, s, t / unsalted, z (+ length indexes, markers)
    r = httpx.request("DELETE", r1.openai_url + "/cache", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tiers"]["redis"]["deleted_entries"] == len(alice_values)
    assert list(client.scan_iter(match=alice)) == [] and sorted(client.scan_iter(match=bob)) == bob_keys
    client.close()


NUM_CLIENTS = 32  # streaming clients over both replicas when Redis is killed


def test_redis_killed_under_load_fails_nothing_and_comes_back(cluster: Any) -> None:
    rs, r1, r2, _ = cluster
    for srv in (r1, r2):  # the system prompt in each replica's RAM: every client below has a local hit
        complete(srv, KEY_A, SYSTEM + " Which rule comes first?")
    users = [f" Question {i}: which department takes returns in {i + 22} days?" for i in range(NUM_CLIENTS)]
    results: list[tuple[bool, int]] = []
    lock = threading.Lock()
    streaming = threading.Event()

    def client(i: int) -> None:
        got = stream((r1, r2)[i % 2], SYSTEM + users[i], streaming)
        with lock:
            results.append(got)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(NUM_CLIENTS)]
    for t in threads:
        t.start()
    assert streaming.wait(120)
    with lock:
        finished_before_kill = len(results)
    rs.kill()  # mid-load: lookups, reads and writes in flight on both replicas
    for t in threads:
        t.join()
    assert finished_before_kill < NUM_CLIENTS  # the kill landed while clients were still streaming
    assert len(results) == NUM_CLIENTS and all(ok for ok, _ in results), results
    assert all(cached > 0 for _, cached in results), results  # local RAM served the system prompt throughout

    # Redis down: local tiers only, with a log line and a metric, and no error
    for srv, question in ((r1, " Which rule covers department 7?"), (r2, " Which rule covers department 8?")):
        loads = metric(srv, "loads")
        ok, cached = stream(srv, SYSTEM + question)
        assert ok and cached > 0 and metric(srv, "loads") == loads  # the system prompt's entry in this replica's RAM
        wait_metric(srv, "errors", 1)  # this request's write, at least, found Redis gone
    assert "serving from the local tiers" in r1.log_text() and "serving from the local tiers" in r2.log_text()

    rs.start()  # empty (no persistence); each replica reconnects after its back-off (<= 8 s)
    deadline = time.monotonic() + 60
    i = 0
    while metric(r1, "up") < 1 or metric(r2, "up") < 1:
        assert time.monotonic() < deadline, "a replica never used the restarted Redis"
        for srv in (r1, r2):
            i += 1
            complete(srv, KEY_A, f"Probe {i}: " + " ".join(f"word{j}" for j in range(40)))
        time.sleep(0.5)
    prompt = "After the restart, a new document. " + " ".join(f"Fact {i}: item {i} costs {3 * i} coins."
                                                              for i in range(1, 13)) + " What does item 4 cost?"
    text, cached, n = complete(r1, KEY_A, prompt)
    settle(r1)
    before = metric(r2, "loads")
    text2, cached2, _ = complete(r2, KEY_A, prompt)
    assert (text2, cached2) == (text, n) and metric(r2, "loads") == before + 1  # shared hits again
