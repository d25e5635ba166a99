"""A reader of KV events that decodes them as llm-d's indexer does (llm-d-kv-cache-manager,
pkg/kvcache/kvevents: zmq_subscriber.go, pool.go, events.go; pkg/kvcache/kvblock: in_memory.go,
token_processor.go), written from that code's rules, to check what prefixserve publishes.

Its rules, each checked here as an assertion where the Go code would drop or misfile an event:
- a message is exactly three frames: topic, sequence (8 bytes big-endian), msgpack payload; the topic
  splits on '@' into kv, pod id and model name;
- the payload is an array of at least two fields: a float timestamp, the events, an optional int
  data-parallel rank (more fields skipped);
- each event is an array whose first element is the tag (a string); the rest is the struct's fields
  in order: BlockStored [block_hashes, parent_block_hash, token_ids (uint32), block_size, lora_id,
  medium], BlockRemoved [block_hashes, medium], AllBlocksCleared []; a hash is a uint64 (or bytes,
  whose last 8 bytes it reads);
- the index maps each engine key (a published hash) to a request key it computes itself from the
  token ids, in full blocks of its own block size, chained from the parent's request key (the root
  when the parent is None; when a parent hash is unknown it falls back to the root, which files the
  blocks at the wrong place: asserted never to happen here); `len(block_hashes)` must equal the
  number of full blocks of the token ids ("mismatch between engine keys and request keys");
- BlockRemoved drops (pod, tier) from the request key of each engine key; AllBlocksCleared is ignored.

Request keys here are the exact token paths from the root (tuples), which is what llm-d's chained
FNV hashes stand for. Besides llm-d's index, `blocks` keeps what a consumer keyed by the published
hashes sees (vLLM-native routers): hash -> (parent hash, the block's token ids)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

ROOT: tuple[int, ...] = ()
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass
class Message:
    pod: str
    model: str
    seq: int
    ts: float
    rank: int | None
    events: list[list[Any]]  # [tag, *fields]


def decode(frames: list[bytes]) -> Message:
    """One ZMQ message as llm-d's subscriber and pool decode it."""
    assert len(frames) == 3, f"{len(frames)} frames"
    topic, seq_bytes, payload = frames
    parts = topic.decode().split("@")
    assert len(parts) == 3 and parts[0] == "kv", f"topic {topic!r} is not kv@<pod-id>@<model-name>"
    assert len(seq_bytes) == 8
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    assert isinstance(batch, list) and len(batch) >= 2, batch
    ts, events = batch[0], batch[1]
    rank = batch[2] if len(batch) > 2 else None
    assert isinstance(ts, float) and isinstance(events, list), batch
    assert rank is None or isinstance(rank, int)
    for event in events:
        assert isinstance(event, list) and event and isinstance(event[0], str), event
    return Message(parts[1], parts[2], int.from_bytes(seq_bytes, "big"), ts, rank, events)


def hash_u64(raw: Any) -> int:
    """getHashAsUint64: an integer as it is, bytes by their last 8 (big-endian)."""
    if isinstance(raw, bytes):
        assert raw, "empty hash"
        return int.from_bytes(raw[-8:], "big")
    assert isinstance(raw, int) and 0 <= raw < 1 << 64, raw
    return raw


