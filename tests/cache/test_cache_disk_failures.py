"""The disk tier on a directory it cannot write (a read-only mount: EROFS), and its files' modes.

A read-only filesystem is simulated by patching the os functions the tier writes with (tests may run
as root, where a chmod'ed directory stops nothing): every create, unlink, rename or chmod under the
directory raises EROFS while `on`, as a read-only mount does, and reads go through."""

from __future__ import annotations

import builtins
import errno
import logging
import os
import stat
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cache_fakes import NS_A, NS_B
from test_cache_disk import SYS, Blob, BlobCodec, files, load, tier

from prefixserve.cache import disk_io
from prefixserve.cache.disk import DiskTier
from prefixserve.cache.tier import Loaded

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class ReadOnly:
    """`directory` behaves as on a read-only mount while `on`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
        self.dir = str(directory)
        self.on = True
        real_open, real_os_open = builtins.open, os.open

        def blocked(path: Any) -> bool:
            return self.on and isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith(self.dir)

        def fail(path: Any) -> None:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

        def open_(file: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
            if blocked(file) and any(c in mode for c in "wax+"):
                fail(file)
            return real_open(file, mode, *a, **k)

        def os_open(path: Any, flags: int, *a: Any, **k: Any) -> int:
            if blocked(path) and flags & WRITE_FLAGS:
                fail(path)
            return real_os_open(path, flags, *a, **k)

        def guard(real: Callable[..., Any]) -> Callable[..., Any]:
            def f(path: Any, *a: Any, **k: Any) -> Any:
                if blocked(path):
                    fail(path)
                return real(path, *a, **k)
            return f

        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(os, "open", os_open)
        for name in ("unlink", "remove", "replace", "rename", "chmod"):
            monkeypatch.setattr(os, name, guard(getattr(os, name)))


def offer_all(t: DiskTier, states: list[Blob]) -> None:
    for i, s in enumerate(states):
        t.offer(NS_A, (i, *SYS), s)  # True or False: accepted then dropped, or refused at once
    assert t.wait_idle(5), "the writer is stuck or dead"


def writer_alive() -> bool:
    return any(th.name == "prefixserve-disk-write" and th.is_alive() for th in threading.enumerate())


def test_a_read_only_directory_neither_kills_the_writer_nor_holds_states(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(disk_io, "WRITE_RETRY_S", 1.0)
    t = tier(tmp_path)
    ro = ReadOnly(monkeypatch, tmp_path)  # after start: an ext4 remounted read-only after errors
    states = [Blob(bytes([i]) * 1000) for i in range(5)]
    refs = [weakref.ref(s) for s in states]
    offer_all(t, states)
    del states
    assert writer_alive()
    s = t.stats()
    assert (s["disk_write_failures"], s["disk_dropped_writes"], s["disk_pending_writes"]) == (1, 4, 0)
    assert (s["disk_writes"], s["disk_writable"]) == (0, 0)
    assert [r() for r in refs] == [None] * 5  # no state kept alive for a write that cannot happen
    assert not t.offer(NS_A, SYS, Blob(b"z"))  # refused while failing: nothing queued
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "EROFS" in warnings[0].getMessage() and warnings[0].exc_info is None

    time.sleep(1.1)  # a retry, still read-only: counted, not logged again (once per kind)
    offer_all(t, [Blob(b"r" * 10)])
    assert t.stats()["disk_write_failures"] == 2
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1

    ro.on = False  # remounted read-write: writes resume within WRITE_RETRY_S
    deadline = time.monotonic() + 5
    while not t.offer(NS_B, SYS, Blob(b"w" * 100)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert t.wait_idle(5)
    s = t.stats()
    assert (s["disk_writes"], s["disk_writable"], s["disk_entries"]) == (1, 1, 1)
    assert "writing to" in caplog.text and "again after 2 failures" in caplog.text
    got = load(t, NS_B, SYS + (1,))
    assert isinstance(got, Loaded) and got.state == Blob(b"w" * 100)
    t.check_integrity()
    t.close(timeout=5)
    assert not writer_alive()


def test_a_failed_write_leaves_no_temporary_file_and_a_full_disk_is_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    t = tier(tmp_path)
    real_fsync = os.fsync

    def full(fd: int) -> None:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    offer_all(t, [Blob(b"x" * 1000)])
    assert files(tmp_path) == [] and t.stats()["disk_write_failures"] == 1
    assert "ENOSPC" in caplog.text and caplog.records[-1].exc_info is None
    t.close(timeout=5)


def test_a_codec_bug_fails_that_write_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Buggy(BlobCodec):
        def encode(self, state: Blob) -> tuple[dict[str, Any], bytes]:
            if state.data == b"bad":
                raise ValueError("cannot encode")
            return super().encode(state)

    t = DiskTier(str(tmp_path), 1 << 20, "fp-1", "0.1.0", Buggy())
    offer_all(t, [Blob(b"bad"), Blob(b"bad")])
    offer_all(t, [Blob(b"good")])  # no back-off: the disk is fine
    s = t.stats()
    assert (s["disk_write_failures"], s["disk_writes"], s["disk_writable"]) == (2, 1, 1)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None  # a bug: its traceback, once
    t.close(timeout=5)


def test_a_server_started_on_a_read_only_directory_serves_what_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    t = tier(tmp_path)
    assert t.offer(NS_A, SYS, Blob(b"kept" * 10)) and t.wait_idle(5)
    t.close()
    (tmp_path / "left.kv.tmp").write_bytes(b"cut short")  # the scan cannot remove it: no matter
    ReadOnly(monkeypatch, tmp_path)
    t = tier(tmp_path)
    assert "cannot write to" in caplog.text and "EROFS" in caplog.text
    got = load(t, NS_A, SYS + (1,))
    assert isinstance(got, Loaded) and got.state == Blob(b"kept" * 10)
    assert not t.offer(NS_A, (7, *SYS), Blob(b"n"))  # not even queued for a while
    s = t.stats()
    assert (s["disk_writable"], s["disk_write_failures"], s["disk_pending_writes"]) == (0, 0, 0)
    t.close(timeout=5)


def test_files_are_private_and_a_shared_directory_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = os.umask(0)  # the most permissive umask: the mode must not depend on it
    try:
        shared = tmp_path / "shared"
        shared.mkdir(mode=0o755)
        os.chmod(shared, 0o755)
        t = tier(shared)
        assert t.offer(NS_A, SYS, Blob(b"secret")) and t.wait_idle(5)
        (name,) = files(shared)
        assert stat.S_IMODE(os.stat(shared / name).st_mode) == 0o600
        t.close()
        assert "has mode 0755" in caplog.text
        assert stat.S_IMODE(os.stat(shared).st_mode) == 0o755  # the operator's directory is theirs

        os.chmod(shared / name, 0o644)  # written by an older version: tightened by the next scan
        caplog.clear()
        os.chmod(shared, 0o700)
        t = tier(shared)
        assert stat.S_IMODE(os.stat(shared / name).st_mode) == 0o600
        assert "has mode" not in caplog.text and "cannot write" not in caplog.text
        t.close()
    finally:
        os.umask(old)
