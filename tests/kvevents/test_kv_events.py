"""KV events (docs/gateway.md): the RAM cache's entries as vLLM-style blocks, published over ZMQ and
read back as llm-d's indexer reads them (tests/helpers/kv_indexer.py). After every cache operation
(inserts, LRU evictions, flushes, a replacement, clear) the blocks the indexer holds are exactly the
full blocks of the cached entries, with their token ids and hash chains, one namespace's never
another's."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from prefixserve.cache import PrefixCache
from prefixserve.config import CacheConfig, KVEventsConfig
from prefixserve.kvevents import open_publisher
from prefixserve.kvevents.blocks import AllBlocksCleared, BlockHasher, BlockRemoved, BlockStored, BlockTracker
from prefixserve.kvevents.publisher import KVEventPublisher
from prefixserve.server.settings import kv_events_config
from prefixserve.types import FlushScope, Namespace
from tests.helpers.kv_indexer import Index, decode, replay

KEY = bytes(range(32))
B = 16
NS_A = Namespace("m", "tenant-a")
NS_B = Namespace("m", "tenant-b")
NS_A_SALT = Namespace("m", "tenant-a", "salt-1")
TOPIC = "kv@replica-0@m"
SYSTEM = tuple(range(1000, 1040))  # 40 tokens: 2 full blocks and 8 over
TURN = SYSTEM + tuple(range(2000, 2030))  # 70 tokens: 4 full blocks

_unique = itertools.count()


@dataclass(frozen=True)
class State:
    """A KV-only state of `num_tokens` holding one private piece of `nbytes` (the cache's contract)."""

    num_tokens: int
    nbytes: int = 100
    has_logits: bool = False
    truncatable: bool = True
    piece: int = 0

    def storage(self) -> list[tuple[object, int]]:
        return [(("own", self.piece), self.nbytes)]


def state(tokens: tuple[int, ...], nbytes: int = 100, logits: bool = False) -> State:
    return State(len(tokens), nbytes, logits, piece=next(_unique))


# ---- blocks.py: pure ----------------------------------------------------------------------------


def test_hashes_chain_by_prefix_and_are_keyed_by_namespace_and_key() -> None:
    hasher = BlockHasher(KEY, B)
    system, turn = hasher.chain(NS_A, SYSTEM), hasher.chain(NS_A, TURN)
    assert len(system) == 2 and len(turn) == 4 and turn[:2] == system  # a shared prefix shares its blocks
    assert hasher.chain(NS_A, SYSTEM[:15]) == []  # under one block: nothing to announce
    assert all(0 <= h < 1 << 64 for h in turn)
    others = [BlockHasher(KEY, B).chain(ns, TURN) for ns in (NS_B, NS_A_SALT, Namespace("m2", "tenant-a"))]
    others.append(BlockHasher(bytes(32), B).chain(NS_A, TURN))  # another process's key
    for other in others:
        assert not set(other) & set(turn)  # the same prompt: never the same block


def test_tracker_announces_the_new_suffix_and_removes_with_the_last_cover() -> None:
    hasher = BlockHasher(KEY, B)
    h = hasher.chain(NS_A, TURN)
    t = BlockTracker(hasher)
    assert t.stored(NS_A, SYSTEM) == BlockStored(tuple(h[:2]), None, SYSTEM[:32], B)
    assert t.stored(NS_A, TURN) == BlockStored(tuple(h[2:]), h[1], TURN[32:64], B)
    assert t.stored(NS_A, TURN[:50]) is None  # inside blocks already present
    assert t.stored(NS_A, TURN) is None  # already tracked
    t.check_integrity()
    assert t.removed(NS_A, TURN) == BlockRemoved((h[3],))  # TURN[:50] still covers the first three
    assert t.removed(NS_A, TURN[:50]) == BlockRemoved((h[2],))  # SYSTEM the first two
    assert t.removed(NS_A, TURN[:50]) is None  # never told twice
    t.check_integrity()
    assert t.num_blocks == 2
    assert t.cleared() == [BlockRemoved(tuple(h[:2])), AllBlocksCleared()]
    assert t.num_blocks == 0 and t.removed(NS_A, SYSTEM) is None
    t.check_integrity()


def test_wire_form_is_vllms_array_like_tagged_structs() -> None:
    stored = BlockStored((1, 2), None, tuple(range(32)), 16)
    assert stored.wire() == ["BlockStored", [1, 2], None, list(range(32)), 16, None, "CPU"]
    assert BlockRemoved((2,)).wire() == ["BlockRemoved", [2], "CPU"]
    assert AllBlocksCleared().wire() == ["AllBlocksCleared"]


def test_config_is_checked_and_flags_need_an_endpoint() -> None:
    with pytest.raises(ValueError, match="tcp://"):
        KVEventsConfig("http://x:1")
    with pytest.raises(ValueError, match="block size"):
        KVEventsConfig("tcp://*:5557", block_size=0)
    settings = {"kv_events_endpoint": None, "kv_events_replay_endpoint": "tcp://*:5558"}
    with pytest.raises(ValueError, match="needs --kv-events-endpoint"):
        kv_events_config(settings)
    assert kv_events_config({"kv_events_endpoint": "", "kv_events_replay_endpoint": None}) is None


def test_an_endpoint_in_use_is_a_start_up_error_naming_the_flag(tmp_path: Path) -> None:
    first = open_publisher(KVEventsConfig(f"ipc://{tmp_path}/a", replay_endpoint="tcp://127.0.0.1:0"))
    assert first is not None
    try:
        ctx = zmq.Context()
        taken = ctx.socket(zmq.ROUTER)
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        with pytest.raises(ValueError, match="--kv-events-endpoint"):
            open_publisher(KVEventsConfig(f"ipc://{tmp_path}/b", replay_endpoint=f"tcp://127.0.0.1:{port}"))
        taken.close()
        ctx.term()
    finally:
        first.close()


# ---- the publisher with a real cache, read back as llm-d reads it -------------------------------


class Reader:
    """Fetches every batch published since the last call through the replay socket (no slow-joiner
    race: the buffer holds them all) and applies it to an llm-d index."""

    def __init__(self, publisher: KVEventPublisher, replay_endpoint: str) -> None:
        self.publisher = publisher
        self.endpoint = replay_endpoint
        self.ctx = zmq.Context()
        self.index = Index(block_size=B)
        self.messages: list[list[bytes]] = []

    def sync(self) -> Index:
        assert self.publisher.wait_idle(10.0)
        for seq, payload in replay(self.ctx, self.endpoint, len(self.messages)):
            frames = [TOPIC.encode(), seq, payload]
            self.index.apply(decode(frames))
            self.messages.append(frames)
        return self.index

    def close(self) -> None:
        self.ctx.term()


@pytest.fixture
def published(tmp_path: Path) -> Iterator[tuple[PrefixCache[State], Reader]]:
    replay_endpoint = f"ipc://{tmp_path}/replay"
    publisher = KVEventPublisher(KVEventsConfig(f"ipc://{tmp_path}/pub", topic=TOPIC, replay_endpoint=replay_endpoint,
                                                block_size=B, hash_key=KEY))
    cache: PrefixCache[State] = PrefixCache(CacheConfig(max_bytes=1000), publisher)
    reader = Reader(publisher, replay_endpoint)
    yield cache, reader
    publisher.close()
    reader.close()


def expected_paths(cache: PrefixCache[State]) -> dict[int, tuple[int, ...]]:
    """Every full block of every cached entry, by its hash: the token ids from the root through it."""
    hasher = BlockHasher(KEY, B)
    out: dict[int, tuple[int, ...]] = {}
    for entry in cache.entries():
        for i, h in enumerate(hasher.chain(entry.namespace, entry.token_ids)):
            out[h] = entry.token_ids[:(i + 1) * B]
    return out


def check(cache: PrefixCache[State], reader: Reader) -> Index:
    cache.check_integrity()
    index = reader.sync()
    assert index.paths("replica-0") == expected_paths(cache)
    return index


def test_replay_answers_req_and_both_dealer_framings_alike(published: tuple[PrefixCache[State], Reader]) -> None:
    """docs/gateway.md: `[start]` from a REQ socket, or a DEALER sending it alone or after an empty
    frame (vLLM's); each gets the same batches in the envelope it asked in."""
    cache, reader = published
    cache.insert(NS_A, SYSTEM, state(SYSTEM))
    reader.sync()
    want = [[seq, payload] for _, seq, payload in reader.messages]
    for kind, lead in ((zmq.REQ, []), (zmq.DEALER, []), (zmq.DEALER, [b""])):
        sock = reader.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.connect(reader.endpoint)
        sock.send_multipart([*lead, (0).to_bytes(8, "big")])
        got = []
        while True:
            frames = sock.recv_multipart()
            if kind == zmq.REQ:  # a REQ takes one reply: the first batch only, then it asks again
                got.append(frames)
                break
            assert frames[:len(lead)] == lead
            seq, payload = frames[len(lead):]
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            got.append([seq, payload])
        sock.close()
        assert got == (want[:1] if kind == zmq.REQ else want), kind


def test_every_stored_and_removed_prefix_is_announced(published: tuple[PrefixCache[State], Reader]) -> None:
    cache, reader = published
    index = check(cache, reader)
    assert index.num_cleared == 1 and not index.blocks  # the first batch: AllBlocksCleared, nothing yet
    cache.insert(NS_A, SYSTEM, state(SYSTEM))
    cache.insert(NS_A, TURN, state(TURN))
    cache.insert(NS_A, TURN[:10], state(TURN[:10]))  # under a block: an entry, no block
    index = check(cache, reader)
    assert len(index.blocks) == 4
    assert index.score("replica-0", list(TURN) + [7] * 20) == 4  # what the cache serves, in blocks
    assert cache.best_len(NS_A, TURN + (7,) * 20) // B == 4
    assert index.score("replica-0", list(SYSTEM[:20]) + [9] * 40) == 1

    # the same prompt in another tenant and another salt: their own blocks, the same token ids
    cache.insert(NS_B, TURN, state(TURN))
    cache.insert(NS_A_SALT, TURN, state(TURN))
    index = check(cache, reader)
    assert len(index.blocks) == 12
    by_tokens: dict[tuple[int, ...], list[int]] = {}
    for h, path in index.paths("replica-0").items():
        by_tokens.setdefault(path, []).append(h)
    assert sorted(len(hs) for hs in by_tokens.values()) == [3] * 4  # each path under 3 distinct hashes

    # LRU eviction: 1000 bytes hold 10 entries of 100; A's 40-token entry goes first, its blocks stay
    # (A's 70-token entry covers them), then the 10-token one (no blocks), then A's 70-token one
    for k in range(5):
        tokens = tuple(range(5000 + 100 * k, 5000 + 100 * k + 32))
        cache.insert(NS_B, tokens, state(tokens))
    assert [e.num_tokens for e in cache.entries()][:3] == [40, 70, 10]
    check(cache, reader)
    big = tuple(range(9000, 9048))
    result = cache.insert(NS_B, big, state(big, nbytes=300))
    assert [(e.namespace, e.num_tokens) for e in result.evicted] == [(NS_A, 40), (NS_A, 70), (NS_A, 10)]
    index = check(cache, reader)
    removed = [e for msg in reader.messages[-1:] for e in decode(msg).events if e[0] == "BlockRemoved"]
    assert [len(e[1]) for e in removed] == [4]  # one BlockRemoved: A's four blocks, when the last cover left

    # a flush of one tenant (DELETE /v1/cache): its blocks only
    flushed = cache.flush(FlushScope("tenant-b", None).selects)
    assert flushed.num_entries == 7
    index = check(cache, reader)
    assert {path for path in index.paths("replica-0").values()} == {TURN[:16], TURN[:32], TURN[:48], TURN[:64]}

    # replaced (the same key, now with logits): removed then stored again, the same hashes
    before = set(index.blocks)
    assert cache.insert(NS_A_SALT, TURN, state(TURN, logits=True)).status.value == "replaced"
    index = check(cache, reader)
    assert set(index.blocks) == before

    cache.clear()
    index = check(cache, reader)
    assert not index.blocks and not index.pods and index.num_cleared == 2
    assert reader.publisher.stats()["kv_events_dropped_changes"] == 0


@pytest.mark.parametrize("mode", ["publisher binds", "publisher connects"])
def test_a_live_subscriber_gets_what_replay_gives(tmp_path: Path, mode: str) -> None:
    """The PUB socket as a gateway meets it: bound (the indexer connects) or connecting to an indexer
    that binds (llm-d's current subscriber). Live messages equal the replayed ones, seq for seq."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    if mode == "publisher binds":
        endpoint = f"ipc://{tmp_path}/pub"
    else:
        endpoint = f"tcp://127.0.0.1:{sub.bind_to_random_port('tcp://127.0.0.1')}"
    replay_endpoint = f"ipc://{tmp_path}/replay"
    publisher = KVEventPublisher(KVEventsConfig(endpoint, topic=TOPIC, replay_endpoint=replay_endpoint, block_size=B))
    if mode == "publisher binds":
        sub.connect(endpoint)
    cache: PrefixCache[State] = PrefixCache(CacheConfig(max_bytes=10_000), publisher)
    try:
        live: dict[int, list[bytes]] = {}
        for k in range(200):  # until the subscription has reached the publisher (a ZMQ PUB drops before)
            tokens = tuple(range(100 * k, 100 * k + 16))
            cache.insert(NS_A, tokens, state(tokens))
            if sub.poll(50):
                break
        assert sub.poll(5000), "no live message"
        for k in range(3):
            tokens = TURN + (k,) * 16
            cache.insert(NS_B, tokens, state(tokens))
        cache.flush(lambda ns: True)
        assert publisher.wait_idle(10.0)
        while not live or max(live) < publisher.num_batches - 1:
            assert sub.poll(5000), f"live messages stop at {max(live, default=None)} of {publisher.num_batches}"
            frames = sub.recv_multipart()
            live[decode(frames).seq] = frames
        replayed = {int.from_bytes(seq, "big"): [TOPIC.encode(), seq, payload]
                    for seq, payload in replay(ctx, replay_endpoint, 0)}
        first = min(live)
        assert sorted(live) == list(range(first, len(replayed)))  # from the first live one on, none missing
        assert all(live[s] == replayed[s] for s in live)
        index = Index(block_size=B)
        for s in sorted(replayed):
            index.apply(decode(replayed[s]))
        assert not index.blocks  # all flushed
    finally:
        publisher.close()
        sub.close()
        ctx.term()


class StalledPublisher(KVEventPublisher):
    """Its thread stops inside its first send until `go` is set: the engine side must not wait."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.inside = threading.Event()
        self.go = threading.Event()
        super().__init__(config)

    def _send(self, events: list) -> None:  # type: ignore[type-arg]
        if not self.inside.is_set():
            self.inside.set()
            assert self.go.wait(30.0)
        super()._send(events)


def test_a_full_queue_drops_and_counts_and_announces_no_block_the_cache_lacks(tmp_path: Path) -> None:
    replay_endpoint = f"ipc://{tmp_path}/replay"
    publisher = StalledPublisher(KVEventsConfig(f"ipc://{tmp_path}/pub", topic=TOPIC, replay_endpoint=replay_endpoint,
                                                max_queue_size=2, block_size=B, hash_key=KEY))
    cache: PrefixCache[State] = PrefixCache(CacheConfig(max_bytes=10_000), publisher)
    reader = Reader(publisher, replay_endpoint)
    try:
        assert publisher.inside.wait(10.0)  # the thread is stuck sending its first batch (AllBlocksCleared)
        for k in range(5):  # 2 queue, 3 are dropped: no insert waits for the stuck thread
            tokens = tuple(range(100 * k, 100 * k + 32))
            cache.insert(NS_A, tokens, state(tokens))
        assert publisher.stats()["kv_events_dropped_changes"] == 3
        publisher.go.set()
        index = reader.sync()
        assert publisher.stats()["kv_events_resyncs"] == 1
        assert not index.blocks  # what was announced was withdrawn: it missed changes
        later = tuple(range(7000, 7040))
        cache.insert(NS_A, later, state(later))  # from here on, announced again
        index = reader.sync()
        paths = index.paths("replica-0")
        assert set(paths.values()) == {later[:16], later[:32]}
        assert set(paths.items()) <= set(expected_paths(cache).items())  # a subset of the cache, never more
    finally:
        publisher.go.set()
        publisher.close()
        reader.close()
