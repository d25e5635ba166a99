"""`serve`'s shared-tier flags: a URL needs exactly one secret (flag or file), and the secret is
never printed."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from prefixserve.config import SharedTierConfig
from prefixserve.server.launch import shared_tier_config
from prefixserve.server.run import run_serve
from prefixserve.server.settings import add_serve_args

URL = "redis://127.0.0.1:6379/0"


def settings(url: Any = None, key: Any = None, key_file: Any = None) -> dict[str, Any]:
    return {"cache_redis_url": url, "cache_redis_key": key, "cache_redis_key_file": key_file}


def test_flags_resolve_to_a_config(tmp_path: Path) -> None:
    assert shared_tier_config(settings()) is None
    assert shared_tier_config(settings(URL, "a-secret-of-24-bytes-ok!")) == SharedTierConfig(URL, b"a-secret-of-24-bytes-ok!")
    f = tmp_path / "key"
    f.write_bytes(b"  file-secret-0123456789\n")
    config = shared_tier_config(settings(URL, key_file=str(f)))
    assert config is not None and config.secret == b"file-secret-0123456789"
    assert "file-secret" not in repr(config)  # never logged with the config


@pytest.mark.parametrize(("s", "message"), [
    (settings(URL), "needs a secret"),
    (settings(None, "a-secret-of-24-bytes-ok!"), "needs --cache-redis-url"),
    (settings(URL, "short"), "at least 16 bytes"),
    (settings(URL, "a-secret-of-24-bytes-ok!", "/some/file"), "not both"),
    (settings("http://x", "a-secret-of-24-bytes-ok!"), "redis://"),
])
def test_bad_flags_are_configuration_errors(s: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        shared_tier_config(s)


def test_serve_refuses_a_redis_url_without_a_secret_before_loading_a_model(capsys: Any, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--cache-redis-url", URL, "--no-ledger", "--data-dir", str(tmp_path)])
    assert run_serve(args) == 2
    assert "needs a secret" in capsys.readouterr().err
