"""`prefixserve usage`: a per-tenant, per-UTC-day table read straight from the ledger file.

Reads committed data only (a running server's last ~50 ms of records, one batch, may not be there
yet), through a query-only connection, so it is safe to run against a live server's ledger.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import sqlite3
import sys

from prefixserve.config import ServerConfig, default_data_dir
from prefixserve.ledger import store
from prefixserve.ledger.api import MAX_TIME
from prefixserve.ledger.records import BUCKET_WIDTHS, UsageQuery, UsageRow

DAY_S = BUCKET_WIDTHS["1d"]
HEADER = ("tenant", "day", "requests", "input", "cached", "output", "cost_usd")


def default_db_path(config: ServerConfig | None = None) -> str:
    """The ledger file a server with `config` writes: ledger_path, else <data_dir>/usage.sqlite3, with
    the environment's PREFIXSERVE_LEDGER_PATH / data directory (`config.default_data_dir`) where
    `config` leaves them open, exactly as `prefixserve serve` resolves them."""
    config = config if config is not None else ServerConfig()
    ledger_path = config.ledger_path or os.environ.get("PREFIXSERVE_LEDGER_PATH")
    return ledger_path or os.path.join(config.data_dir or default_data_dir(os.environ), "usage.sqlite3")


def add_usage_args(parser: argparse.ArgumentParser) -> None:
    """Add the `usage` subcommand's arguments to `parser`."""
    parser.add_argument("--db", default=None, help="ledger file (default: <data dir>/usage.sqlite3)")
    parser.add_argument("--data-dir", default=None, metavar="DIR",
                        help="the server's data directory (default: $PREFIXSERVE_DATA_DIR, else "
                             "$XDG_DATA_HOME/prefixserve, else ~/.local/share/prefixserve)")
    parser.add_argument(
        "--since",
        type=parse_since,
        default=None,
        help="first day YYYY-MM-DD (UTC) or unix seconds, inclusive",
    )
    parser.add_argument(
        "--until",
        type=parse_until,
        default=None,
        help="last day YYYY-MM-DD (UTC, included) or unix seconds (excluded)",
    )
    parser.add_argument("--tenant", action="append", default=None, help="only this tenant (repeatable)")


def run_usage(args: argparse.Namespace) -> int:
    """Print the table to stdout. 0 on success, 1 when the ledger cannot be read, 2 on a bad range."""
    path = args.db or default_db_path(ServerConfig(data_dir=getattr(args, "data_dir", None) or ""))
    since = 0 if args.since is None else args.since
    until = MAX_TIME + 1 if args.until is None else args.until
    if until <= since:
        print("prefixserve usage: --until must be after --since", file=sys.stderr)
        return 2
    try:
        conn = store.open_existing(path)
    except (OSError, RuntimeError, sqlite3.Error) as e:
        print(f"prefixserve usage: {e}", file=sys.stderr)
        return 1
    try:
        tenants = tuple(args.tenant) if args.tenant else None
        query = UsageQuery(since, until, DAY_S, group_by=("tenant_id",), tenant_ids=tenants, origin=0)
        rows = store.query_usage(conn, query)
    except sqlite3.Error as e:
        print(f"prefixserve usage: {path}: {e}", file=sys.stderr)
        return 1
    finally:
        conn.close()
    print(format_table(rows))
    return 0


def format_table(rows: list[UsageRow]) -> str:
    """Rows (grouped by tenant, one per day) as an aligned text table sorted by tenant then day,
    with a TOTAL line. Pure: no I/O."""
    if not rows:
        return "no usage recorded in this range"
    ordered = sorted(rows, key=lambda r: (r.tenant_id or "", r.bucket_start))
    lines = [HEADER] + [
        (
            r.tenant_id or "",
            dt.datetime.fromtimestamp(r.bucket_start, dt.UTC).strftime("%Y-%m-%d"),
            str(r.num_requests),
            str(r.input_tokens),
            str(r.cached_tokens),
            str(r.output_tokens),
            f"{r.cost_usd:.6f}",
        )
        for r in ordered
    ]
    lines.append(
        (
            "TOTAL",
            "",
            str(sum(r.num_requests for r in rows)),
            str(sum(r.input_tokens for r in rows)),
            str(sum(r.cached_tokens for r in rows)),
            str(sum(r.output_tokens for r in rows)),
            f"{math.fsum(r.cost_usd for r in rows):.6f}",
        )
    )
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    text = []
    for line in lines:
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        text.append("  ".join(cells).rstrip())
    return "\n".join(text)


def parse_since(value: str) -> int:
    """argparse type: YYYY-MM-DD -> that day's UTC midnight; digits -> unix seconds."""
    return _parse_when(value, end_of_day=False)


def parse_until(value: str) -> int:
    """argparse type: YYYY-MM-DD -> the next day's UTC midnight (the day is included); digits -> as is."""
    return _parse_when(value, end_of_day=True)


def _parse_when(value: str, *, end_of_day: bool) -> int:
    if value.isdigit():
        return int(value)
    try:
        day = dt.datetime.strptime(value, "%Y-%m-%d").replace(tzinfo=dt.UTC)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected YYYY-MM-DD or unix seconds, not {value!r}") from None
    return int(day.timestamp()) + (DAY_S if end_of_day else 0)
