"""The disk tier through the engine (real model, in process): a restarted engine serves a prompt
from disk with the same tokens, and a session waiting on a disk load never holds up another's steps."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest

from prefixserve import __version__
from prefixserve.cache import PrefixCache
from prefixserve.cache.disk import DiskTier
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine import EngineCore
from prefixserve.runner.codec import SnapshotCodec
from prefixserve.types import Delta, Namespace, Request, SamplingParams, Usage
from tests.conftest import load_embedded

pytestmark = pytest.mark.slow
NS = Namespace("smol", "tenant-a")


def make_core(path: Path, out: dict[str, list[Delta]]) -> EngineCore:
    model, runner = load_embedded("int4")
    disk = DiskTier(str(path), 1 << 30, runner.decoder.kernel_fingerprint(), __version__,
                    SnapshotCodec(runner.decoder.device))
    return EngineCore(runner, model.tokenizer, PrefixCache(CacheConfig(max_bytes=1 << 30)),
                      EngineConfig(prefill_chunk_tokens=128, max_batch_tokens=256, offer_finished_turns=False), 2048,
                      lambda rid, d: out.setdefault(rid, []).append(d), disk=disk)


def add(core: EngineCore, ids: list[int]) -> str:
    rid = uuid.uuid4().hex
    core.add(Request(rid, NS, tuple(ids), SamplingParams(max_tokens=6, temperature=0.0)))
    return rid


def result(out: dict[str, list[Delta]], rid: str) -> tuple[list[int], Usage]:
    deltas = out[rid]
    assert deltas[-1].finish_reason is not None and deltas[-1].usage is not None
    return [t for d in deltas for t in d.token_ids], deltas[-1].usage


def test_restart_serves_from_disk_without_blocking_other_sessions(tmp_path: Path) -> None:
    model, _ = load_embedded("int4")
    tok = model.tokenizer
    p = tok.render_chat([{"role": "user", "content": "List three colours of the rainbow, briefly. " * 6}])
    q = tok.render_chat([{"role": "user", "content": "Name a large mammal."}])
    out: dict[str, list[Delta]] = {}
    core = make_core(tmp_path, out)
    cold = add(core, p)
    while core.has_work():
        core.step()
    assert core.disk is not None and core.disk.wait_idle(30)
    core.disk.close()
    ref_tokens, ref_usage = result(out, cold)
    assert ref_usage.cached_tokens == 0

    core = make_core(tmp_path, out)  # a restart: empty RAM, the same directory
    assert core.disk is not None
    gate = threading.Event()
    slow_load = core.disk._load
    core.disk._load = lambda entry: (gate.wait(30), slow_load(entry))[1]  # type: ignore[method-assign]
    warm, other = add(core, p), add(core, q)
    while other not in out or out[other][-1].finish_reason is None:
        core.step()  # the other session runs to its end while the disk load is held back
    assert warm not in out and len(core.loads.sessions()) == 1
    gate.set()
    while core.has_work():
        core.step()
    tokens, usage = result(out, warm)
    assert tokens == ref_tokens and usage.cached_tokens == len(p)  # the whole prompt from disk
    assert core.disk.stats()["disk_loads"] == 1
    assert core.scheduler.reserved_bytes == 0  # the parked session's reservation was taken once, and freed
    core.cache.check_integrity()
    core.disk.check_integrity()
    core.disk.close()


def test_flush_forgets_entries_in_use_and_running_sessions_insert_nothing(tmp_path: Path) -> None:
    from prefixserve.types import FlushScope

    model, _ = load_embedded("int4")
    tok = model.tokenizer
    p = tok.render_chat([{"role": "user", "content": "Describe a quiet harbour at dawn. " * 8}])
    q = tok.render_chat([{"role": "user", "content": "Describe a busy market at noon. " * 50}])
    out: dict[str, list[Delta]] = {}
    core = make_core(tmp_path, out)
    assert core.disk is not None
    first = add(core, p)
    while core.has_work():
        core.step()
    assert core.disk.wait_idle(30) and core.disk.stats()["disk_entries"] == 1
    ref_tokens, _ = result(out, first)

    full_hit = add(core, p)  # decoding from its hit when the flush comes
    core.step()
    mid_prefill = add(core, q)  # 128-token chunks: still prefilling when the flush comes
    core.step()
    assert len(q) > 2 * 128 and [s.request.request_id for s in core.running] == [full_hit, mid_prefill]
    report = core.flush(FlushScope("tenant-a"))
    assert [(t.tier, t.num_entries) for t in report.tiers] == [("ram", 1), ("disk", 1)]
    while core.has_work():
        core.step()
    assert result(out, full_hit) == (ref_tokens, Usage(len(p), len(ref_tokens), len(p)))  # it had its hit
    assert core.cache.num_entries == 0  # neither re-seeded what was forgotten
    again = add(core, p)
    while core.has_work():
        core.step()
    assert result(out, again) == (ref_tokens, Usage(len(p), len(ref_tokens), 0))
    assert core.disk.wait_idle(30)
    core.cache.check_integrity()
    core.disk.check_integrity()
    core.disk.close()


def test_a_read_only_cache_dir_is_counted_in_metrics_and_never_delays_shutdown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QA: on a read-only --cache-dir (EROFS) the first failed write killed the writer thread; then
    queued states piled up (RSS grew past --cache-max-bytes), nothing counted the failures, and
    SIGTERM waited 30 s for writes that could never land. Now requests are served as before, the
    failures reach /metrics and nothing is left queued. The read-only mount is simulated: tests may
    run as root (tests/cache/test_cache_disk_failures.py has the tier's own cases)."""
    import asyncio
    import builtins
    import errno
    import os
    import time
    from typing import Any

    from prefixserve.engine import AsyncEngine
    from prefixserve.server.operator.metrics import ServerMetrics

    model, _ = load_embedded("int4")
    core = make_core(tmp_path, {})
    real_open, real_os_open, real_unlink = builtins.open, os.open, os.unlink

    def erofs(path: Any) -> None:
        if str(path).startswith(str(tmp_path)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def open_(file: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        if "w" in mode:
            erofs(file)
        return real_open(file, mode, *a, **k)

    def os_open(path: Any, flags: int, *a: Any, **k: Any) -> int:
        if flags & (os.O_WRONLY | os.O_CREAT):
            erofs(path)
        return real_os_open(path, flags, *a, **k)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(os, "unlink", lambda p, *a, **k: (erofs(p), real_unlink(p, *a, **k))[1])
    engine = AsyncEngine(core, "smol", model.tokenizer, "test", model.arch.vocab_size)
    prompts = [model.tokenizer.render_chat([{"role": "user", "content": f"Count to {n}, one number a line."}])
               for n in (3, 4, 5)]

    async def go() -> tuple[list[Delta], dict[str, float], str, float]:
        deltas = []
        for i, p in enumerate(prompts):
            req = Request(f"ro{i}", NS, tuple(p), SamplingParams(max_tokens=4, temperature=0.0))
            deltas += [d async for d in engine.generate(req)]
        assert core.disk is not None and core.disk.wait_idle(5)
        metrics = engine.metrics()
        text = ServerMetrics(engine).render().decode()
        t0 = time.monotonic()
        await engine.shutdown()
        return deltas, metrics, text, time.monotonic() - t0

    deltas, m, text, shutdown_s = asyncio.run(go())
    assert sum(d.finish_reason is not None for d in deltas) == 3
    assert m["cache_disk_write_failures"] >= 1 and m["cache_disk_writes"] == 0
    assert m["cache_disk_pending_writes"] == 0 and m["cache_disk_writable"] == 0
    assert "prefixserve_engine_cache_disk_write_failures" in text
    assert "prefixserve_engine_cache_disk_writable 0.0" in text
    assert shutdown_s < 5
