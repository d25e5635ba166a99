"""The one data directory: where it defaults to, and that `prefixserve usage` finds the server's ledger."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from prefixserve.config import ServerConfig, default_data_dir, default_model_cache_dir
from prefixserve.ledger.cli import add_usage_args, default_db_path


def test_default_data_dir_follows_the_environment() -> None:
    assert default_data_dir({"HOME": "/h"}) == "/h/.local/share/prefixserve"
    assert default_data_dir({"HOME": "/h", "XDG_DATA_HOME": "/x"}) == "/x/prefixserve"
    assert default_data_dir({"HOME": "/h", "XDG_DATA_HOME": "/x", "PREFIXSERVE_DATA_DIR": "/d"}) == "/d"


def test_default_model_cache_dir_is_xdg_cache_home() -> None:
    assert default_model_cache_dir({"HOME": "/h"}) == "/h/.cache/prefixserve/models"
    assert default_model_cache_dir({"HOME": "/h", "XDG_CACHE_HOME": "/c"}) == "/c/prefixserve/models"
    assert default_model_cache_dir({"HOME": "/h", "XDG_CACHE_HOME": "/c", "PREFIXSERVE_MODEL_CACHE_DIR": "/m"}) == "/m"
    assert default_data_dir({"HOME": "/h", "XDG_DATA_HOME": ""}) == "/h/.local/share/prefixserve"


def test_usage_finds_the_ledger_serve_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("PREFIXSERVE_LEDGER_PATH", raising=False)
    assert default_db_path() == str(tmp_path / "xdg" / "prefixserve" / "usage.sqlite3")
    monkeypatch.setenv("PREFIXSERVE_DATA_DIR", str(tmp_path / "d"))
    assert default_db_path() == str(tmp_path / "d" / "usage.sqlite3")
    assert default_db_path(ServerConfig(data_dir=str(tmp_path / "flag"))) == str(tmp_path / "flag" / "usage.sqlite3")
    parser = argparse.ArgumentParser()
    add_usage_args(parser)
    assert parser.parse_args(["--data-dir", "/somewhere"]).data_dir == "/somewhere"
    monkeypatch.setenv("PREFIXSERVE_LEDGER_PATH", str(tmp_path / "l.sqlite3"))
    assert default_db_path() == str(tmp_path / "l.sqlite3")
