"""The disk tier and the flush API over HTTP with the real model: warm restart after SIGTERM and
after SIGKILL answering as a server without a cache, isolation across the restart, a bit-flipped and
a truncated file dropped and served correctly, per-tier metrics, and DELETE /v1/cache forgetting RAM
and disk. Four server starts in one scenario (they are slow)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixserve.cache.disk_format import DIGEST_BYTES, read_header
from tests.helpers.server_proc import ServerProcess

pytestmark = pytest.mark.slow
KEY_A, KEY_B = "sk-a-0123456789", "sk-b-9876543210"
ARGS = ["--api-key", f"alice {KEY_A}", "--api-key", f"bob {KEY_B}", "--admin-key", "sk-admin-555555", "--no-ledger", "--cache-disk-bytes", "1G",
        "--num-threads", "1"]
P1 = "Northwind Outfitters return policy. " + " ".join(f"Rule {i}: department {i} allows returns in {i + 20} days."
                                                       for i in range(1, 16)) + " Summarise rule 3."
P2 = "A different document entirely. " + " ".join(f"Fact {i}: the value of item {i} is {i * 3} coins."
                                                  for i in range(1, 16)) + " What is item 4 worth?"


def complete(srv: ServerProcess, key: str, prompt: str, salt: str | None = None) -> tuple[str, int, int]:
    body: dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(srv.openai_url + "/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                   timeout=300)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return r.json()["choices"][0]["text"], usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def metric(srv: ServerProcess, name: str) -> float:
    text = srv.metrics()
    assert "alice" not in text and "bob" not in text  # no tenant labels (docs/cache.md, "Metrics")
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_for_writes(srv: ServerProcess, num: int) -> None:
    deadline = time.monotonic() + 60
    while metric(srv, "prefixserve_engine_cache_disk_writes_total") < num:
        assert time.monotonic() < deadline, "write-through did not land"
        time.sleep(0.2)


def test_warm_restart_isolation_corruption_and_flush(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    args = [*ARGS, "--cache-dir", str(cache_dir)]
    with ServerProcess([*ARGS, "--cache-max-bytes", "0"], data_dir=tmp_path / "ref") as srv:  # the reference
        r1, r2 = complete(srv, KEY_A, P1)[0], complete(srv, KEY_A, P2)[0]
    with ServerProcess(args, data_dir=tmp_path / "data") as srv:  # cold
        assert complete(srv, KEY_A, P1)[:2] == (r1, 0)
        assert complete(srv, KEY_A, P2, salt="s")[:2] == (r2, 0)
        wait_for_writes(srv, 2)
        assert srv.terminate() == 0  # SIGTERM

    with ServerProcess(args, data_dir=tmp_path / "data") as srv:  # warm restart after SIGTERM
        text, cached, n = complete(srv, KEY_A, P1)
        assert (text, cached) == (r1, n)  # the whole prompt from disk, the same answer
        assert complete(srv, KEY_B, P1) == (r1, 0, n)  # another tenant misses
        assert complete(srv, KEY_A, P1, salt="s")[1] == 0  # another salt misses
        text, cached, n2 = complete(srv, KEY_A, P2, salt="s")
        assert (text, cached) == (r2, n2)
        assert metric(srv, "prefixserve_engine_cache_disk_loads_total") == 2
        assert metric(srv, "prefixserve_engine_cache_disk_load_seconds_total") > 0
        # per tier (docs/cache.md, "Metrics"): both disk loads were RAM hits once re-inserted
        assert metric(srv, "prefixserve_engine_cache_disk_hits_total") == 2
        assert metric(srv, "prefixserve_engine_cache_ram_hits_total") >= 2
        assert metric(srv, "prefixserve_engine_cache_disk_load_seconds_max") > 0
        for tier in ("disk", "ram"):
            assert metric(srv, f"prefixserve_engine_cache_{tier}_bytes") > 0
            assert metric(srv, f"prefixserve_engine_cache_{tier}_evictions_total") == 0
        wait_for_writes(srv, 2)  # bob's and salt s's P1 entries
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait()

    # while the server is down: flip one payload bit of P2's file (tenant a, salt s), and truncate
    # the files of the same namespace that hold P1 (the prompt's, and its finished turn's)
    headers = {}
    for name in (n for n in os.listdir(cache_dir) if n.endswith(".kv")):
        with open(cache_dir / name, "rb") as f:
            headers[name] = read_header(f, (cache_dir / name).stat().st_size)
    (flipped,) = (name for name, h in headers.items() if len(h.token_ids) == n2)
    ns2 = (headers[flipped].tenant_digest, headers[flipped].salt_digest)
    (p1_ids,) = (h.token_ids for h in headers.values() if len(h.token_ids) == n and (h.tenant_digest, h.salt_digest) == ns2)
    truncated = [name for name, h in headers.items() if (h.tenant_digest, h.salt_digest) == ns2
                 and h.token_ids[:n] == p1_ids]
    raw = bytearray((cache_dir / flipped).read_bytes())
    raw[-DIGEST_BYTES - 1000] ^= 0x10
    (cache_dir / flipped).write_bytes(bytes(raw))
    for name in truncated:
        raw = bytearray((cache_dir / name).read_bytes())
        (cache_dir / name).write_bytes(bytes(raw[: len(raw) // 2]))

    with ServerProcess(args, data_dir=tmp_path / "data") as srv:  # warm restart after SIGKILL
        text, cached, _ = complete(srv, KEY_A, P1)
        assert (text, cached) == (r1, n)
        assert complete(srv, KEY_A, P2, salt="s") == (r2, 0, n2)  # corrupt file dropped, answer recomputed
        assert complete(srv, KEY_A, P1, salt="s") == (r1, 0, n)  # truncated: dropped by the start-up scan
        assert metric(srv, "prefixserve_engine_cache_disk_corrupt_files_total") == 1 + len(truncated)
        assert all(f"dropping {name}" in srv.log_text() for name in [flipped, *truncated])

        r = httpx.request("DELETE", srv.openai_url + "/cache", headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 200, r.text
        tiers = r.json()["tiers"]
        assert tiers["ram"]["deleted_entries"] >= 2 and tiers["disk"]["deleted_entries"] >= 2
        assert complete(srv, KEY_A, P1) == (r1, 0, n)  # forgotten in RAM and on disk
        assert complete(srv, KEY_A, P2, salt="s")[1] == 0
        assert complete(srv, KEY_B, P1) == (r1, n, n)  # bob's entry untouched