@dataclass
class Index:
    """llm-d's in-memory index over every pod's events, plus the hash-keyed view (see the module doc)."""

    block_size: int = 16  # the indexer's tokenProcessorConfig.blockSize
    engine_to_request: dict[int, tuple[int, ...]] = field(default_factory=dict)
    pods: dict[tuple[int, ...], set[tuple[str, str]]] = field(default_factory=dict)  # request key -> (pod, tier)
    blocks: dict[tuple[str, int], tuple[int | None, tuple[int, ...]]] = field(default_factory=dict)
    next_seq: dict[str, int] = field(default_factory=dict)
    num_cleared: int = 0

    def apply(self, msg: Message) -> None:
        """Digest one message; its sequence number must be the pod's next (no gap, no repeat)."""
        assert msg.seq == self.next_seq.get(msg.pod, 0), (msg.seq, self.next_seq.get(msg.pod, 0))
        self.next_seq[msg.pod] = msg.seq + 1
        for tag, *fields in msg.events:
            if tag == "BlockStored":
                self._stored(msg.pod, *fields)
            elif tag == "BlockRemoved":
                self._removed(msg.pod, *fields)
            else:
                assert tag == "AllBlocksCleared" and not fields, (tag, fields)
                self.num_cleared += 1  # llm-d: `continue`

    def paths(self, pod: str) -> dict[int, tuple[int, ...]]:
        """Each of the pod's blocks (by published hash) with its whole token path from the root,
        following parent hashes (asserting every parent is a block the pod announced and kept)."""
        out = {}
        for (p, h) in self.blocks:
            if p != pod:
                continue
            path: list[tuple[int, ...]] = []
            cur: int | None = h
            while cur is not None:
                assert (pod, cur) in self.blocks, f"block {cur:#x} of {pod} has a parent it never announced"
                parent, tokens = self.blocks[(pod, cur)]
                path.append(tokens)
                cur = parent
            out[h] = tuple(t for chunk in reversed(path) for t in chunk)
        return out

    def score(self, pod: str, prompt: list[int]) -> int:
        """llm-d's longest-prefix score: how many of the prompt's leading full blocks list the pod."""
        n = 0
        for end in range(self.block_size, len(prompt) + 1, self.block_size):
            if not any(p == pod for p, _ in self.pods.get(tuple(prompt[:end]), ())):
                break
            n += 1
        return n

    def _stored(self, pod: str, hashes: list[Any], parent: Any, token_ids: list[int], block_size: int,
                lora_id: Any = None, medium: str | None = None, *rest: Any) -> None:
        assert all(isinstance(t, int) and 0 <= t < 1 << 32 for t in token_ids)
        assert lora_id is None
        tier = (medium or "gpu").lower()
        engine_keys = [hash_u64(h) for h in hashes]
        parent_key = None if parent is None else hash_u64(parent)
        if parent_key is None:
            parent_request = ROOT
        else:
            assert parent_key in self.engine_to_request, f"parent {parent_key:#x} unknown: llm-d would file at the root"
            parent_request = self.engine_to_request[parent_key]
        chunks = [tuple(token_ids[i:i + self.block_size])
                  for i in range(0, len(token_ids) - self.block_size + 1, self.block_size)]
        assert len(chunks) == len(engine_keys), "mismatch between engine keys and request keys length"
        assert block_size == self.block_size and len(token_ids) == block_size * len(engine_keys)
        request = parent_request
        prev = parent_key
        for key, chunk in zip(engine_keys, chunks, strict=True):
            request = request + chunk
            self.engine_to_request[key] = request
            self.pods.setdefault(request, set()).add((pod, tier))
            assert (pod, key) not in self.blocks, f"block {key:#x} stored twice without a removal"
            self.blocks[(pod, key)] = (prev, chunk)
            prev = key

    def _removed(self, pod: str, hashes: list[Any], medium: str | None = None, *rest: Any) -> None:
        tier = (medium or "gpu").lower()
        for raw in hashes:
            key = hash_u64(raw)
            assert (pod, key) in self.blocks, f"block {key:#x} removed but never stored"
            del self.blocks[(pod, key)]
            request = self.engine_to_request.get(key)
            if request is None:
                continue
            holders = self.pods.get(request, set())
            holders.discard((pod, tier))
            if not holders:
                self.pods.pop(request, None)
                del self.engine_to_request[key]


def replay(ctx: Any, endpoint: str, start: int, timeout_s: float = 10.0) -> list[list[bytes]]:
    """Every buffered message from sequence `start` on, asked of the publisher's replay socket as
    vLLM's subscriber asks (a DEALER here: several replies to one request), as [topic-less] frames
    [seq, payload] up to the end marker."""
    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[list[bytes]] = []
        while True:
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return out
            out.append([seq, payload])
    finally:
        sock.close()
