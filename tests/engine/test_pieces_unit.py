"""runner/pieces.py without a model: piece edges, sharing, bitwise verification, weak lifetime."""

from __future__ import annotations

import gc

import torch

from prefixserve.runner.pieces import PieceStore, piece_edges, same_bits
from prefixserve.runner.state import SessionState


def state_of(num_tokens: int, seed: int = 0) -> SessionState:
    g = torch.Generator().manual_seed(seed)
    st = SessionState.empty((2, 2, 1, 4), torch.bfloat16, "cpu", num_tokens)
    st.kv[:, :, :, :num_tokens] = torch.randn(2, 2, 1, num_tokens, 4, generator=g).to(torch.bfloat16)
    st.num_tokens = num_tokens
    st.logits = torch.randn(10, generator=g)
    return st


def test_piece_edges() -> None:
    assert piece_edges(200, 64) == [64, 128, 192, 200]
    assert piece_edges(200, 64, [100, 64, 0, 200, 300]) == [64, 100, 128, 192, 200]
    assert piece_edges(64, 64) == [64]


def test_shared_pieces_are_one_tensor_and_die_with_their_holders() -> None:
    st = state_of(150)
    ids = list(range(150))
    store = PieceStore(64)
    boundary = store.snapshot(st, ids[:100], "ns")
    full = store.snapshot(st, ids, "ns", splits=[100])
    assert [(p.start, p.end) for p in boundary.pieces] == [(0, 64), (64, 100)]
    assert [(p.start, p.end) for p in full.pieces] == [(0, 64), (64, 100), (100, 128), (128, 150)]
    assert full.pieces[0].kv is boundary.pieces[0].kv and full.pieces[1].kv is boundary.pieces[1].kv
    assert store.num_shared == 2 and full.has_logits and not boundary.has_logits
    assert dict(full.storage())[full.pieces[0].key] == 2 * 2 * 1 * 64 * 4 * 2
    assert torch.equal(full.restore(150, 0).kv[:, :, :, :150], st.kv[:, :, :, :150])
    other_ns = store.snapshot(st, ids[:100], "other")  # another namespace never shares
    assert other_ns.pieces[0].kv is not boundary.pieces[0].kv
    del boundary, full, other_ns
    gc.collect()
    assert len(store._live) == 0


def test_a_piece_with_other_bits_is_never_shared() -> None:
    store = PieceStore(64)
    first = store.snapshot(state_of(64, seed=1), list(range(64)), "ns")
    second = store.snapshot(state_of(64, seed=2), list(range(64)), "ns")  # same key, other bits
    assert store.num_mismatched == 1 and second.pieces[0].kv is not first.pieces[0].kv
    assert second.pieces[0].key != first.pieces[0].key  # counted as its own bytes
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert same_bits(torch.tensor([1.5]), torch.tensor([1.5]))


def test_a_snapshot_in_steps_pauses_per_piece_and_gives_the_same_snapshot() -> None:
    """`snapshot_steps` (a background refill's store) pauses between pieces, so what waits behind it
    waits one piece, not a whole long turn; it ends with the snapshot `snapshot` makes, sharing the
    same live pieces; closed early, it leaves nothing live."""
    st = state_of(300)
    ids = list(range(300))
    store = PieceStore(64)
    prompt = store.snapshot(st, ids[:200], "ns")
    steps = store.snapshot_steps(st, ids, "ns", splits=[200])
    pauses = 0
    while True:
        try:
            next(steps)
            pauses += 1
        except StopIteration as done:
            turn = done.value
            break
    assert [(p.start, p.end) for p in turn.pieces] == [(0, 64), (64, 128), (128, 192), (192, 200), (200, 256), (256, 300)]
    assert pauses == len(turn.pieces) - 1  # one piece a call
    assert all(turn.pieces[i].kv is prompt.pieces[i].kv for i in range(4)) and store.num_shared == 4
    assert turn.has_logits and torch.equal(turn.restore(300, 0).kv[:, :, :, :300], st.kv[:, :, :, :300])
    del prompt, turn
    gc.collect()
    assert len(store._live) == 0
    abandoned = store.snapshot_steps(state_of(300, seed=3), ids, "other")
    next(abandoned)
    next(abandoned)  # two pieces made, live while the paused store holds them
    assert len(store._live) == 2
    abandoned.close()
    del abandoned
    gc.collect()
    assert len(store._live) == 0


def test_codec_round_trip_is_bitwise() -> None:
    from prefixserve.runner.codec import SnapshotCodec

    st = state_of(150)
    snap = PieceStore(64).snapshot(st, list(range(150)), "ns", splits=[100])
    meta, payload = SnapshotCodec().encode(snap)
    back = SnapshotCodec().decode(meta, memoryview(payload), 150)
    assert [(p.start, p.end) for p in back.pieces] == [(p.start, p.end) for p in snap.pieces]
    assert all(same_bits(a.kv, b.kv) for a, b in zip(back.pieces, snap.pieces, strict=True))
    assert back.logits is not None and snap.logits is not None and same_bits(back.logits, snap.logits)
    assert len(payload) == sum(p.kv.numel() * 2 for p in snap.pieces) + 10 * 4

    store = PieceStore(64)
    boundary = store.snapshot(st, list(range(100)), "ns")  # live pieces for [0, 64), [64, 100)
    adopted = store.adopt(back, list(range(150)), "ns")
    assert adopted.pieces[0].kv is boundary.pieces[0].kv and adopted.pieces[1].kv is boundary.pieces[1].kv
    assert adopted.pieces[2].kv.untyped_storage().nbytes() == adopted.pieces[2].kv.numel() * 2  # own memory
    assert torch.equal(adopted.restore(150, 0).kv[:, :, :, :150], st.kv[:, :, :, :150])
