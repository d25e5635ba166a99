"""The disk tier with a fake codec (no model): write-through, restart, fingerprint, corruption,
LRU budget and flush, with exact file counts and bytes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cache_fakes import NS_A, NS_A_SALT, NS_B

from prefixserve.cache.disk import DiskTier
from prefixserve.cache.disk_format import DIGEST_BYTES
from prefixserve.cache.tier import Loaded, LoadFailed
from prefixserve.types import FlushScope

SYS = tuple(range(100, 140))


@dataclass(frozen=True)
class Blob:
    data: bytes
    has_logits: bool = True


class BlobCodec:
    def encode(self, state: Blob) -> tuple[dict[str, Any], bytes]:
        return {"len": len(state.data)}, state.data

    def decode(self, meta: dict[str, Any], payload: memoryview, num_tokens: int) -> Blob:
        assert meta["len"] == len(payload)
        return Blob(bytes(payload))


def tier(path: Path, max_bytes: int = 1 << 20, fingerprint: str = "fp-1", runtime: str = "0.1.0") -> DiskTier:
    return DiskTier(str(path), max_bytes, fingerprint, runtime, BlobCodec())


def put(t: DiskTier, ns: Any, key: tuple[int, ...], data: bytes) -> None:
    assert t.offer(ns, key, Blob(data))
    assert t.wait_idle(10)
    t.check_integrity()


def files(path: Path) -> list[str]:
    return sorted(os.listdir(path))


def load(t: DiskTier, ns: Any, prompt: tuple[int, ...]) -> Loaded | LoadFailed | None:
    hit = t.lookup(ns, prompt)
    return None if hit is None else t.load(hit).result(10)


def test_write_through_restart_and_isolation(tmp_path: Path) -> None:
    t = tier(tmp_path)
    put(t, NS_A, SYS, b"x" * 1000)
    put(t, NS_A, SYS, b"x" * 1000)  # already on disk: not written twice
    assert len(files(tmp_path)) == 1 and t.stats()["disk_writes"] == 1
    size = os.path.getsize(tmp_path / files(tmp_path)[0])
    assert t.stats()["disk_bytes"] == size
    t.close()

    t = tier(tmp_path)  # a restart: the index is rebuilt from the files
    got = load(t, NS_A, SYS + (1, 2))
    assert isinstance(got, Loaded) and got.token_ids == SYS and got.state == Blob(b"x" * 1000)
    assert load(t, NS_B, SYS + (1, 2)) is None  # another tenant
    assert load(t, NS_A_SALT, SYS + (1, 2)) is None  # another salt
    stats = t.stats()
    assert (stats["disk_loads"], stats["disk_hits"], stats["disk_lookups"]) == (1, 1, 3)
    t.close()


@pytest.mark.parametrize("fingerprint,runtime", [("fp-2", "0.1.0"), ("fp-1", "0.2.0")])  # model/dtype/kernel; version
def test_another_fingerprint_or_runtime_is_removed_never_served(
    tmp_path: Path, fingerprint: str, runtime: str, caplog: pytest.LogCaptureFixture
) -> None:
    t = tier(tmp_path)
    put(t, NS_A, SYS, b"x" * 10)
    put(t, NS_B, SYS, b"y" * 10)
    t.close()
    t = tier(tmp_path, fingerprint=fingerprint, runtime=runtime)
    assert t.lookup(NS_A, SYS + (1,)) is None and t.lookup(NS_B, SYS + (1,)) is None
    assert files(tmp_path) == [] and t.stats()["disk_stale_files"] == 2
    assert "removed 2 files of another model" in caplog.text
    t.close()


@pytest.mark.parametrize("damage", ["bitflip", "truncate_live", "truncate", "torn"])
def test_corrupt_files_are_dropped_and_counted(tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    t = tier(tmp_path)
    put(t, NS_A, SYS, b"y" * 4000)
    (name,) = files(tmp_path)
    path = tmp_path / name
    raw = bytearray(path.read_bytes())
    if damage in ("bitflip", "truncate_live"):  # after the scan: only the checksum can tell, at load time
        if damage == "bitflip":
            raw[-DIGEST_BYTES - 100] ^= 0x01
        path.write_bytes(bytes(raw if damage == "bitflip" else raw[: len(raw) - 1000]))
        got = load(t, NS_A, SYS + (1,))
        assert isinstance(got, LoadFailed) and "checksum" in got.reason
        assert t.lookup(NS_A, SYS + (1,)) is None and files(tmp_path) == []
        assert t.stats()["disk_corrupt_files"] == 1 and t.stats()["disk_load_failures"] == 1
        assert f"dropping {name}" in caplog.text
        t.check_integrity()
    else:
        t.close()
        if damage == "truncate":
            path.write_bytes(bytes(raw[: len(raw) // 2]))
        else:  # a write killed before its rename leaves only the temporary file
            path.rename(str(path) + ".tmp")
        t = tier(tmp_path)
        assert files(tmp_path) == [] and t.lookup(NS_A, SYS + (1,)) is None
        assert t.stats()["disk_corrupt_files"] == (1 if damage == "truncate" else 0)
        assert (f"dropping {name}" in caplog.text) == (damage == "truncate")
    t.close()


def test_disk_budget_is_lru(tmp_path: Path) -> None:
    a, b, c = (1, *SYS), (2, *SYS), (3, *SYS)  # no common prefix: no truncated hits between them
    t = tier(tmp_path, max_bytes=3000)  # files of 1,480 bytes: two fit
    put(t, NS_A, a, b"a" * 1000)
    put(t, NS_A, b, b"b" * 1000)
    assert t.lookup(NS_A, a + (9,)) is not None  # a becomes most recently used
    put(t, NS_A, c, b"c" * 1000)  # evicts b
    assert t.lookup(NS_A, b + (9,)) is None
    assert t.lookup(NS_A, a + (9,)) is not None and t.lookup(NS_A, c + (9,)) is not None
    assert len(files(tmp_path)) == 2 and t.stats()["disk_evictions"] == 1
    assert t.stats()["disk_bytes"] == 2 * 1480
    t.close()


def test_flush_deletes_the_files_of_the_selected_namespaces(tmp_path: Path) -> None:
    t = tier(tmp_path)
    put(t, NS_A, SYS, b"a" * 100)
    put(t, NS_A_SALT, SYS, b"s" * 100)
    put(t, NS_B, SYS, b"b" * 100)
    sizes = sorted(os.path.getsize(tmp_path / f) for f in files(tmp_path))
    result = t.flush(FlushScope("tenant-a", "salt-1"))
    assert result.num_entries == 1 and result.num_bytes == sizes[0]
    assert t.lookup(NS_A_SALT, SYS + (1,)) is None and t.lookup(NS_A, SYS + (1,)) is not None
    assert t.flush(FlushScope("tenant-a")).num_entries == 1
    assert len(files(tmp_path)) == 1 and t.lookup(NS_B, SYS + (1,)) is not None
    t.check_integrity()
    t.close()
    t = tier(tmp_path)  # forgotten across a restart too
    assert t.lookup(NS_A, SYS + (1,)) is None and t.lookup(NS_B, SYS + (1,)) is not None
    put(t, NS_A, SYS, b"a" * 100)
    result = t.flush(FlushScope())  # the admin's "all": every tenant
    assert result.num_entries == 2 and files(tmp_path) == [] and t.stats()["disk_bytes"] == 0
    t.check_integrity()
    t.close()


def test_the_same_key_again_keeps_one_file(tmp_path: Path) -> None:
    t = tier(tmp_path)
    assert t.offer(NS_A, SYS, Blob(b"b" * 100, has_logits=False)) and t.wait_idle(10)  # a boundary entry
    put(t, NS_A, SYS, b"f" * 100)  # the full prompt with logits: replaces it, same file name
    put(t, NS_A, SYS, b"g" * 100)  # again (RAM evicted and re-inserted it): not rewritten
    assert len(files(tmp_path)) == 1 and t.stats()["disk_writes"] == 2
    got = load(t, NS_A, SYS)  # the whole prompt: only an entry with logits serves it
    assert isinstance(got, Loaded) and got.state == Blob(b"f" * 100)
    t.check_integrity()
    t.close()


def test_the_fingerprint_separates_model_dtype_kernel_and_padding(tmp_path: Path) -> None:
    """The fingerprint the server gives its lower tiers (engine.tier_fingerprint) changes with each
    choice that changes a state's bits (docs/cache.md, "File format"), so a file written under one
    is removed, never served, under another."""
    from types import SimpleNamespace

    import torch

    from prefixserve.engine import tier_fingerprint
    from prefixserve.models.decoder import Decoder
    from prefixserve.models.layers import TilePlan

    def decoder(dtype: torch.dtype = torch.bfloat16, tiles: TilePlan | None = None, int4: bool = False) -> Decoder:
        embed = torch.zeros(4, 8, dtype=dtype)
        arch: Any = SimpleNamespace(rope_theta=10000.0, head_dim=8)
        d = Decoder(arch, embed, [], embed[0], embed, tiles or TilePlan())
        d.int4_decode = int4
        return d

    weights, other_weights = tmp_path / "a.gguf", tmp_path / "b.gguf"
    weights.write_bytes(b"weights of model a")
    other_weights.write_bytes(b"weights of model b")
    fp = tier_fingerprint(str(weights), decoder(), "cpu")
    assert fp == tier_fingerprint(str(weights), decoder(), "cpu")  # a restart of the same server
    others = {
        "model": tier_fingerprint(str(other_weights), decoder(), "cpu"),
        "dtype": tier_fingerprint(str(weights), decoder(torch.float32), "cpu"),
        "padding": tier_fingerprint(str(weights), decoder(tiles=TilePlan(32, 16)), "cpu"),
        "lm_head padding": tier_fingerprint(str(weights), decoder(tiles=TilePlan(64, 8)), "cpu"),
        "decode kernel": tier_fingerprint(str(weights), decoder(int4=True), "cpu"),
    }
    assert len({fp, *others.values()}) == 1 + len(others), others
    cache_dir = tmp_path / "cache"
    for what, other in others.items():
        t = tier(cache_dir, fingerprint=fp)
        put(t, NS_A, SYS, b"x" * 10)
        t.close()
        t = tier(cache_dir, fingerprint=other)
        assert t.lookup(NS_A, SYS + (1,)) is None, what
        assert files(cache_dir) == [] and t.stats()["disk_stale_files"] == 1, what
        t.close()
