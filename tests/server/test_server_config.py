"""Key specs, key files, tenant ids, `serve` flag / environment resolution, and start-up's configuration
errors (one line naming the flag and the path, exit status 2, before any model loads)."""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from prefixserve.config import ServerConfig
from prefixserve.server import run, settings
from prefixserve.server.errors import APIError
from prefixserve.server.operator.auth import (
    OPEN_TENANT_ID,
    KeyStore,
    bearer_token,
    parse_key_spec,
    read_keys_file,
)


def test_key_specs_and_tenant_ids() -> None:
    tenant, key = parse_key_spec("sk-abc")
    assert key == "sk-abc" and tenant == "key-" + hashlib.sha256(b"sk-abc").hexdigest()[:12]
    assert "sk-abc" not in tenant
    assert parse_key_spec("  alice   sk-1 ") == ("alice", "sk-1")
    for bad in ("", "a b c", "bad/name sk"):
        with pytest.raises(ValueError):
            parse_key_spec(bad)


def test_keys_file(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# tenants\n\nsk-one\nalice sk-two   # inline comment\n  \n")
    assert read_keys_file(f) == ["sk-one", "alice sk-two"]
    f.write_text("a b c\n")
    with pytest.raises(ValueError, match=":1:"):
        read_keys_file(f)
    f.write_text("tenantX pass#word123456\nalice #StartsWithHash0123456 # hers\n#gone sk-x\nsk-three #\n")
    assert read_keys_file(f) == ["tenantX pass#word123456", "alice #StartsWithHash0123456", "sk-three"]
    for empty in ("", "\n  \n", "# sk-one\n#alice sk-two\n"):  # no key: an error, never an open server
        f.write_text(empty)
        with pytest.raises(ValueError, match="no API keys"):
            read_keys_file(f)


def test_keystore() -> None:
    ks = KeyStore.from_specs(["sk-1", "alice sk-2", "alice sk-3"], admin_key="adm")
    assert ks.identify("Bearer sk-2").tenant_id == ks.identify("Bearer sk-3").tenant_id == "alice"
    assert ks.identify("Bearer adm").tenant_id is None and ks.identify("Bearer adm").is_admin
    assert not ks.identify("Bearer sk-1").is_admin
    with pytest.raises(APIError) as e:
        ks.identify("Bearer nope")
    assert e.value.status_code == 401
    with pytest.raises(APIError) as e:
        ks.tenant_for_generation("Bearer adm")
    assert e.value.status_code == 403
    with pytest.raises(ValueError):
        KeyStore.from_specs(["sk-1", "bob sk-1"])
    with pytest.raises(ValueError, match="tenant name"):
        KeyStore.from_specs(["sk-3 sk-2", "sk-3"])  # a tenant named like another tenant's key
    with pytest.raises(ValueError, match="tenant name"):
        KeyStore.from_specs(["sk-1 sk-1"])
    boss = KeyStore.from_specs(["boss adm", "bob sk-b"], admin_key="adm")
    both = boss.identify("Bearer adm")
    assert (both.tenant_id, both.is_admin) == ("boss", True)
    assert boss.admin_tenant == "boss" and ks.admin_tenant is None  # said at start: a mistake would give it all
    open_ks = KeyStore.from_specs([], admin_key="adm")
    assert open_ks.is_open and open_ks.identify(None).tenant_id == OPEN_TENANT_ID
    assert open_ks.identify("Bearer adm").is_admin


def test_bearer_token() -> None:
    assert bearer_token("Bearer  k ") == "k"
    assert bearer_token("bearer k") == "k"
    assert bearer_token("Token k") is None and bearer_token("Bearer") is None and bearer_token(None) is None


def test_parse_bytes() -> None:
    assert settings.parse_bytes("0") == 0
    assert settings.parse_bytes("1234") == 1234
    assert settings.parse_bytes("512M") == 512 << 20
    assert settings.parse_bytes("2GiB") == 2 << 30
    assert settings.parse_bytes("1.5k") == 1536
    with pytest.raises(argparse.ArgumentTypeError):
        settings.parse_bytes("lots")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    settings.add_serve_args(parser)
    return parser.parse_args(list(argv))


def test_flags_beat_environment_beat_defaults() -> None:
    env: dict[str, Any] = {
        "PREFIXSERVE_PORT": "9001",
        "PREFIXSERVE_CACHE_MAX_BYTES": "1G",
        "PREFIXSERVE_NO_LEDGER": "1",
    }
    args = _args("--port", "9100", "--dtype", "fp32", "--api-key", "alice sk-1", "--api-key", "sk-2")
    assert settings.resolve(args, "port", env) == 9100
    assert settings.resolve(args, "cache_max_bytes", env) == 1 << 30
    assert settings.resolve(args, "no_ledger", env) is True
    assert settings.resolve(args, "dtype", env) == "fp32"
    assert settings.resolve(args, "host", env) == "127.0.0.1"
    assert settings.resolve(args, "data_dir", env) is None  # resolved by config.default_data_dir
    for flag, dest in (("--max-session-bytes", "max_session_bytes"), ("--cache-max-bytes", "cache_max_bytes")):
        assert settings.resolve(_args(flag, "2G"), dest, {}) == 2 << 30  # a byte size on the command line too
    assert args.api_keys == ["alice sk-1", "sk-2"]
    assert settings.resolve(_args("--no-ledger"), "no_ledger", {}) is True
    assert settings.resolve(_args(), "no_ledger", {}) is False
    assert settings.resolve(_args("--no-model-cache"), "no_model_cache", {}) is True
    assert settings.resolve(_args(), "no_model_cache", {"PREFIXSERVE_NO_MODEL_CACHE": "1"}) is True
    assert settings.resolve(_args("--model-cache-dir", "/m"), "model_cache_dir", {"PREFIXSERVE_MODEL_CACHE_DIR": "/e"}) == "/m"
    assert settings.resolve(_args(), "model_cache_dir", {}) is None  # resolved by config.default_model_cache_dir
    assert settings.resolve(_args("--metrics-open"), "metrics_open", {}) is True
    assert settings.resolve(_args(), "metrics_open", {"PREFIXSERVE_METRICS_OPEN": "1"}) is True
    assert settings.resolve(_args(), "metrics_open", {}) is False
    assert settings.resolve(_args("--allowed-origins", "https://a.example/, http://b:8080"), "allowed_origins",
                            {}) == ("https://a.example", "http://b:8080")
    assert settings.resolve(_args(), "allowed_origins", {"PREFIXSERVE_ALLOWED_ORIGINS": "*"}) == ("*",)
    assert settings.resolve(_args(), "allowed_origins", {}) == ()
    for bad, why in (("https://a.example/app", "not an origin"), ("https://*.a.example", "no wildcards"),
                     ("https://a.example, *", "stands alone")):
        with pytest.raises(ValueError, match=why):
            settings.resolve(_args(), "allowed_origins", {"PREFIXSERVE_ALLOWED_ORIGINS": bad})
    assert settings.split_env_keys("alice sk-1, sk-2,,") == ["alice sk-1", "sk-2"]
    with pytest.raises(ValueError, match="PREFIXSERVE_PORT='eighty'"):
        settings.resolve(_args(), "port", {"PREFIXSERVE_PORT": "eighty"})
    assert settings.resolve(_args(), "shutdown_timeout", {}) == 20.0
    assert settings.resolve(_args(), "shutdown_timeout", {"PREFIXSERVE_SHUTDOWN_TIMEOUT": "2.5"}) == 2.5
    assert settings.resolve(_args("--shutdown-timeout", "0"), "shutdown_timeout", {"PREFIXSERVE_SHUTDOWN_TIMEOUT": "9"}) == 0



def test_cache_eviction_flag_and_environment() -> None:
    assert settings.resolve(_args(), "cache_eviction", {}) == "lru"
    assert settings.resolve(_args(), "cache_eviction", {"PREFIXSERVE_CACHE_EVICTION": "gdsf"}) == "gdsf"
    assert settings.resolve(_args("--cache-eviction", "lru"), "cache_eviction", {"PREFIXSERVE_CACHE_EVICTION": "gdsf"}) == "lru"
    with pytest.raises(ValueError, match="PREFIXSERVE_CACHE_EVICTION='fifo'.*lru, gdsf"):
        settings.resolve(_args(), "cache_eviction", {"PREFIXSERVE_CACHE_EVICTION": "fifo"})
    with pytest.raises(SystemExit):
        _args("--cache-eviction", "fifo")

def test_shutdown_timeout_is_seconds_at_least_0() -> None:
    assert settings.parse_seconds("30") == 30.0 and settings.parse_seconds("0") == 0.0
    for bad in ("-1", "soon", "nan", "inf", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            settings.parse_seconds(bad)
    with pytest.raises(SystemExit) as e:  # argparse's usage error
        _args("--shutdown-timeout", "-1")
    assert e.value.code == 2
    with pytest.raises(ValueError, match="shutdown_timeout_s"):
        ServerConfig(shutdown_timeout_s=float("nan"))


def test_bad_configuration_exits_2_before_loading_a_model(tmp_path: Path, capsys: Any) -> None:
    assert run.run_serve(_args("--api-keys-file", str(tmp_path / "missing"), "--no-ledger")) == 2
    assert run.run_serve(_args("--api-key", "a b c", "--no-ledger")) == 2
    assert run.run_serve(_args("--port", "0", "--no-ledger")) == 2
    assert "prefixserve serve:" in capsys.readouterr().err


def test_a_model_path_that_cannot_be_a_model_exits_2_naming_the_flag(tmp_path: Path, capsys: Any) -> None:
    """Before torch is imported: no such path, a file that is no GGUF, a folder without config.json."""
    text, folder = tmp_path / "keys.txt", tmp_path / "empty"
    text.write_text("alice sk-alice\n")
    folder.mkdir()
    for path, says in ((tmp_path / "missing.gguf", "cannot read it"), (text, "not a GGUF file"),
                       (folder, "holds config.json")):
        assert run.run_serve(_args("--model", str(path), "--no-ledger")) == 2
        err = capsys.readouterr().err
        assert f"--model {path}: " in err and says in err, err


def test_a_port_in_use_is_refused_before_the_model_loads(capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The socket is bound first: a taken port is exit status 2 at once, not after the model's load."""
    import prefixserve.engine

    def no_load(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded although the port is taken")

    monkeypatch.setattr(prefixserve.engine, "build_engine", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert run.run_serve(_args("--port", str(port), "--no-ledger")) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err, err


def test_the_bound_socket_refuses_connections_until_the_server_starts() -> None:
    sock = run.bind_socket("127.0.0.1", 0)
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(sock.getsockname()[:2], timeout=2).close()
    finally:
        sock.close()


def test_a_queue_of_zero_is_refused_at_start() -> None:
    """0 would answer every request 429 (one waits while the engine thread takes it) on a healthy server."""
    from prefixserve.config import EngineConfig

    with pytest.raises(ValueError, match="max_queued_requests"):
        EngineConfig(max_queued_requests=0)
    assert EngineConfig(max_queued_requests=1).max_queued_requests == 1


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start-up must stop before the model loads (and before the port is bound)."""
    import prefixserve.engine

    def no_load(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded although the configuration is bad")

    monkeypatch.setattr(prefixserve.engine, "build_engine", no_load)
    for name in ("PREFIXSERVE_DATA_DIR", "PREFIXSERVE_LEDGER_PATH", "PREFIXSERVE_CACHE_DIR", "PREFIXSERVE_API_KEYS_FILE"):
        monkeypatch.delenv(name, raising=False)


def _one_error_line(capsys: Any) -> str:
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1 and err.startswith("prefixserve serve: "), repr(err)
    return err


def test_unusable_paths_are_one_line_naming_the_flag_and_the_path(
    tmp_path: Path, capsys: Any, no_model: None
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    data = ["--data-dir", str(tmp_path / "data")]
    cases = [  # argv, what the line must say
        (["--ledger-path", str(tmp_path)], [f"--ledger-path {tmp_path}", "is a directory"]),
        (["--ledger-path", str(a_file / "usage.sqlite3")], ["--ledger-path", str(a_file), "not a directory"]),
        (["--api-keys-file", str(tmp_path), "--no-ledger"], [f"--api-keys-file {tmp_path}", "Is a directory"]),
        (["--api-keys-file", str(tmp_path / "missing"), "--no-ledger"], ["--api-keys-file", "No such file"]),
        (["--cache-dir", str(a_file), "--cache-disk-bytes", "1G", "--no-ledger"], [f"--cache-dir {a_file}",
                                                                                  "not a directory"]),
        (["--data-dir", str(a_file)], [f"--data-dir {a_file}", "not a directory"]),
    ]
    for argv, says in cases:
        assert run.run_serve(_args(*(data if "--data-dir" not in argv else []), *argv)) == 2, argv
        line = _one_error_line(capsys)
        assert all(part in line for part in says), (argv, line)
    bad_line = tmp_path / "keys"
    bad_line.write_text("a b c\n")
    assert run.run_serve(_args(*data, "--api-keys-file", str(bad_line), "--no-ledger")) == 2
    assert f"--api-keys-file {bad_line}:1:" in _one_error_line(capsys)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unwritable_ledger_directory_is_named(tmp_path: Path, capsys: Any, no_model: None) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    for argv, flag in ((["--ledger-path", str(locked / "usage.sqlite3")], "--ledger-path"),
                       (["--data-dir", str(locked)], "--data-dir"),
                       (["--ledger-path", str(locked / "sub" / "usage.sqlite3")], "--ledger-path")):
        assert run.run_serve(_args(*argv)) == 2
        line = _one_error_line(capsys)
        assert flag in line and str(locked) in line and ("not writable" in line or "Permission denied" in line), line


def test_a_bad_environment_value_is_a_configuration_error(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, no_model: None
) -> None:
    monkeypatch.setenv("PREFIXSERVE_SHUTDOWN_TIMEOUT", "-5")
    assert run.run_serve(_args("--data-dir", str(tmp_path), "--no-ledger")) == 2
    assert "PREFIXSERVE_SHUTDOWN_TIMEOUT='-5'" in _one_error_line(capsys)


def test_a_setting_the_model_cannot_work_with_is_a_configuration_error(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ConfigError is found while the engine is built (config.session_tokens): one line, status 2, no traceback."""
    import signal

    import prefixserve.engine
    from prefixserve.config import ConfigError

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ConfigError("--max-session-bytes 1,000 holds 0 tokens of this model's KV")

    monkeypatch.setattr(prefixserve.engine, "build_engine", refuse)
    with socket.socket() as s:  # a free port, for the bind run_serve does before the load
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    handler = signal.getsignal(signal.SIGTERM)  # run_serve sets its own for the load
    try:
        assert run.run_serve(_args("--data-dir", str(tmp_path), "--no-ledger", "--port", str(port))) == 2
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert "--max-session-bytes 1,000 holds 0 tokens" in _one_error_line(capsys)


def test_unusable_pricing_and_redis_key_files_name_the_flag_and_the_path(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, no_model: None
) -> None:
    """A missing file, a directory, malformed content: one line naming the flag and the path, status 2
    (they were exit 2 already, but as "[Errno 2] No such file or directory: '...'", naming no flag)."""
    for name in ("PREFIXSERVE_PRICING", "PREFIXSERVE_CACHE_REDIS_URL", "PREFIXSERVE_CACHE_REDIS_KEY",
                 "PREFIXSERVE_CACHE_REDIS_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    (bad_toml := tmp_path / "bad.toml").write_text("[default\n")
    (not_utf8 := tmp_path / "latin1.toml").write_bytes(b"# caf\xe9\n")
    (no_output := tmp_path / "prices.toml").write_text("[default]\ninput = 0.1\n")
    (short := tmp_path / "short.key").write_text("  too-short \n")
    (empty := tmp_path / "empty.key").write_text("\n")
    redis = ["--cache-redis-url", "redis://127.0.0.1:1/0", "--cache-redis-key-file"]
    cases = [  # argv, what the line must say besides the flag and the path
        (["--pricing", str(tmp_path / "missing.toml")], "No such file"),
        (["--pricing", str(tmp_path)], "Is a directory"),
        (["--pricing", str(bad_toml)], "line 1"),
        (["--pricing", str(not_utf8)], "utf-8"),
        (["--pricing", str(no_output)], "missing ['output']"),
        ([*redis, str(tmp_path / "missing.key")], "No such file"),
        ([*redis, str(tmp_path)], "Is a directory"),
        ([*redis, str(short)], "at least 16 bytes, the file holds 9"),
        ([*redis, str(empty)], "at least 16 bytes, the file holds 0"),
    ]
    for argv, says in cases:
        assert run.run_serve(_args("--data-dir", str(tmp_path / "data"), *argv)) == 2, argv
        line = _one_error_line(capsys)
        assert f"{argv[-2]} {argv[-1]}" in line and says in line, (argv, line)
    assert run.run_serve(_args("--data-dir", str(tmp_path / "data"), "--cache-redis-key-file", str(short))) == 2
    assert "--cache-redis-key-file needs --cache-redis-url" in _one_error_line(capsys)  # not "--cache-redis-key"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may read anything")
def test_unreadable_pricing_and_redis_key_files_are_named(tmp_path: Path, capsys: Any, no_model: None) -> None:
    locked = tmp_path / "locked"
    locked.write_text("[default]\ninput = 1\noutput = 1\n" + "#" * 16)
    locked.chmod(0)
    for argv in (["--pricing", str(locked)],
                 ["--cache-redis-url", "redis://127.0.0.1:1/0", "--cache-redis-key-file", str(locked)]):
        assert run.run_serve(_args("--data-dir", str(tmp_path / "data"), *argv)) == 2
        line = _one_error_line(capsys)
        assert f"{argv[-2]} {locked}: cannot read it: Permission denied" in line, line
