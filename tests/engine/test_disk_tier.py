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
    disk = DiskTier(str(path), 1 << 30, runner.decoder.kernel_fingerprint(), __version__, SnapshotCodec())
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
