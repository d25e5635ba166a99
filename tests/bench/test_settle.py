"""`make bench` measures each server with the other idle: between turns it waits until neither
server's process group uses CPU (bench/serve_bench.py `settle`), since both go on working after a
response (llama-server saves the prompt to its RAM cache, ours prefills the next chat turn)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
# bench/ on the path for this import only (tests/bench/test_trace.py says why)
sys.path.insert(0, BENCH)
from serve_bench import settle

sys.path.remove(BENCH)


class _Busy:
    """A server whose CPU time grows until `until` (perf_counter seconds), then stays."""

    def __init__(self, busy_s: float) -> None:
        self.until = time.perf_counter() + busy_s

    def cpu_seconds(self) -> float:
        return min(time.perf_counter(), self.until)


def test_settle_waits_for_the_busy_server_and_no_longer():
    servers = {"ours": _Busy(0.0), "peer": _Busy(0.45)}
    t0 = time.perf_counter()
    asyncio.run(settle(servers, quiet_s=0.05, most_s=3.0))  # type: ignore[arg-type]
    waited = time.perf_counter() - t0
    assert 0.45 <= waited < 1.5


def test_settle_gives_up_on_a_server_that_never_goes_quiet():
    t0 = time.perf_counter()
    asyncio.run(settle({"peer": _Busy(60.0)}, quiet_s=0.05, most_s=0.3))  # type: ignore[arg-type]
    assert 0.3 <= time.perf_counter() - t0 < 1.0
