"""`make cluster`'s script, bench/cluster.sh, as a user runs it (docs/gateway.md, "A local cluster"):
one replica that requires API keys, Redis and SMG 1.13 (its default policy), all real processes. A
tenant's key passes SMG and reaches the replica (the same request again is served from the cache; the
same prompt from the other tenant is not), a key the file does not hold stops at SMG, no key is on any
of the cluster's command lines, and SIGTERM stops everything and removes the state directory."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.server_proc import TEST_MODEL_CACHE, free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
KEY_A, KEY_B = "sk-a-0123456789", "sk-b-9876543210"
BODY = {"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": "You are the concierge of the Harbour Hotel. Breakfast is at 7."},
                     {"role": "user", "content": "When is breakfast?"}]}


def test_keyed_cluster_serves_tenants_through_smg_and_stops_cleanly(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make redis-server)")
    if shutil.which("smg", path=os.path.dirname(sys.executable)) is None:
        pytest.skip("smg is not installed (make install: the test extra)")
    keys = tmp_path / "keys.txt"
    keys.write_text(f"alice {KEY_A}\nbob {KEY_B}\n")
    port = free_port()
    env = {**os.environ, "PORT": str(port), "BASE_PORT": str(free_port()), "REDIS_PORT": str(free_port()),
           "PROMETHEUS_PORT": str(free_port()), "SERVE_ARGS": "--num-threads 1 --no-ledger",
           "VENV": str(Path(sys.executable).parent.parent), "PREFIXSERVE_MODEL_CACHE_DIR": TEST_MODEL_CACHE}
    log = tmp_path / "cluster.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(["bash", "bench/cluster.sh", "1", "--api-keys-file", str(keys)], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while "gateway on" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        assert "(cache_aware, keys of" in log.read_text()
        state = Path(re.search(r"logs in (\S+)\)", log.read_text()).group(1))  # type: ignore[union-attr]
        assert state.is_dir()
        url = f"http://127.0.0.1:{port}/v1/chat/completions"

        def cached(key: str) -> int:
            r = httpx.post(url, json=BODY, headers={"Authorization": f"Bearer {key}"}, timeout=300)
            assert r.status_code == 200, r.text
            return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

        assert cached(KEY_A) == 0
        assert cached(KEY_A) > 0  # alice's namespace on the replica
        assert cached(KEY_B) == 0  # the same prompt, bob's namespace
        wrong = httpx.post(url, json=BODY, headers={"Authorization": "Bearer sk-not-in-the-file"}, timeout=60)
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        for pid in _group(proc.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert KEY_A.encode() not in cmdline and b"sk-gateway-" not in cmdline
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    assert rc == 143
    assert not state.exists()
    assert "stopping 3 processes" in log.read_text()  # redis-server, the replica, SMG
    with pytest.raises(ProcessLookupError):  # none of them outlived the script
        os.killpg(proc.pid, 0)


def _group(pgid: int) -> list[int]:
    """Every live process of the cluster's process group (the script started them all)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
            except ProcessLookupError:
                pass
    assert len(pids) >= 4, pids  # the script, redis-server, the replica, SMG
    return pids
