"""KV buffers of finished sessions are reused (runner/state.py KVPool): a reused buffer never leaks
old contents into a session, a view or a buffer given twice is never pooled, holders are counted by
the pool's own contract (no private torch API), the pool is bounded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import prefixserve
from prefixserve.runner.state import BLOCK, KVPool, SessionState

SHAPE = (2, 2, 3, 8)  # layers, 2, kv heads, head_dim


def _filled(num_tokens: int, capacity: int, seed: int) -> SessionState:
    st = SessionState.empty(SHAPE, torch.bfloat16, "cpu", capacity)
    g = torch.Generator().manual_seed(seed)
    st.kv[:, :, :, :num_tokens] = torch.randn(*st.kv[:, :, :, :num_tokens].shape, generator=g).to(torch.bfloat16)
    st.num_tokens = num_tokens
    return st


def test_a_restore_into_a_dirty_reused_buffer_equals_a_fresh_one() -> None:
    pool = KVPool()
    dirty = SessionState(torch.full((2, 2, 3, 128, 8), 7.0, dtype=torch.bfloat16))
    pool.give(dirty.kv)
    snap = _filled(40, 64, 1).snapshot()
    fresh = snap.restore(40, 30)
    reused = snap.restore(40, 30, pool)
    assert pool.num_reused == 1 and reused.kv.shape[3] >= fresh.kv.shape[3]
    assert torch.equal(reused.kv[:, :, :, :40], fresh.kv[:, :, :, :40])
    assert not reused.kv[:, :, :, 40:].any()  # zeros past the keys, as block attention needs
    again = SessionState.empty(SHAPE, torch.bfloat16, "cpu", 64, pool)  # pool empty: a new, zeroed one
    assert pool.num_allocated == 1 and not again.kv.any()


def test_a_view_or_a_second_give_is_never_pooled() -> None:
    """Only a whole storage, once: a view is someone else's memory, and a buffer given twice would be
    lent to two sessions."""
    pool = KVPool()
    kv = torch.zeros(2, 2, 3, BLOCK, 8)
    assert not pool.give(kv[0]) and not pool.give(kv[:, :, :, : BLOCK // 2]) and not pool.give(kv[1:])
    assert pool.give(kv) and not pool.give(kv)
    assert (pool.bytes, pool.num_refused) == (kv.numel() * kv.element_size(), 4)
    pool.check_integrity()
    first = pool.take(tuple(kv.shape), kv.dtype, "cpu")  # type: ignore[arg-type]
    second = pool.take(tuple(kv.shape), kv.dtype, "cpu")  # type: ignore[arg-type]
    assert first.data_ptr() == kv.data_ptr() and second.data_ptr() != kv.data_ptr()
    assert (pool.num_reused, pool.num_allocated, pool.bytes) == (1, 1, 0)
    pool.check_integrity()


def test_the_pool_counts_holders_itself_not_with_torchs_private_use_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pooling works whatever torch's private storage use count says (or whether it exists), and a
    snapshot taken from a state (what a cache entry holds) keeps its bits while the state's buffer is
    lent to another session and overwritten."""

    def private(*args: object) -> int:
        raise AssertionError("torch's private storage use count was asked")

    monkeypatch.setattr(torch._C, "_storage_Use_Count", private, raising=False)
    pool = KVPool()
    st = _filled(40, 64, 1)
    snap = st.snapshot()
    kept = snap.restore(40, 0).kv.clone()
    assert pool.give(st.kv)
    other = pool.take(tuple(st.kv.shape), st.kv.dtype, "cpu")  # type: ignore[arg-type]
    assert other.data_ptr() == st.kv.data_ptr()
    other.fill_(9.0)  # another tenant's session writes its KV there
    assert torch.equal(snap.restore(40, 0).kv, kept)
    pool.check_integrity()
    root = Path(prefixserve.__file__).parent
    private_uses = [str(p.relative_to(root)) for p in root.rglob("*.py")
                    if any(name in p.read_text() for name in ("_storage_Use_Count", "_use_count(", "._cdata"))]
    assert private_uses == []


def test_sizes_match_within_slack_and_the_pool_is_bounded() -> None:
    one = 2 * 2 * 3 * 8 * 2  # bytes per token
    pool = KVPool(max_bytes=3 * 512 * one)
    for _ in range(4):
        pool.give(torch.empty(2, 2, 3, 512, 8, dtype=torch.bfloat16))
    assert pool.bytes == 3 * 512 * one  # the oldest went
    assert pool.take((2, 2, 3, 2048, 8), torch.bfloat16, "cpu").shape[3] == 2048  # none big enough: new
    assert pool.take((2, 2, 3, 64, 8), torch.bfloat16, "cpu").shape[3] == 64  # far too big to lend: new
    assert pool.take((2, 2, 3, 480, 8), torch.bfloat16, "cpu").shape[3] == 512  # within the slack
    assert pool.take((2, 2, 3, 512, 8), torch.float32, "cpu").dtype == torch.float32
    assert pool.num_reused == 1
    pool.check_integrity()


def test_trim_drops_the_oldest_to_a_limit() -> None:
    one = 2 * 2 * 3 * 8 * 2 * 64  # bytes of a 64-token buffer
    pool = KVPool()
    bufs = [torch.empty(2, 2, 3, 64, 8, dtype=torch.bfloat16) for _ in range(3)]
    for b in bufs:
        pool.give(b)
    del b
    pool.trim(2 * one + 1)
    assert pool.bytes == 2 * one
    assert pool.take((2, 2, 3, 64, 8), torch.bfloat16, "cpu").data_ptr() in {bufs[1].data_ptr(), bufs[2].data_ptr()}
    pool.trim(-5)
    assert pool.bytes == 0


def test_a_state_grows_to_its_sessions_reservation_not_past_it() -> None:
    """Growth doubles (few copies as a reply lengthens) but stops at `grow_limit`, the prompt +
    max_tokens admission reserved: a 3,000-token prompt with max_tokens 1,024 grew to a 6,528-token
    buffer, 62% past what --max-session-bytes counted for it. A state without a limit doubles as before."""
    shape = (2, 2, 1, 8)
    bounded, free = (SessionState.empty(shape, torch.float32, "cpu", capacity=3264) for _ in range(2))
    bounded.grow_limit = 4024
    for st in (bounded, free):
        st.num_tokens = 3264
        st.reserve(3265)
    assert bounded.capacity == 4032 and free.capacity == 6528  # 4,024 rounded up to the 32-key block
    bounded.num_tokens = 4024
    bounded.reserve(4100)  # past the limit (a turn re-encoded longer than sampled): what it needs
    assert bounded.capacity == 4128
    assert bounded.clone().grow_limit == 4024
