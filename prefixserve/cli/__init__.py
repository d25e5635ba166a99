"""`prefixserve serve | generate | bench | usage`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's flags, without running anything: `main` parses with it, and
    tools/flags_doc.py writes docs/flags.md from it."""
    parser = argparse.ArgumentParser(prog="prefixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from prefixserve.server.settings import add_serve_args

    add_serve_args(sub.add_parser("serve", help="start the OpenAI-compatible server"))

    from prefixserve.cli.generate import add_generate_args

    add_generate_args(sub.add_parser("generate", help="answer one prompt and print TTFT and tokens/s"))

    bench = sub.add_parser("bench", help="benchmarks that print numbers")
    bench.add_argument("what", choices=["engine", "cache"])
    bench.add_argument("--quick", action="store_true", help="fewer repetitions")
    bench.add_argument("--threads", type=int, default=None)
    bench.add_argument("--only", choices=["shared"], default=None, help="cache: only the shared-tier (Redis) part")

    from prefixserve.ledger.cli import add_usage_args

    add_usage_args(sub.add_parser("usage", help="print the per-tenant, per-day usage ledger"))
    return parser


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["serve"]:
        # before the heavy imports: a SIGHUP (logrotate's, an operator's) must never kill a starting
        # server; once it serves, SIGHUP reads the API keys again (server/operator/auth.py, `reload_keys`)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    args = build_parser().parse_args(argv)
    if args.command == "serve":  # its --log-level sets up logging (server/launch.py); a call here first made it a no-op
        return _serve(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        from prefixserve.cli.generate import run_generate

        return run_generate(args)
    if args.command == "bench":
        from prefixserve.benchmarks import run_bench

        return run_bench(args)
    from prefixserve.ledger.cli import run_usage

    return run_usage(args)


def _serve(args: argparse.Namespace) -> int:
    """`prefixserve serve`: the native kernels' build starts first (on a CPU), so the compilers have the
    other core while the server's own modules (0.6 s: FastAPI, pydantic) and torch are imported; a
    start-up that ends early (a bad setting, a port in use: exit status 2) stops them on its way out."""
    from prefixserve.models.kernels import native_build
    from prefixserve.server.settings import resolve

    if resolve(args, "device", os.environ) != "cuda":
        native_build.prebuild()
    try:
        from prefixserve.server.run import run_serve

        return run_serve(args)
    finally:
        native_build.cancel()  # long built where the server served; else its compilers stop now
