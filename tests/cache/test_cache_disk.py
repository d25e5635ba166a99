"""The disk tier with a fake codec (no model): write-through, restart, fingerprint, corruption,
LRU budget and flush, with exact file counts and bytes."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cache_fakes import NS_A, NS_A_SALT, NS_B
from fingerprints import variants

from prefixserve.cache.disk import DiskTier
from prefixserve.cache.disk_format import DIGEST_BYTES, read_header
from prefixserve.cache.disk_io import KEY_FILE
from prefixserve.cache.tier import Loaded, LoadFailed, TierKeys
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
    """The tier's files, less its key (disk_io.KEY_FILE)."""
    return sorted(n for n in os.listdir(path) if n != KEY_FILE)


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


def test_the_fingerprint_separates_model_and_every_part_of_the_runtime(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fingerprint the server gives its lower tiers (engine.tier_fingerprint) changes with the
    model and with each part of the runtime's identity (runner/identity.py: dtype, kernels, padding,
    torch's version and build, our code, the CPU's model and flags, the native build, threads,
    version; docs/cache.md, "File format"), so a file written under one is removed, never served,
    under another."""
    fp, others = variants(tmp_path, monkeypatch)
    cache_dir = tmp_path / "cache"
    for what, other in others.items():
        t = tier(cache_dir, fingerprint=fp)
        put(t, NS_A, SYS, b"x" * 10)
        t.close()
        t = tier(cache_dir, fingerprint=other)
        assert t.lookup(NS_A, SYS + (1,)) is None, what
        assert files(cache_dir) == [] and t.stats()["disk_stale_files"] == 1, what
        t.close()


def _unkeyed_names(ns: Any, token_ids: tuple[int, ...]) -> tuple[str, str, str]:
    """(tenant digest, namespace digest, token digest) as files were named before names were keyed:
    what anyone could compute for a guessed tenant and prompt."""
    def d(kind: str, value: str) -> str:
        return hashlib.sha256(f"prefixserve:{kind}\0{value}".encode()).hexdigest()[:32]

    tenant = d("tenant", ns.tenant_id)
    space = hashlib.sha256(f"{d('model', ns.model_id)}|{tenant}|{d('salt', ns.cache_salt)}".encode()).hexdigest()[:32]
    return tenant, space, hashlib.blake2b(array("i", token_ids).tobytes(), digest_size=16).hexdigest()


def test_file_names_are_keyed_by_the_directory_key_or_the_deployment_secret(tmp_path: Path) -> None:
    """A file's name and header reveal nothing testable about its tenant or prompt without the key:
    the unkeyed digests of the known tokens and tenant appear nowhere, two directories name the same
    prompt differently, and a file named under another key is removed at start. Under one deployment
    secret every directory names it alike."""
    a, b = tmp_path / "a", tmp_path / "b"
    for path in (a, b):
        t = tier(path)
        put(t, NS_A, SYS, b"x" * 100)
        t.close()
    (name_a,), (name_b,) = files(a), files(b)
    assert name_a != name_b
    with open(a / name_a, "rb") as f:
        header = read_header(f, os.path.getsize(a / name_a))
    for unkeyed in _unkeyed_names(NS_A, SYS):
        assert unkeyed not in name_a and unkeyed not in repr(header)
    key_file = a / KEY_FILE
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600 and len(key_file.read_bytes()) == 32

    t = tier(a)  # a restart reads the key again: the file is found and served
    assert isinstance(load(t, NS_A, SYS + (1,)), Loaded) and files(a) == [name_a]
    t.close()
    shutil.copy(b / name_b, a / name_b)  # b's file, named under b's key
    t = tier(a)
    assert files(a) == [name_a] and t.stats()["disk_stale_files"] == 1
    t.close()

    keys = TierKeys.from_secret(b"deployment-secret-0123456789")
    names = []
    for path in (tmp_path / "c", tmp_path / "d"):
        t = DiskTier(str(path), 1 << 20, "fp-1", "0.1.0", BlobCodec(), keys)
        put(t, NS_A, SYS, b"x" * 100)
        names.append(files(path))
        t.close()
    assert names[0] == names[1] and names[0] not in ([name_a], [name_b])
