"""Exactness of hybrid states (docs/hybrid.md): resuming from any snapshot (grid positions, odd
positions, full-prompt entries, a full-prompt entry's recurrent checkpoints found by the cache)
equals a run from scratch bit for bit (torch.equal on logits, the same 32 greedy tokens) for 16
prompts, alone and batched with 1, 3 and 7 others, in fp32 and bf16; decoded states equal prefilled ones; snapshots are deep copies; the
cache never truncates a hybrid snapshot beyond its checkpoints."""

from __future__ import annotations

import itertools

import pytest
import torch

from prefixserve.cache import Hit, PrefixCache
from prefixserve.config import CacheConfig
from prefixserve.models.hybrid.gated_delta import CELL
from prefixserve.runner import ModelRunner, StepItem
from prefixserve.runner.hybrid_state import GRID, HybridSnapshot, HybridState, checkpoint_positions
from prefixserve.runner.pieces import PieceStore
from prefixserve.types import Namespace
from tests.conftest import TEST_DEVICE
from tests.hybrid.tiny import VOCAB, make_model
from tests.runner.test_exactness import greedy_from

torch.set_num_threads(1)
GREEDY = 32  # greedy tokens compared after every resume (issue #14: >= 16 prompts x 32 tokens)
# 16 prompts: short and long, on, just before and just after cell edges (CELL = 64)
LENGTHS = (33, 64, 65, 70, 96, 127, 128, 129, 150, 191, 192, 193, 203, 256, 257, 300)


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def runner(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen35x"))
    make_model(folder, layers=4, seed=7, with_tokenizer=False)
    from prefixserve.models.layers import TilePlan
    from prefixserve.models.loaders.hybrid_folder import HybridHFModel, build_hybrid

    dtype = torch.float32 if request.param == "fp32" else torch.bfloat16
    dec = build_hybrid(HybridHFModel(folder), dtype, TEST_DEVICE, TilePlan())
    return ModelRunner(dec, 1)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB - 3, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill(runner: ModelRunner, state, ids: list[int], cuts: tuple[int, ...] = ()) -> None:
    """Feed ids (appending to state) in chunks ending at `cuts` (relative to state start) and at 256s."""
    base = state.num_tokens
    edges = sorted({c for c in cuts if 0 < c < len(ids)} | set(range(256, len(ids), 256)) | {len(ids)})
    start = 0
    for end in edges:
        runner.step([StepItem(state, ids[start:end], want_logits=end == len(ids))])
        start = end
    assert state.num_tokens == base + len(ids)


def _greedy(runner: ModelRunner, state, n: int = GREEDY) -> list[int]:
    out = []
    for _ in range(n):
        t = int(state.logits.argmax())
        out.append(t)
        runner.step([StepItem(state, [t], decode=True)])
    return out


def _scratch(runner: ModelRunner, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    st = runner.new_state(len(ids) + GREEDY)
    _prefill(runner, st, ids)
    logits = st.logits.clone()
    return logits, _greedy(runner, st)


def test_any_chunking_gives_the_same_bits(runner):
    ids = _prompt(203, 1)
    ref, _ = _scratch(runner, ids)
    for cuts in [(1,), (63,), (64, 128), (5, 6, 70, 150), tuple(range(7, 203, 7)), tuple(range(1, 203))]:
        st = runner.new_state(len(ids))
        _prefill(runner, st, ids, cuts)
        assert torch.equal(st.logits, ref), cuts


@pytest.mark.parametrize("n", LENGTHS)
def test_resume_from_every_grid_snapshot_and_odd_positions(runner, n):
    ids = _prompt(n, n)
    ref_logits, ref_tokens = _scratch(runner, ids)
    depths = sorted(d for d in set(range(CELL, n, CELL)) | {1, 2, 31, 33, 63, 65, n // 2, n - 1} if 0 < d < n)
    # one source fed up to each depth in turn (its chunks end at the depths: any chunking gives the
    # same bits, above), a snapshot taken at each
    src, done, resumed = runner.new_state(n), 0, []
    for d in depths:
        _prefill(runner, src, ids[done:d])
        done = d
        snap = src.snapshot()
        assert isinstance(snap, HybridSnapshot) and not snap.truncatable
        st = snap.restore(d, n - d + GREEDY)
        _prefill(runner, st, ids[d:])
        assert torch.equal(st.logits, ref_logits), d
        resumed.append(st)
    # then the greedy tokens of every resumed state, all decoding together in one batch per token
    # (a batch gives each session its bits alone: test_batch_invariance)
    for toks, d in zip(greedy_from(runner, resumed, GREEDY), depths):
        assert toks == ref_tokens, d


@pytest.mark.parametrize("n", LENGTHS)
def test_full_prompt_entry_gives_the_first_token_with_no_forward(runner, n):
    ids = _prompt(n, 100 + n)
    ref_logits, ref_tokens = _scratch(runner, ids)
    src = runner.new_state(n)
    _prefill(runner, src, ids)
    snap = src.snapshot()
    assert snap.has_logits and torch.equal(snap.logits, ref_logits)
    st = snap.restore(n, GREEDY)
    assert _greedy(runner, st) == ref_tokens


def test_decoded_state_equals_prefilled_state(runner):
    ids = _prompt(100, 5)
    st = runner.new_state(140)
    _prefill(runner, st, ids)
    toks = _greedy(runner, st, 30)  # crosses the cell edge at 128
    fresh = runner.new_state(140)
    _prefill(runner, fresh, ids + toks)
    st_logits = st.logits
    assert st.num_tokens == fresh.num_tokens
    assert torch.equal(st.kv[:, :, :, : st.num_tokens], fresh.kv[:, :, :, : fresh.num_tokens])
    for a, b in ((st.rec.conv, fresh.rec.conv), (st.rec.cell, fresh.rec.cell), (st.rec.delta, fresh.rec.delta)):
        assert torch.equal(a, b)
    assert torch.equal(st_logits, fresh.logits)


@pytest.mark.parametrize("others", [1, 3, 7])
@pytest.mark.parametrize("n", LENGTHS)
def test_batch_invariance(runner, others, n):
    """A session resumed from a grid snapshot gets the same logits and greedy tokens alone and beside
    `others` sessions, some mid-prefill, some decoding, all at other positions of their cells."""
    ids = _prompt(n, 9 + n)
    ref_logits, ref_tokens = _scratch(runner, ids)
    d = (n // 2) // GRID * GRID  # the deepest grid snapshot at or below half the prompt (0: none)
    src = runner.new_state(n)
    if d:
        _prefill(runner, src, ids[:d])
    st = src.snapshot().restore(d, n - d + GREEDY) if d else runner.new_state(n + GREEDY)
    mates = []
    for j in range(others):
        m = runner.new_state(400)
        _prefill(runner, m, _prompt(17 + 29 * j, 50 + j))
        mates.append(m)
    # the rest in up to 3 chunks, each step batched with the others (decode rows and prefill chunks)
    cuts = sorted({d, *(c for c in (d + 17, (d + n) // 2 + 5) if d < c < n), n})
    for a, b in itertools.pairwise(cuts):
        items = [StepItem(st, ids[a:b], want_logits=b == n)]
        for j, m in enumerate(mates):
            if j % 2:
                items.append(StepItem(m, [int(m.logits.argmax())] if m.logits is not None else [1], decode=True))
            else:
                items.append(StepItem(m, _prompt(11 + j, 70 + j + a)))
        runner.step(items)
    assert torch.equal(st.logits, ref_logits)
    got = []
    for _ in range(GREEDY):
        t = int(st.logits.argmax())
        got.append(t)
        items = [StepItem(st, [t], decode=True)] + [StepItem(m, [3 + j], decode=True) for j, m in enumerate(mates)]
        runner.step(items)
    assert got == ref_tokens


def test_snapshot_and_restore_are_deep_copies_and_bytes_count_both(runner):
    ids = _prompt(90, 11)
    st = runner.new_state(90)
    _prefill(runner, st, ids)
    assert isinstance(st, HybridState)
    kv_bytes = st.kv.numel() * st.kv.element_size()
    rec_bytes = sum(t.numel() * t.element_size() for t in (st.rec.conv, st.rec.cell, st.rec.delta))
    assert st.nbytes == kv_bytes + rec_bytes + st.logits.numel() * 4
    snap = st.snapshot()
    cell_unused = (CELL - 90 % CELL) * st.rec.cell[:, :1].numel() * 4  # a snapshot keeps the cell rows in use only
    assert snap.nbytes == (st.kv[:, :, :, :90].numel() * st.kv.element_size() + rec_bytes - cell_unused
                           + st.logits.numel() * 4)
    copy = (snap.kv._kv.clone(), snap._rec.clone(), snap.logits.clone())
    r1 = snap.restore(90, 10)
    assert torch.equal(r1.rec.cell, st.rec.cell) and torch.equal(r1.rec.delta, st.rec.delta)  # padded back exactly
    _greedy(runner, r1, 3)  # mutate a restored state
    r1.rec.delta.add_(1.0)
    assert torch.equal(snap.kv._kv, copy[0]) and torch.equal(snap._rec.delta, copy[1].delta)
    assert torch.equal(snap._rec.cell, copy[1].cell) and torch.equal(snap.logits, copy[2])
    st.rec.conv.add_(1.0)  # mutating the source does not reach the snapshot either
    assert torch.equal(snap._rec.conv, copy[1].conv)
    with pytest.raises(ValueError):
        snap.restore(64, 10)
    with pytest.raises(ValueError):
        st.snapshot(64)
    with pytest.raises(ValueError):
        st.truncate(64)


def test_the_cache_never_truncates_a_hybrid_snapshot(runner):
    ids = _prompt(150, 12)
    st = runner.new_state(150)
    _prefill(runner, st, ids[:100])
    cache = PrefixCache(CacheConfig(max_bytes=1 << 30))
    ns = Namespace("m", "t", "")
    snap = PieceStore().snapshot(st, ids[:100], ns)  # stored whole, one private piece
    assert isinstance(snap, HybridSnapshot)
    cache.insert(ns, tuple(ids[:100]), snap)
    assert not isinstance(cache.lookup(ns, ids[:80] + [1, 2, 3]), Hit)  # shares 80 of its 100 tokens: no use
    same = cache.lookup(ns, ids[:100])  # the prompt itself: whole, from its stored logits
    assert snap.has_logits and isinstance(same, Hit) and same.num_cached_tokens == 100
    hit = cache.lookup(ns, ids)  # a longer prompt: exactly its 100 tokens
    assert isinstance(hit, Hit) and hit.num_cached_tokens == 100


@pytest.mark.parametrize("n", [203, 330])
def test_resume_from_the_checkpoints_of_a_full_prompt_entry(runner, n):
    """Prefill stops at the checkpoint positions and keeps them (as the engine does); the full-prompt
    entry then serves, through the cache, each checkpoint to a prompt that diverges just after it,
    and the resumed run equals that prompt's run from scratch."""
    ids = _prompt(n, 200 + n)
    points = checkpoint_positions(n)
    assert points and all(p % GRID == 0 for p in points) and len(points) == (2 if n == 203 else 3)
    st = runner.new_state(n)
    assert isinstance(st, HybridState) and st.checkpoint_positions(n) == points
    start = 0
    for end in [*points, n]:  # chunks end at the checkpoints, where the state keeps them
        _prefill(runner, st, ids[start:end])
        if end in points:
            st.keep_checkpoint()
        start = end
    ns = Namespace("m", "t", "")
    full = PieceStore().snapshot(st, ids, ns)  # the full prompt, with its checkpoints
    assert isinstance(full, HybridSnapshot) and full.resume_points == tuple(points)
    ckpt_bytes = sum(c.nbytes for c in st.checkpoints.values())
    assert all(c.cell.shape[1] == 0 for c in st.checkpoints.values())  # on the grid: no cell rows
    assert full.nbytes == full.kv.nbytes + st.compact_recurrent().nbytes + ckpt_bytes
    cache = PrefixCache(CacheConfig(max_bytes=1 << 30))
    cache.insert(ns, tuple(ids), full)
    for p in points:
        other = ids[: p + 5] + _prompt(40, p)
        hit = cache.lookup(ns, other)
        assert isinstance(hit, Hit) and hit.num_cached_tokens == p, p
        resumed = hit.entry.state.restore(p, len(other) - p + GREEDY)
        assert sorted(resumed.checkpoints) == [q for q in points if q <= p]  # kept, shared
        _prefill(runner, resumed, other[p:])
        ref_logits, ref_tokens = _scratch(runner, other)
        assert torch.equal(resumed.logits, ref_logits), p
        assert _greedy(runner, resumed) == ref_tokens, p
    assert cache.check_integrity() is None


def test_start_up_self_test_accepts_the_hybrid(runner):
    from prefixserve.runner.selftest import self_test

    result = self_test(runner)
    assert result.ok, result.detail


def test_entries_on_one_path_share_their_kv_pieces(runner):
    """A hybrid snapshot's attention KV is pieces like any KV (runner/pieces.py): the entry at 150
    tokens holds the 100-token entry's pieces, and owns only its suffix and its recurrent state."""
    ids = _prompt(150, 13)
    ns = Namespace("m", "t", "")
    store = PieceStore()
    st = runner.new_state(150)
    _prefill(runner, st, ids[:100])
    short = store.snapshot(st, ids[:100], ns)
    _prefill(runner, st, ids[100:])
    long = store.snapshot(st, ids, ns, splits=[100])
    assert isinstance(long, HybridSnapshot) and store.num_shared == 2  # [0, 64) and [64, 100)
    shared = {k for k, _ in short.storage()} & {k for k, _ in long.storage()}
    assert len(shared) == 2
    resumed = long.restore(150, GREEDY)
    ref_logits, ref_tokens = _scratch(runner, ids)
    assert torch.equal(resumed.logits, ref_logits) and _greedy(runner, resumed) == ref_tokens
    cache = PrefixCache(CacheConfig(max_bytes=1 << 30))
    cache.insert(ns, tuple(ids[:100]), short)
    cache.insert(ns, tuple(ids), long)
    assert cache.stats().num_bytes < short.nbytes + long.nbytes
    assert cache.check_integrity() is None
