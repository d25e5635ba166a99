"""KV events from a real `prefixserve serve` (the embedded model) over HTTP, read as llm-d's indexer
reads them (tests/helpers/kv_indexer.py): a request's prompt is announced block by block; the same
prompt from another tenant and another salt gets the same token ids under other hashes; DELETE
/v1/cache withdraws exactly the flushed tenant's blocks; /metrics counts what was published."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from tests.helpers.kv_indexer import Index, decode, replay
from tests.helpers.server_proc import ServerProcess

pytestmark = pytest.mark.slow
KEY_A, KEY_B, ADMIN = "sk-a-0123456789", "sk-b-9876543210", "sk-admin-555555"
MODEL = "SmolLM2-135M-Instruct"
TOPIC = "kv@replica-0@smol"
P1 = "Northwind Outfitters return policy. " + " ".join(
    f"Rule {i}: department {i} allows returns in {i + 20} days." for i in range(1, 9)) + " Summarise rule 3."


class Events:
    """The server's batches, fetched through its replay socket and applied to an llm-d index."""

    def __init__(self, replay_endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.endpoint = replay_endpoint
        self.index = Index(block_size=16)
        self.num_messages = 0

    def sync(self) -> Index:
        for seq, payload in replay(self.ctx, self.endpoint, self.num_messages):
            self.index.apply(decode([TOPIC.encode(), seq, payload]))
            self.num_messages += 1
        return self.index


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Events]]:
    sockets = Path(tmp_path_factory.mktemp("kv"))
    args = ["--api-key", f"alice {KEY_A}", "--api-key", f"bob {KEY_B}", "--admin-key", ADMIN, "--no-ledger",
            "--num-threads", "1", "--kv-events-endpoint", f"ipc://{sockets}/pub", "--kv-events-topic", TOPIC,
            "--kv-events-replay-endpoint", f"ipc://{sockets}/replay"]
    with ServerProcess(args) as srv:
        events = Events(f"ipc://{sockets}/replay")
        yield srv, events
        events.ctx.term()
    assert srv.returncode == 0  # the publisher closed with the server


def post(srv: ServerProcess, path: str, key: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(srv.openai_url.removesuffix("/v1") + path, json=body, headers={"Authorization": f"Bearer {key}"},
                   timeout=300)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def engine_metric(srv: ServerProcess, name: str) -> float:
    for line in srv.metrics().splitlines():
        if line.startswith((f"prefixserve_engine_{name} ", f"prefixserve_engine_{name}_total ")):
            return float(line.split()[1])
    raise AssertionError(f"prefixserve_engine_{name} not in /metrics")


def settle(srv: ServerProcess, events: Events) -> Index:
    """Wait until the cache stops changing (re-fed finished turns stored) and every change is published."""
    deadline = time.monotonic() + 120
    figures = ("cache_insertions", "cache_evictions", "cache_ram_flushed", "kv_events_events")
    while True:
        before = [engine_metric(srv, f) for f in figures]
        time.sleep(0.5)
        if (engine_metric(srv, "refill_bytes") == 0 and engine_metric(srv, "kv_events_queued_changes") == 0
                and before == [engine_metric(srv, f) for f in figures]):
            return events.sync()
        assert time.monotonic() < deadline, "the cache did not settle"


def complete(srv: ServerProcess, key: str, salt: str | None = None) -> None:
    body: dict[str, Any] = {"model": MODEL, "prompt": P1, "max_tokens": 6, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    post(srv, "/v1/completions", key, body)


def paths(index: Index, hashes: set[int]) -> set[tuple[int, ...]]:
    every = index.paths("replica-0")
    return {every[h] for h in hashes}


def test_prompts_are_announced_per_namespace_and_flushes_withdraw_them(served: Any) -> None:
    srv, events = served
    tokens = post(srv, "/tokenize", KEY_A, {"model": MODEL, "prompt": P1})["tokens"]
    assert len(tokens) >= 64
    complete(srv, KEY_A)
    index = settle(srv, events)
    assert index.num_cleared == 1  # the first batch
    alice = set(index.blocks)
    assert index.score("replica-0", tokens) == len(tokens) // 16  # every full block of the prompt
    for path in paths(index, {h for _, h in alice}):
        n = min(len(path), len(tokens))
        assert path[:n] == tuple(tokens[:n]) and len(path) % 16 == 0  # the prompt, or the prompt and its reply

    complete(srv, KEY_B)
    index = settle(srv, events)
    bob = set(index.blocks) - alice
    complete(srv, KEY_A, salt="s")
    index = settle(srv, events)
    salted = set(index.blocks) - alice - bob
    # the same prompt and reply: the same token paths, under three disjoint sets of hashes
    hashes = [{h for _, h in blocks} for blocks in (alice, bob, salted)]
    assert paths(index, hashes[0]) == paths(index, hashes[1]) == paths(index, hashes[2])
    assert len(hashes[0] | hashes[1] | hashes[2]) == 3 * len(hashes[0])

    r = httpx.request("DELETE", srv.openai_url + "/cache", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60)
    assert r.status_code == 200, r.text
    index = settle(srv, events)
    assert set(index.blocks) == bob  # alice's two namespaces withdrawn, bob's kept
    r = httpx.request("DELETE", srv.openai_url + "/cache", params={"all": "true"},
                      headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert r.status_code == 200, r.text
    index = settle(srv, events)
    assert not index.blocks and not index.pods
    assert engine_metric(srv, "kv_events_batches") == events.num_messages
    assert engine_metric(srv, "kv_events_dropped_changes") == 0
