"""Child process for the SIGKILL test: records in a loop until killed.

Usage: python ledger_child.py DB_PATH. After each record() returns it appends
"<index> <unix time>" to stdout (unbuffered writes reach the kernel before the next record, so
they survive SIGKILL). Every 10th step it also replays an earlier request id.
"""

from __future__ import annotations

import os
import sys
import time

from prefixserve.ledger import Ledger, Pricing, UsageRecord


def main(path: str) -> None:
    ledger = Ledger(path, Pricing.from_specs(["m=2,0.5,8"]))
    out = os.fdopen(sys.stdout.fileno(), "w", buffering=1)
    out.write("ready\n")
    i = 0
    while True:
        ledger.record(UsageRecord(f"r{i}", f"t{i % 3}", "m", 100, 40, 7, "stop", time.time()))
        if i % 10 == 9:
            ledger.record(UsageRecord(f"r{i - 5}", f"t{(i - 5) % 3}", "m", 100, 40, 7, "stop", time.time()))
        out.write(f"{i} {time.time():.6f}\n")
        i += 1
        time.sleep(0.001)


if __name__ == "__main__":
    main(sys.argv[1])
