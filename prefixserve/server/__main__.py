"""`python -m prefixserve.server [flags]`: the same as `prefixserve serve [flags]`."""

from __future__ import annotations

import argparse
import signal
import sys

signal.signal(signal.SIGHUP, signal.SIG_IGN)  # before the heavy imports (prefixserve/cli/__init__.py says why)

from prefixserve.server.run import run_serve
from prefixserve.server.settings import add_serve_args

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m prefixserve.server", description="OpenAI-compatible server"
    )
    add_serve_args(parser)
    sys.exit(run_serve(parser.parse_args()))
