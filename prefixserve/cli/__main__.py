"""`python -m prefixserve.cli [command] [flags]`: the same as the `prefixserve` console script."""

from __future__ import annotations

import sys

from prefixserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
