"""Stored responses survive a restart (server/openai/responses/disk.py): the store reopened on its SQLite file
answers GET, input_items, `item_reference` and `previous_response_id` as before (the same prompt ids),
per tenant; evictions, DELETE and the bounds reach the file; `store: false` and --no-responses-persist
write nothing; a file that cannot be opened stops `serve` naming the flag and the path."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from prefixserve.config import ServerConfig
from prefixserve.server import run, settings
from prefixserve.server.app import create_app
from prefixserve.server.openai.responses.disk import TABLE, open_disk
from prefixserve.server.openai.responses.store import ResponseStore
from prefixserve.server.operator.auth import KeyStore
from tests.helpers.fake_engine import FakeEngine
from tests.server.conftest import KEY_A, KEY_B, auth

R = "/v1/responses"
KEYS = (KEY_A, f"bob {KEY_B}")


def _app(path: Path, engine: FakeEngine | None = None) -> TestClient:
    """A server on the fake engine whose stored responses live in `path` (as `serve` sets it up)."""
    config = ServerConfig(api_keys=KEYS, responses_path=str(path))
    return TestClient(create_app(engine or FakeEngine(), config))


def _rows(path: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(path) as conn:
        return sorted(conn.execute(f"SELECT tenant_id, response_id FROM {TABLE}").fetchall())


def _store(path: Path, **bounds: int) -> ResponseStore:
    return ResponseStore(**bounds, disk=open_disk(path))


def test_a_stored_response_survives_a_restart_for_its_tenant_only(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    before = FakeEngine()
    with _app(path, before) as client:
        first = client.post(R, json={"instructions": "Be terse.", "input": "hello", "max_output_tokens": 3},
                            headers=auth()).json()
        second = client.post(R, json={"input": "more", "previous_response_id": first["id"], "max_output_tokens": 2},
                             headers=auth()).json()
        chained = {"input": "again", "previous_response_id": second["id"], "max_output_tokens": 2, "store": False}
        assert client.post(R, json=chained, headers=auth()).status_code == 200
        seen = {rid: client.get(f"{R}/{rid}", headers=auth()).json() for rid in (first["id"], second["id"])}
        items = client.get(f"{R}/{second['id']}/input_items", headers=auth()).json()
    after = FakeEngine()
    with _app(path, after) as client:  # a new process would read the same file
        for rid, body in seen.items():
            assert client.get(f"{R}/{rid}", headers=auth()).json() == body
        assert client.get(f"{R}/{second['id']}/input_items", headers=auth()).json() == items
        assert client.post(R, json=chained, headers=auth()).status_code == 200
        assert after.requests[-1].prompt_ids == before.requests[-1].prompt_ids  # the chain renders the same prompt
        answer = first["output"][0]["id"]
        by_ref = {"input": [{"type": "item_reference", "id": answer}, {"role": "user", "content": "x"}],
                  "max_output_tokens": 1}
        assert client.post(R, json=by_ref, headers=auth()).status_code == 200
        for call in (lambda: client.get(f"{R}/{first['id']}", headers=auth(KEY_B)),  # another tenant: not found
                     lambda: client.get(f"{R}/{first['id']}/input_items", headers=auth(KEY_B)),
                     lambda: client.delete(f"{R}/{first['id']}", headers=auth(KEY_B)),
                     lambda: client.post(R, json={"input": "x", "previous_response_id": first["id"]},
                                         headers=auth(KEY_B))):
            assert call().status_code == 404
        assert client.post(R, json=by_ref, headers=auth(KEY_B)).status_code == 400
        assert client.get(f"{R}/{first['id']}", headers=auth()).status_code == 200  # still the owner's
    tenants = {tenant for tenant, _ in _rows(path)}
    assert tenants == {KeyStore.from_specs(KEYS).identify(f"Bearer {KEY_A}").tenant_id}
    assert not any(KEY_A in t or KEY_B in t for t in tenants)  # a derived id, never the key (server/operator/auth.py)


def test_delete_and_store_false_reach_the_file(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    with _app(path) as client:
        kept = client.post(R, json={"input": "keep me", "max_output_tokens": 1}, headers=auth()).json()
        gone = client.post(R, json={"input": "delete me", "max_output_tokens": 1}, headers=auth()).json()
        secret = "never-written-7f3a"
        unstored = client.post(R, json={"input": secret, "max_output_tokens": 1, "store": False}, headers=auth()).json()
        assert client.delete(f"{R}/{gone['id']}", headers=auth()).status_code == 200
    assert [rid for _, rid in _rows(path)] == [kept["id"]]
    on_disk = b"".join(p.read_bytes() for p in tmp_path.iterdir())  # the file, and its WAL if one were left
    assert secret.encode() not in on_disk and unstored["id"].encode() not in on_disk
    with _app(path) as client:
        assert client.get(f"{R}/{gone['id']}", headers=auth()).status_code == 404
        assert client.get(f"{R}/{kept['id']}", headers=auth()).status_code == 200


def test_evictions_and_recency_are_persisted(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    store = _store(path, max_items=3, max_chars=10_000)
    for rid in "abc":
        store.put("t", rid, [{"role": "user", "content": rid}], (), {"id": rid, "output": []})
    assert store.get("t", "a") is not None  # now the most recent: b is the least
    store.put("t", "d", [], (), {"id": "d", "output": []})
    store.close()
    assert [rid for _, rid in _rows(path)] == ["a", "c", "d"]
    store = _store(path, max_items=3, max_chars=10_000)
    store.put("t", "e", [], (), {"id": "e", "output": []})  # the order came back: c is the least recent now
    store.flush()
    assert [rid for _, rid in _rows(path)] == ["a", "d", "e"]
    kept = store.get("t", "a")
    assert kept is not None and kept.messages == ({"role": "user", "content": "a"},)
    store.close()
    smaller = _store(path, max_items=1, max_chars=10_000)  # restarted with a smaller bound: the file shrinks too
    assert len(smaller) == 1 and smaller.get("t", "a") is not None  # the get above made a the most recent
    smaller.close()
    assert _rows(path) == [("t", "a")]


def test_fair_eviction_by_characters_is_persisted(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    store = _store(path, max_items=100, max_chars=1_000)
    for tenant, rid in (("carol", "c1"), ("carol", "c2"), ("erin", "e1"), ("erin", "e2"), ("erin", "e3")):
        store.put(tenant, rid, [], (), {"id": rid, "output": []})
    store.put("carol", "big", [{"role": "user", "content": "x" * 840}], (), {"id": "big", "output": []})  # 902 chars
    store.put("erin", "huge", [{"role": "user", "content": "x" * 2_000}], (), {"id": "huge", "output": []})  # never kept
    store.close()
    expected = [("carol", "big"), ("erin", "e1"), ("erin", "e2"), ("erin", "e3")]
    assert _rows(path) == expected
    reopened = _store(path, max_items=100, max_chars=1_000)
    assert sorted((t, r) for t in ("carol", "erin") for r in ("big", "c1", "c2", "e1", "e2", "e3", "huge")
                  if reopened.get(t, r) is not None) == expected
    reopened.close()


def test_an_unreadable_row_is_a_404_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "responses.sqlite3"
    with _app(path) as client:
        good, bad = (client.post(R, json={"input": t, "max_output_tokens": 1}, headers=auth()).json() for t in "ab")
    with sqlite3.connect(path) as conn:
        conn.execute(f"UPDATE {TABLE} SET response = '{{not json' WHERE response_id = ?", (bad["id"],))
    with caplog.at_level(logging.ERROR), _app(path) as client:
        assert client.get(f"{R}/{bad['id']}", headers=auth()).status_code == 404
        assert client.get(f"{R}/{good['id']}", headers=auth()).json() == good
    assert any(bad["id"] in r.getMessage() and "unreadable" in r.getMessage() for r in caplog.records)
    assert [rid for _, rid in _rows(path)] == [good["id"]]


def test_a_server_without_a_path_keeps_responses_in_memory_only(tmp_path: Path) -> None:
    engine = FakeEngine()
    with TestClient(create_app(engine, ServerConfig(api_keys=KEYS))) as client:
        made = client.post(R, json={"input": "x", "max_output_tokens": 1}, headers=auth()).json()
        assert client.get(f"{R}/{made['id']}", headers=auth()).status_code == 200
    with TestClient(create_app(engine, ServerConfig(api_keys=KEYS))) as client:
        assert client.get(f"{R}/{made['id']}", headers=auth()).status_code == 404


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    settings.add_serve_args(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def refused_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """`serve` runs its start-up up to the model's load, which is refused (exit status 2); a free port."""
    import prefixserve.engine
    from prefixserve.config import ConfigError

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ConfigError("no model in this test")

    monkeypatch.setattr(prefixserve.engine, "build_engine", refuse)
    for name in ("PREFIXSERVE_DATA_DIR", "PREFIXSERVE_RESPONSES_PATH", "PREFIXSERVE_NO_RESPONSES_PERSIST"):
        monkeypatch.delenv(name, raising=False)
    handler = signal.getsignal(signal.SIGTERM)  # run_serve sets its own for the load
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    yield port
    signal.signal(signal.SIGTERM, handler)


