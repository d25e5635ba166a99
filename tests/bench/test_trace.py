"""bench/trace_model.py and bench/trace_sim.py: prompt construction from trace lines, and the offline
simulators on hand-made traces with exact hit counts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# bench/ on the path for these two imports only: its scripts' names (kernel_configs, client, servers,
# ...) must not shadow other packages for the rest of the suite
BENCH = str(Path(__file__).resolve().parents[2] / "bench")
sys.path.insert(0, BENCH)

from trace_model import (
    Scale,
    api_keys_file_text,
    block_lengths,
    multi_turn_requests,
    output_tokens,
    parse_trace,
    prompt_ids,
    sample_conversations,
    scaled_blocks,
    tenant_of,
)
from trace_sim import (
    ServerRequest,
    ServerSim,
    simulate_belady,
    simulate_block_lru,
    simulate_infinite,
    simulate_server,
    working_set_tokens,
)

sys.path.remove(BENCH)

from prefixserve.config import CacheConfig
from prefixserve.server.operator.auth import parse_key_spec, read_keys_file
from prefixserve.types import Namespace

LINES = """\
{"timestamp": 0, "input_length": 1100, "output_length": 500, "hash_ids": [0, 1, 2]}
{"timestamp": 10, "input_length": 1500, "output_length": 3, "hash_ids": [0, 1, 5]}
{"timestamp": 25, "input_length": 900, "output_length": 40, "hash_ids": [0, 7]}

