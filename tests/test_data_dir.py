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


@pytest.mark.parametrize("flag", [True, False])
def test_serve_puts_the_disk_tier_and_the_ledger_in_the_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: bool
) -> None:
    """`serve` without --cache-dir: the disk tier in <data dir>/cache beside the ledger (docs/cache.md,
    "Tiers"), the data dir from --data-dir or else the environment. Stops where the model would load."""
    import signal
    import socket

    import prefixserve.engine
    from prefixserve.config import CacheConfig
    from prefixserve.models import ModelLoadError
    from prefixserve.server import run, settings

    seen: list[CacheConfig] = []

    def no_load(model_config: object, cache_config: CacheConfig, engine_config: object, **kwargs: object) -> None:
        seen.append(cache_config)
        raise ModelLoadError("not in this test")

    monkeypatch.setattr(prefixserve.engine, "build_engine", no_load)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("PREFIXSERVE_DATA_DIR", raising=False)
    monkeypatch.delenv("PREFIXSERVE_LEDGER_PATH", raising=False)
    monkeypatch.delenv("PREFIXSERVE_CACHE_DIR", raising=False)
    data = tmp_path / "flag" if flag else tmp_path / "xdg" / "prefixserve"
    with socket.socket() as s:  # a free port, for the bind run_serve does before the load
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parser = argparse.ArgumentParser()
    settings.add_serve_args(parser)
    argv = ["--port", str(port), "--cache-disk-bytes", "1G", *(["--data-dir", str(data)] if flag else [])]
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert run.run_serve(parser.parse_args(argv)) == 1
    finally:
        signal.signal(signal.SIGTERM, handler)
    (cache_config,) = seen
    assert cache_config.disk_dir == str(data / "cache") and (data / "cache").is_dir()
    assert (data / "cache").stat().st_mode & 0o777 == 0o700
    assert (data / "usage.sqlite3").is_file()
