"""KV buffers of finished sessions are reused (runner/state.py KVPool): a reused buffer never leaks
old contents into a session, a buffer something still views is never reused, the pool is bounded."""

from __future__ import annotations

import torch

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


def test_a_buffer_with_a_live_view_is_not_kept() -> None:
    pool = KVPool()
    kv = torch.zeros(2, 2, 3, BLOCK, 8)
    view = kv[0]
    pool.give(kv)
    assert pool.bytes == 0
    del view
    pool.give(kv)
    assert pool.bytes == kv.numel() * kv.element_size()


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
