"""Hybrid (snapshot-only) entries through the lower tiers (docs/cache.md "Tiers", docs/hybrid.md): the
codec's bit-exact round trip of attention KV, recurrent state, checkpoints and logits; the disk index
serving a hybrid file only at its own length or a resume point, across a restart; and engines over a
tiny hybrid model that serve a prompt from disk or Redis with the bits of a run from scratch, and a
partial prompt from its deepest checkpoint."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from prefixserve import __version__
from prefixserve.cache import Hit, PrefixCache
from prefixserve.cache.disk import DiskTier
from prefixserve.cache.shared import SharedTier
from prefixserve.cache.tier import Loaded, usable_len
from prefixserve.config import CacheConfig, EngineConfig, SharedTierConfig
from prefixserve.engine import EngineCore
from prefixserve.models import load_model
from prefixserve.models.hybrid.decoder import RecurrentState
from prefixserve.runner import ModelRunner
from prefixserve.runner.codec import SnapshotCodec
from prefixserve.runner.hybrid_state import HybridSnapshot, checkpoint_positions
from prefixserve.runner.pieces import same_bits
from prefixserve.runner.state import KVPiece, KVSnapshot
from prefixserve.types import Delta, Namespace, Request, SamplingParams, Usage
from tests.conftest import TEST_DEVICE
from tests.hybrid.tiny import make_model

torch.set_num_threads(1)
NS = Namespace("tiny", "tenant-a")
SYSTEM = "You are a terse assistant for the Hybrid Test Suite. " * 4


def rec(layers: int, rows: int, seed: int) -> RecurrentState:
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(layers, 3, 24, generator=g).to(torch.bfloat16)
    return RecurrentState(conv, torch.randn(layers, rows, 40, generator=g), torch.randn(layers, 4, 16, 16, generator=g))


def synthetic(n: int = 200, points: tuple[int, ...] = (64, 128), logits: bool = True) -> HybridSnapshot:
    """A hybrid snapshot of n tokens: bf16 KV in two pieces (with -0.0 and NaN bits), fp32 logits."""
    kv = torch.randn(1, 2, 2, n, 8).to(torch.bfloat16)
    kv[0, 0, 0, 0, :2] = torch.tensor([-0.0, float("nan")])
    pieces = [KVPiece(0, 64, ("a", 0), kv[:, :, :, :64].clone()), KVPiece(64, n, ("a", 64), kv[:, :, :, 64:].clone())]
    lg = torch.randn(17) if logits else None
    return HybridSnapshot.from_kv(KVSnapshot.from_pieces(pieces, lg), rec(3, n % 64, 1),
                                  {p: rec(3, p % 64, p) for p in points})


def assert_same(a: HybridSnapshot, b: HybridSnapshot) -> None:
    assert (a.num_tokens, a.resume_points, a.has_logits, a.nbytes) == (b.num_tokens, b.resume_points, b.has_logits,
                                                                        b.nbytes)
    assert [(p.start, p.end) for p in a.kv.pieces] == [(p.start, p.end) for p in b.kv.pieces]
    assert all(same_bits(p.kv, q.kv) for p, q in zip(a.kv.pieces, b.kv.pieces, strict=True))
    assert (a.logits is None) == (b.logits is None)
    assert a.logits is None or b.logits is None or same_bits(a.logits, b.logits)
    for r, s in zip([a.recurrent, *a.checkpoints.values()], [b.recurrent, *b.checkpoints.values()], strict=True):
        assert all(same_bits(x, y) for x, y in ((r.conv, s.conv), (r.cell, s.cell), (r.delta, s.delta)))


@pytest.mark.parametrize("logits", [True, False])
def test_codec_round_trips_a_hybrid_snapshot_bit_for_bit(logits: bool) -> None:
    snap = synthetic(logits=logits)
    meta, payload = SnapshotCodec().encode(snap)
    back = SnapshotCodec().decode(meta, memoryview(bytearray(payload)), 200)
    assert isinstance(back, HybridSnapshot)
    assert_same(snap, back)
    ptrs = {t.untyped_storage().data_ptr() for r in [back.recurrent, *back.checkpoints.values()]
            for t in (r.conv, r.cell, r.delta) if t.numel()}
    assert len(ptrs) == 7  # own memory each: no storage key shared by accident, no file buffer kept alive
    for bad in ({**meta, "points": [64]}, {**meta, "points": [128, 64]}, {**meta, "kind": "mamba"}):
        with pytest.raises(ValueError):
            SnapshotCodec().decode(bad, memoryview(bytearray(payload)), 200)
    with pytest.raises(ValueError):
        SnapshotCodec().decode(meta, memoryview(bytearray(payload[:-4])), 200)
    kv_meta, kv_payload = SnapshotCodec().encode(snap.kv)  # the KV part alone is no hybrid file
    assert "kind" not in kv_meta and isinstance(SnapshotCodec().decode(kv_meta, memoryview(kv_payload), 200),
                                                KVSnapshot)


def test_usable_len_respects_snapshot_only_semantics() -> None:
    snap = synthetic(logits=False)
    assert [usable_len(snap, c, 300) for c in (50, 64, 127, 128, 199, 200)] == [0, 64, 64, 128, 128, 200]
    assert usable_len(snap, 200, 200) == 128  # its own length equal to the prompt's needs logits
    assert usable_len(synthetic(), 200, 200) == 200
    assert usable_len(snap.kv, 150, 300) == 150  # a KV entry truncates anywhere


def test_disk_tier_serves_a_hybrid_file_only_at_its_length_or_resume_points(tmp_path: Path) -> None:
    snap, key = synthetic(), tuple(range(1000, 1200))
    disk = DiskTier(str(tmp_path), 1 << 30, "hybrid-fp", __version__, SnapshotCodec())
    assert disk.offer(NS, key, snap) and disk.wait_idle(30)
    for restarted in (False, True):
        if restarted:
            disk.close()
            disk = DiskTier(str(tmp_path), 1 << 30, "hybrid-fp", __version__, SnapshotCodec())
        served = {}
        for common in (40, 100, 150, 199):
            hit = disk.lookup(NS, key[:common] + (7,) * 50)
            served[common] = None if hit is None else hit.num_cached_tokens
        assert served == {40: None, 100: 64, 150: 128, 199: 128}  # never a truncation between points
        hit = disk.lookup(NS, key)
        assert isinstance(hit, Hit) and hit.num_cached_tokens == 200 and hit.entry.points == (64, 128)
        loaded = disk.load(hit).result(30)
        assert isinstance(loaded, Loaded) and isinstance(loaded.state, HybridSnapshot)
        assert_same(snap, loaded.state)
    disk.close()
    other = DiskTier(str(tmp_path), 1 << 30, "kv-fp", __version__, SnapshotCodec())  # another fingerprint
    assert other.stats()["disk_stale_files"] == 1 and other.lookup(NS, key) is None
    other.close()


def test_redis_uses_a_marked_hybrid_entry_only_where_a_resume_point_serves_enough() -> None:
    from tests.helpers.redis_proc import RedisServer

    snap, key = synthetic(), tuple(range(1000, 1200))
    with RedisServer() as server:
        tier = SharedTier(SharedTierConfig(server.url, b"hybrid-test-secret-0123"), "fp", __version__, SnapshotCodec())
        assert tier.offer(NS, key, snap) and tier.wait_idle(30)
        # sharing 100 tokens: the marker at 64 names the entry, which serves 64 (its checkpoint), not 100
        assert not isinstance(tier.find(NS, key[:100] + (7,) * 50, 100).result(30), Loaded)  # type: ignore[union-attr]
        got = tier.find(NS, key[:100] + (7,) * 50, 40).result(30)  # type: ignore[union-attr]
        assert isinstance(got, Loaded) and got.token_ids == key and isinstance(got.state, HybridSnapshot)
        assert_same(snap, got.state)
        got = tier.find(NS, key[:150] + (7,) * 50, 100).result(30)  # type: ignore[union-attr]
        assert isinstance(got, Loaded) and usable_len(got.state, 150, 200) == 128
        tier.close()


# ---- engines over a tiny hybrid model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen35t"))
    make_model(folder, layers=4, seed=23)
    return load_model(folder, torch.float32, TEST_DEVICE)


def make_core(model, out: dict[str, list[Delta]], **tiers) -> EngineCore:
    return EngineCore(ModelRunner(model.decoder, 1), model.tokenizer, PrefixCache(CacheConfig(max_bytes=1 << 30)),
                      EngineConfig(prefill_chunk_tokens=64, max_batch_tokens=128, offer_finished_turns=False), 2048,
                      lambda rid, d: out.setdefault(rid, []).append(d), **tiers)


def serve(core: EngineCore, out: dict[str, list[Delta]], ids: list[int]) -> tuple[list[int], Usage]:
    rid = uuid.uuid4().hex
    core.add(Request(rid, NS, tuple(ids), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
    while core.has_work():
        core.step()
    deltas = out[rid]
    assert deltas[-1].usage is not None
    return [t for d in deltas for t in d.token_ids], deltas[-1].usage


def disk_tier(path: Path, fp: str) -> Callable[[], dict]:
    return lambda: {"disk": DiskTier(str(path), 1 << 30, fp, __version__, SnapshotCodec(TEST_DEVICE))}


def redis_tier(url: str, fp: str) -> Callable[[], dict]:
    cfg = SharedTierConfig(url, b"hybrid-test-secret-0123")
    return lambda: {"shared": SharedTier(cfg, fp, __version__, SnapshotCodec(TEST_DEVICE))}


def close(core: EngineCore) -> None:
    for tier in (core.disk, core.shared):
        if tier is not None:
            assert tier.wait_idle(30)
            tier.close()


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_hybrid_prompt_from_a_lower_tier_is_bitwise_a_run_from_scratch(model, tier: str, tmp_path: Path) -> None:
    fp = model.decoder.kernel_fingerprint()
    assert "delta=cell" in fp  # a hybrid decoder's files and values are never a KV model's
    if tier == "redis":
        from tests.helpers.redis_proc import RedisServer

        server = RedisServer().__enter__()
        tiers = redis_tier(server.url, fp)
    else:
        tiers = disk_tier(tmp_path, fp)
    try:
        tok = model.tokenizer
        p = tok.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Alpha question?"}])
        q = tok.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Bravo, say more."}])
        common = next(i for i, (a, b) in enumerate(zip(p, q, strict=False)) if a != b)
        point = max(c for c in checkpoint_positions(len(p)) if c <= common)
        assert 64 <= point < common < len(p)
        out: dict[str, list[Delta]] = {}
        plain = EngineCore(ModelRunner(model.decoder, 1), model.tokenizer, PrefixCache(CacheConfig(max_bytes=0)),
                           EngineConfig(prefill_chunk_tokens=64, max_batch_tokens=128), 2048,
                           lambda rid, d: out.setdefault(rid, []).append(d))

        cold = make_core(model, out, **tiers())
        ref_p, usage = serve(cold, out, p)
        assert usage.cached_tokens == 0
        close(cold)
        ref = cold.cache.get(NS, p)
        assert ref is not None and ref.points == tuple(checkpoint_positions(len(p)))

        warm = make_core(model, out, **tiers())  # a restart, or another replica: empty RAM
        assert serve(warm, out, p) == (ref_p, Usage(len(p), 6, len(p)))  # the whole prompt from the tier
        got = warm.cache.get(NS, p)
        assert got is not None and isinstance(got.state, HybridSnapshot) and isinstance(ref.state, HybridSnapshot)
        assert_same(ref.state, got.state)  # last logits, attention KV, recurrent state and checkpoints
        warm.cache.check_integrity()
        close(warm)

        part = make_core(model, out, **tiers())
        ref_q, _ = serve(plain, out, q)
        assert serve(part, out, q) == (ref_q, Usage(len(q), 6, point))  # resumed at the checkpoint only
        stats = (part.disk or part.shared).stats()  # type: ignore[union-attr]
        assert stats.get("disk_loads", stats.get("redis_loads")) == 1
        close(part)
    finally:
        if tier == "redis":
            server.__exit__(None, None, None)
