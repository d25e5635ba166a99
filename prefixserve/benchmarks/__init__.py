"""`prefixserve bench engine|cache`: benchmarks that print numbers (they never assert speed)."""

from __future__ import annotations

import argparse


def run_bench(args: argparse.Namespace) -> int:
    if args.what == "cache":
        from prefixserve.benchmarks.cache import bench_cache

        bench_cache(quick=args.quick, num_threads=args.threads, only=getattr(args, "only", None))
        return 0
    from prefixserve.benchmarks.engine import bench_constrained, bench_engine

    bench_engine(quick=args.quick, num_threads=args.threads)
    bench_constrained(quick=args.quick)
    return 0
