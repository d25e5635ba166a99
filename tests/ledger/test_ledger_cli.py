"""`prefixserve usage`: the per-tenant, per-day table on a small known ledger."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from prefixserve.ledger import Ledger, Pricing, UsageRecord
from prefixserve.ledger.cli import add_usage_args, run_usage

T0 = 1_730_419_200  # 2024-11-01T00:00:00Z
DAY = 86_400


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prefixserve usage")
    add_usage_args(parser)
    return parser.parse_args(list(argv))


@pytest.fixture()
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "usage.sqlite3")
    with Ledger(path, Pricing.from_specs(["m=2,0.5,8"])) as led:
        led.record(UsageRecord("1", "tenant-b", "m", 1000, 400, 50, "stop", T0 + 10))
        led.record(UsageRecord("2", "tenant-a", "m", 100, 0, 10, "stop", T0 + 20))
        led.record(UsageRecord("3", "tenant-a", "m", 200, 100, 20, "stop", T0 + DAY - 0.5))
        led.record(UsageRecord("4", "tenant-a", "m", 300, 300, 30, "abort", T0 + DAY + 3))
    return path


def test_table(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_usage(parse("--db", db)) == 0
    # a day 0: 2 reqs, 300 in, 100 cached, 30 out: 200*2 + 100*0.5 + 30*8 = 690 micro-USD
    # a day 1: 300*0.5 + 30*8 = 390; b day 0: 600*2 + 400*0.5 + 50*8 = 1800
    assert capsys.readouterr().out == (
        "tenant    day         requests  input  cached  output  cost_usd\n"
        "tenant-a  2024-11-01         2    300     100      30  0.000690\n"
        "tenant-a  2024-11-02         1    300     300      30  0.000390\n"
        "tenant-b  2024-11-01         1   1000     400      50  0.001800\n"
        "TOTAL                        4   1600     800     110  0.002880\n"
    )


def test_since_until_and_tenant(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_usage(parse("--db", db, "--since", "2024-11-02")) == 0
    assert [line.split()[:3] for line in capsys.readouterr().out.splitlines()[1:]] == [
        ["tenant-a", "2024-11-02", "1"],
        ["TOTAL", "1", "300"],
    ]
    assert run_usage(parse("--db", db, "--until", "2024-11-01", "--tenant", "tenant-a")) == 0
    assert [line.split()[:3] for line in capsys.readouterr().out.splitlines()[1:]] == [
        ["tenant-a", "2024-11-01", "2"],
        ["TOTAL", "2", "300"],
    ]
    assert run_usage(parse("--db", db, "--since", str(T0 + 15), "--until", str(T0 + 21))) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:3] == ["tenant-a", "2024-11-01", "1"]
    assert run_usage(parse("--db", db, "--since", "2030-01-01")) == 0
    assert capsys.readouterr().out == "no usage recorded in this range\n"


def test_errors(db: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope.sqlite3")
    assert run_usage(parse("--db", missing)) == 1
    assert not Path(missing).exists()  # the CLI never creates a ledger
    assert "no usage ledger" in capsys.readouterr().err
    assert run_usage(parse("--db", db, "--since", "2024-11-02", "--until", "2024-11-01")) == 2
    with pytest.raises(SystemExit):
        parse("--since", "yesterday")