{"timestamp": 40, "input_length": 2048, "output_length": 10, "hash_ids": [0, 1, 2, 9]}
"""


def test_parse_keeps_order_times_and_lengths() -> None:
    reqs = parse_trace(LINES.splitlines())
    assert [r.timestamp_ms for r in reqs] == [0, 10, 25, 40]
    assert reqs[1].hash_ids == (0, 1, 5) and reqs[1].output_length == 3
    assert len(parse_trace(LINES.splitlines(), limit=2)) == 2
    with pytest.raises(ValueError, match="line 1"):
        parse_trace(['{"timestamp": 0}'])


def test_lengths_are_scaled_and_capped() -> None:
    reqs = parse_trace(LINES.splitlines())
    scale = Scale(block_tokens=16, max_prompt_tokens=40, max_output=8)
    # 1100 tokens = 2 full blocks + 76: the partial block scales to round(76 * 16 / 512) = 2
    assert block_lengths(reqs[0], Scale(block_tokens=16)) == [16, 16, 2]
    assert block_lengths(reqs[3], Scale(block_tokens=16)) == [16, 16, 16, 16]
    assert block_lengths(reqs[3], scale) == [16, 16, 8]  # the cap cuts the third block, drops the fourth
    assert len(prompt_ids(reqs[3], scale)) == 40
    # outputs scale as prompts do: 500 tokens -> round(15.6) = 16, capped at 8; 40 -> round(1.25) = 1; at least 1
    assert [output_tokens(r, scale) for r in reqs] == [8, 1, 1, 1]
    assert [output_tokens(r, Scale(block_tokens=512, max_output=100)) for r in reqs] == [100, 3, 40, 10]


def test_equal_ids_give_equal_prefixes_and_different_ids_differ() -> None:
    reqs = parse_trace(LINES.splitlines())
    scale = Scale(block_tokens=32)
    p0, p1, p2, p3 = (prompt_ids(r, scale) for r in reqs)
    assert p0[:64] == p1[:64]  # blocks 0 and 1 shared
    assert p0[64] != p1[64] and p0[64:] != p1[64 : len(p0)]  # block 2 vs block 5
    assert p0[:32] == p2[:32] and p0[32:64] != p2[32:64]
    assert p3[: len(p0)] == p0  # 0, 1, 2 again: p0's partial block 2 is a prefix of the full one
    assert prompt_ids(reqs[0], scale) == p0  # deterministic
    assert prompt_ids(reqs[0], Scale(block_tokens=32, seed=1)) != p0
    assert all(256 <= t < 49_000 for t in p0)


def test_tenants_follow_the_chosen_block(tmp_path: Path) -> None:
    reqs = parse_trace(LINES.splitlines())
    assert [tenant_of(r, 4) for r in reqs] == [1, 1, 3, 1]  # block 1's id mod 4
    assert {tenant_of(r, 4, tenant_block=0) for r in reqs} == {0}
    assert tenant_of(reqs[2], 4, tenant_block=5) == 7 % 4  # fewer blocks: the last one
    (tmp_path / "keys").write_text(api_keys_file_text(3))
    tenants = [parse_key_spec(spec)[0] for spec in read_keys_file(tmp_path / "keys")]
    assert tenants == ["trace-t0", "trace-t1", "trace-t2"]  # a key file the server accepts
    assert scaled_blocks(reqs[2], Scale(block_tokens=16), 3) == [((3, 0), 16), ((3, 7), 12)]  # 388 tokens -> 12


def test_sampling_keeps_whole_conversations_and_parts_partition() -> None:
    reqs = parse_trace(LINES.splitlines())  # conversations by block 1: {0, 1, 3} (id 1) and {2} (id 7)
    assert sample_conversations(reqs, 1) == reqs
    parts = [sample_conversations(reqs, 3, part=k) for k in range(3)]
    assert parts == [[reqs[2]], [], [reqs[0], reqs[1], reqs[3]]]  # ids 7 and 1 hash to parts 0 and 2
    assert sample_conversations(reqs, 3, sample_block=0, part=0) in ([], reqs)  # block 0 is shared by all
    with pytest.raises(ValueError):
        sample_conversations(reqs, 3, part=3)


def test_multi_turn_requests_skip_single_turn_conversations() -> None:
    reqs = parse_trace(LINES.splitlines())
    assert multi_turn_requests(reqs, 10) == [reqs[0], reqs[1], reqs[3]]  # conversation id 7 has one turn
    assert multi_turn_requests(reqs, 2) == [reqs[0], reqs[1]]
    assert multi_turn_requests(reqs, 10, conversation_block=2) == [reqs[0], reqs[3]]  # block 2's ids: 2, 5, 7, 2


# blocks of one token each: (key, tokens)
def units(*keys: str) -> list[tuple[str, int]]:
    return [(k, 1) for k in keys]


def test_belady_beats_lru_on_a_loop_larger_than_the_cache() -> None:
    trace = [units("a"), units("b"), units("c"), units("a"), units("b")]
    assert simulate_infinite(trace).hit_tokens == 2
    lru = simulate_block_lru(trace, budget_tokens=2)
    assert (lru.hit_tokens, lru.prompt_tokens) == (0, 5)  # every block evicted just before its reuse
    opt = simulate_belady(trace, budget_tokens=2)
    assert opt.hit_tokens == 2  # keeps a and b, drops c (never used again)
    assert working_set_tokens(trace) == 3


def test_prefix_chains_and_leaf_first_order() -> None:
    trace = [units("x", "y1"), units("x", "y2"), units("x", "y1")]
    assert simulate_block_lru(trace, budget_tokens=3).hit_tokens == 1 + 2
    # budget 2: LRU drops y1 (least recent) for y2, so the third request finds only x
    assert simulate_block_lru(trace, budget_tokens=2).hit_tokens == 1 + 1
    assert simulate_belady(trace, budget_tokens=2).hit_tokens == 1 + 2  # drops y2: never used again
    assert simulate_infinite(trace).hit_tokens == 3
    # a cache too small for any block serves nothing
    assert simulate_belady(trace, budget_tokens=0).hit_tokens == 0


def test_block_sizes_count_in_tokens() -> None:
    trace = [[("s", 10), ("u1", 5)], [("s", 10), ("u2", 5)], [("s", 10), ("u1", 3)]]
    assert simulate_infinite(trace).hit_tokens == 10 + 13
    assert simulate_belady(trace, budget_tokens=15).hit_tokens == 10 + 13
    assert simulate_block_lru(trace, budget_tokens=15).hit_tokens == 10 + 10


KV, LOGITS = 10, 7  # bytes per token, bytes of an entry's logits


def test_server_sim_serves_and_shares_like_the_engine() -> None:
    a = tuple(range(100))
    b = tuple(range(64)) + tuple(range(1000, 1036))
    sim = ServerSim(CacheConfig(max_bytes=1 << 30), KV, LOGITS, turns=False)
    assert sim.run(ServerRequest(0, a, 4)) == 0
    assert sim.cache.num_bytes == 100 * KV + LOGITS
    assert sim.run(ServerRequest(0, b, 4)) == 64  # a's first 64 tokens, by truncation
    # b's pieces: [0, 64) shared with a, [64, 100) its own; the boundary entry at 64 adds nothing
    assert sim.cache.num_bytes == (100 + 36) * KV + 2 * LOGITS
    assert sim.cache.get(Namespace("sim", "t0"), b[:64]) is not None
    assert sim.run(ServerRequest(0, a, 4)) == 100  # equal to a cached prompt with logits: all of it
    assert sim.run(ServerRequest(1, a, 4)) == 0  # another tenant sees nothing
    sim.cache.check_integrity()


def test_server_sim_turns_and_budget() -> None:
    a = tuple(range(100))
    with_turns = ServerSim(CacheConfig(max_bytes=1 << 30), KV, LOGITS, turns=True)
    with_turns.run(ServerRequest(0, a, 4))
    assert with_turns.cache.num_entries == 2  # the prompt and prompt + reply
    assert with_turns.cache.num_bytes == 104 * KV + 2 * LOGITS
    reqs = [ServerRequest(0, a, 4), ServerRequest(0, tuple(range(200, 300)), 4), ServerRequest(0, a, 4)]
    # room for one prompt only: the second evicts the first, the third misses
    small = simulate_server(reqs, CacheConfig(max_bytes=100 * KV + LOGITS), KV, LOGITS, turns=False)
    assert (small.hit_tokens, small.prompt_tokens, small.evictions) == (0, 300, 2)
    big = simulate_server(reqs, CacheConfig(max_bytes=1 << 20), KV, LOGITS, turns=False)
    assert big.hit_tokens == 100
