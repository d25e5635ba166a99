"""`prefixserve bench engine|cache` (placeholder dispatcher; filled in below)."""

from __future__ import annotations

import argparse


def run_bench(args: argparse.Namespace) -> int:
    if args.what == "cache":
        from prefixserve.cache.bench import bench_lookup

        bench_lookup()
        return 0
    raise SystemExit("bench engine: not yet")
