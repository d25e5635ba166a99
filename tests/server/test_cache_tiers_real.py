"""The disk tier and the flush API over HTTP with the real model: warm restart after SIGTERM and
after SIGKILL, isolation across the restart, a corrupt file dropped and served correctly, and
DELETE /v1/cache forgetting RAM and disk. Three server starts in one scenario (they are slow)."""

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
ARGS = ["--api-key", f"alice {KEY_A}", "--api-key", f"bob {KEY_B}", "--no-ledger", "--cache-disk-bytes", "1G",
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
    text = httpx.get(srv.base_url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_for_writes(srv: ServerProcess, num: int) -> None:
    deadline = time.monotonic() + 60
    while metric(srv, "prefixserve_engine_cache_disk_writes") < num:
        assert time.monotonic() < deadline, "write-through did not land"
        time.sleep(0.2)


def test_warm_restart_isolation_corruption_and_flush(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    args = [*ARGS, "--cache-dir", str(cache_dir)]
    with ServerProcess(args, data_dir=tmp_path / "data") as srv:  # cold: what a no-cache server answers
        r1, cached, _ = complete(srv, KEY_A, P1)
        assert cached == 0
        r2, cached, _ = complete(srv, KEY_A, P2, salt="s")
        assert cached == 0
        wait_for_writes(srv, 2)
        assert srv.terminate() == 0  # SIGTERM

    with ServerProcess(args, data_dir=tmp_path / "data") as srv:  # warm restart after SIGTERM
        text, cached, n = complete(srv, KEY_A, P1)
        assert (text, cached) == (r1, n)  # the whole prompt from disk, the same answer
        assert complete(srv, KEY_B, P1) == (r1, 0, n)  # another tenant misses
        assert complete(srv, KEY_A, P1, salt="s")[1] == 0  # another salt misses
        text, cached, n2 = complete(srv, KEY_A, P2, salt="s")
        assert (text, cached) == (r2, n2)
        assert metric(srv, "prefixserve_engine_cache_disk_loads") == 2
        assert metric(srv, "prefixserve_engine_cache_disk_load_seconds_total") > 0
        wait_for_writes(srv, 2)  # bob's and salt s's P1 entries
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait()

    # flip one payload bit of P2's file (tenant a, salt s) while the server is down
    p2_ids = None
    for name in os.listdir(cache_dir):
        path = cache_dir / name
        with open(path, "rb") as f:
            header = read_header(f, path.stat().st_size)
        if len(header.token_ids) == n2:
            raw = bytearray(path.read_bytes())
            raw[-DIGEST_BYTES - 1000] ^= 0x10
            path.write_bytes(bytes(raw))
            p2_ids = header.token_ids
    assert p2_ids is not None

    with ServerProcess(args, data_dir=tmp_path / "data") as srv:  # warm restart after SIGKILL
        text, cached, _ = complete(srv, KEY_A, P1)
        assert (text, cached) == (r1, n)
        assert complete(srv, KEY_A, P2, salt="s") == (r2, 0, n2)  # corrupt file dropped, answer recomputed
        assert metric(srv, "prefixserve_engine_cache_disk_corrupt_files") == 1
        assert "dropping" in srv.log_text()

        r = httpx.request("DELETE", srv.openai_url + "/cache", headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 200, r.text
        tiers = r.json()["tiers"]
        assert tiers["ram"]["deleted_entries"] >= 2 and tiers["disk"]["deleted_entries"] >= 2
        assert complete(srv, KEY_A, P1) == (r1, 0, n)  # forgotten in RAM and on disk
        assert complete(srv, KEY_A, P2, salt="s")[1] == 0
        assert complete(srv, KEY_B, P1) == (r1, n, n)  # bob's entry untouched