def test_serve_puts_the_file_in_the_data_dir_unless_told_otherwise(
    tmp_path: Path, refused_engine: int, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    base = ("--no-ledger", "--port", str(refused_engine))
    assert run.run_serve(_args(*base, "--data-dir", str(tmp_path / "d1"))) == 2
    assert (tmp_path / "d1" / "responses.sqlite3").is_file()
    elsewhere = tmp_path / "elsewhere" / "mine.sqlite3"
    assert run.run_serve(_args(*base, "--data-dir", str(tmp_path / "d2"), "--responses-path", str(elsewhere))) == 2
    assert elsewhere.is_file() and not (tmp_path / "d2" / "responses.sqlite3").exists()
    assert run.run_serve(_args(*base, "--data-dir", str(tmp_path / "d3"), "--no-responses-persist")) == 2
    monkeypatch.setenv("PREFIXSERVE_NO_RESPONSES_PERSIST", "1")
    assert run.run_serve(_args(*base, "--data-dir", str(tmp_path / "d4"))) == 2
    assert run.run_serve(_args(*base, "--data-dir", str(tmp_path / "d5"), "--max-stored-responses", "0")) == 2
    for d in ("d3", "d4", "d5"):
        assert list((tmp_path / d).iterdir()) == [], d  # memory only: no file
    capsys.readouterr()


def test_a_file_that_cannot_be_opened_is_one_line_naming_the_flag(
    tmp_path: Path, refused_engine: int, capsys: Any
) -> None:
    garbage = tmp_path / "garbage.sqlite3"
    garbage.write_bytes(b"not a database at all, " * 100)
    ledger = tmp_path / "usage.sqlite3"
    with sqlite3.connect(ledger) as conn:
        conn.execute("CREATE TABLE usage_records (id INTEGER)")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    damaged = tmp_path / "damaged.sqlite3"
    store = _store(damaged)
    for k in range(100):
        store.put("t", f"r{k}", [{"role": "user", "content": "x" * 3000}], (), {"id": f"r{k}", "output": []})
    store.close()
    with open(damaged, "r+b") as f:  # a page in the middle overwritten: SQLite finds it reading the rows
        f.seek(damaged.stat().st_size // 2)
        f.write(b"\xff" * 8192)
    for path, says in ((tmp_path, "is a directory"), (garbage, "not a database"),
                       (ledger, "not a prefixserve stored-responses file"), (a_file / "r.sqlite3", "not a directory"),
                       (damaged, "malformed")):
        argv = ("--no-ledger", "--port", str(refused_engine), "--data-dir", str(tmp_path / "d"))
        assert run.run_serve(_args(*argv, "--responses-path", str(path))) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"prefixserve serve: --responses-path {path}"), err
        assert says in err, err
    assert garbage.read_bytes() == b"not a database at all, " * 100  # refused, not overwritten


def test_one_server_per_file(tmp_path: Path) -> None:
    """A second store on a file another one holds is refused, naming the flag, until the first closes
    (each server reads the file once, at start: two would each serve only what they loaded)."""
    path = tmp_path / "responses.sqlite3"
    first = open_disk(path)
    with pytest.raises(ValueError, match=f"--data-dir {path}: in use by another prefixserve process"):
        open_disk(path, "--data-dir")
    first.close()
    open_disk(path).close()


@pytest.mark.slow
def test_a_real_server_restarted_on_its_data_dir_serves_its_stored_responses(tmp_path: Path) -> None:
    """The wiring end to end: `serve`'s default file under --data-dir, written by the app and committed by
    its shutdown on SIGTERM, read back by the next process (the same chained prompt, token for token)."""
    import httpx

    from tests.helpers.server_proc import REPO_ROOT, ServerProcess

    def chained(base: str, rid: str) -> dict[str, Any]:
        body = {"input": "And then?", "previous_response_id": rid, "max_output_tokens": 1, "store": False,
                "temperature": 0}
        r = httpx.post(f"{base}/v1/responses", json=body, headers=auth(), timeout=120)
        assert r.status_code == 200, r.text
        return dict(r.json()["usage"])

    args = ["--api-key", KEY_A, "--no-ledger"]
    with ServerProcess(args, data_dir=tmp_path) as srv:
        made = httpx.post(f"{srv.openai_url}/responses", json={"input": "Hi!", "max_output_tokens": 2},
                          headers=auth(), timeout=120).json()
        before = chained(srv.base_url, made["id"])
        # a second server on the same data directory stops at start, before its model loads
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        second = subprocess.run([sys.executable, "-m", "prefixserve.cli", "serve", *args, "--port", port,
                                 "--data-dir", str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True,
                                timeout=120, check=False, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        assert second.returncode == 2 and "in use by another prefixserve process" in second.stderr, second.stderr
    assert srv.returncode == 0 and (tmp_path / "responses.sqlite3").is_file()
    with ServerProcess(args, data_dir=tmp_path) as srv:
        assert httpx.get(f"{srv.openai_url}/responses/{made['id']}", headers=auth(), timeout=30).json() == made
        assert chained(srv.base_url, made["id"])["input_tokens"] == before["input_tokens"]
