"""A SIGKILLed process loses at most its last second of records, and never writes one twice."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

CHILD = Path(__file__).with_name("ledger_child.py")
REPO = Path(__file__).resolve().parents[2]


def test_sigkill_loses_at_most_the_last_second(tmp_path: Path) -> None:
    db = tmp_path / "usage.sqlite3"
    log = tmp_path / "child.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    with open(log, "w") as out:
        child = subprocess.Popen([sys.executable, str(CHILD), str(db)], stdout=out, env=env)
    try:
        deadline = time.monotonic() + 60
        while not log.read_text().startswith("ready"):
            assert child.poll() is None, "child died before it was ready"
            assert time.monotonic() < deadline, "child not ready within 60 s"
            time.sleep(0.05)
        time.sleep(2.5)
        kill_time = time.time()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL

    handed: dict[int, float] = {}
    for line in log.read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) == 2:  # the last line may be cut off by the kill
            handed[int(parts[0])] = float(parts[1])
    must_have = {i for i, t in handed.items() if t < kill_time - 1.0}

    conn = sqlite3.connect(db)  # opening recovers the WAL as the next server start would
    ids = [int(rid[1:]) for (rid,) in conn.execute("SELECT request_id FROM usage_records")]
    (num_rows,) = conn.execute("SELECT COUNT(*) FROM usage_records").fetchone()
    conn.close()
    stored = set(ids)
    print(
        f"\nhanded to record(): {len(handed)}, due by the 1 s rule: {len(must_have)}, in the DB: {len(stored)}"
    )
    assert len(must_have) > 200, "the child recorded too little for the test to mean anything"
    assert must_have <= stored, f"lost {len(must_have - stored)} records older than 1 s"
    assert len(ids) == num_rows == len(stored), "a record was written twice"
    assert stored <= set(handed) | {max(handed) + 1}, "a record nobody handed over"
    assert stored == set(range(len(stored))), "the committed records are not a prefix (FIFO) of those handed"
