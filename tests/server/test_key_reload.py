"""SIGHUP reads the API keys again (server/operator/auth.py, `reload_keys`): keys are added, rotated and removed
without a restart, which would lose the RAM cache; a tenant keeps its cache across a rotation of its
key; a file that cannot be read changes nothing."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixserve.server.errors import APIError
from prefixserve.server.operator.auth import KeyStore, reload_keys
from tests.helpers.server_proc import ServerProcess

SYSTEM = "You are the archivist of the harbour museum. " + " ".join(
    f"Shelf {i} holds the logbooks of the year {1800 + i}." for i in range(40))


def test_reload_swaps_every_key_at_once_and_a_failed_read_changes_nothing(caplog: Any) -> None:
    keys = KeyStore.from_specs(["alice sk-old"], "sk-admin")
    reload_keys(keys, lambda: KeyStore.from_specs(["alice sk-new", "bob sk-bob"], "sk-admin"))
    assert keys.identify("Bearer sk-new").tenant_id == "alice" and keys.identify("Bearer sk-bob").tenant_id == "bob"
    assert keys.identify("Bearer sk-admin").is_admin and keys.num_tenants == 2
    with pytest.raises(APIError) as e:
        keys.identify("Bearer sk-old")
    assert e.value.status_code == 401

    def broken() -> KeyStore:
        raise ValueError("--api-keys-file /k: no API keys in the file")

    with caplog.at_level(logging.INFO, logger="prefixserve.server"):
        reload_keys(keys, broken)
        reload_keys(keys, None)
    assert keys.identify("Bearer sk-new").tenant_id == "alice"
    with caplog.at_level(logging.INFO, logger="prefixserve.server"):
        reload_keys(keys, lambda: KeyStore.from_specs(["alice sk-newer", "carol sk-c"], "sk-admin"))
    said = [r.getMessage() for r in caplog.records]
    assert said[-1].endswith("2 tenant(s); added: carol; removed: bob; new keys for: alice"), said[-1]
    assert any("unchanged" in m and "no API keys in the file" in m for m in said), said
    assert any("no --api-keys-file" in m for m in said), said


def test_a_reload_that_makes_a_tenants_key_the_admin_key_says_so(caplog: Any) -> None:
    """Allowed (the key is both), but named: by mistake it hands one customer every other's cache."""
    keys = KeyStore.from_specs(["alice sk-a"], "sk-admin")
    with caplog.at_level(logging.INFO, logger="prefixserve.server"):
        reload_keys(keys, lambda: KeyStore.from_specs(["alice sk-a", "bob sk-admin"], "sk-admin"))
    assert keys.identify("Bearer sk-admin").tenant_id == "bob" and keys.identify("Bearer sk-admin").is_admin
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [("SIGHUP: the admin key is also tenant bob's API key: that key flushes every tenant's cache "
                       "and reads every tenant's usage")], warned


def test_a_keys_file_is_read_as_an_editor_writes_it_and_a_bad_one_says_where(tmp_path: Path) -> None:
    """QA: a byte-order mark (Windows editors) became part of the first key, and every client was
    locked out; a key listed twice named neither line; a NUL-only line was a key."""
    from prefixserve.server.operator.auth import read_keys_file

    f = tmp_path / "keys"
    f.write_bytes(b"\xef\xbb\xbfsk-plain\r\nalice sk-a\n")
    assert read_keys_file(f) == ["sk-plain", "alice sk-a"]
    for content, why in ((b"alice sk-a\nbob sk-a\n", "keys:2: the key of line 1 again"),
                         (b"sk-ok\n\x00\n", "keys:2: an API key spec must not hold control characters"),
                         (b"\xff\xfe", "keys: not UTF-8")):
        f.write_bytes(content)
        with pytest.raises(ValueError, match=why):
            read_keys_file(f)


def test_keys_changed_while_the_model_loaded_apply_when_the_server_starts() -> None:
    """A SIGHUP sent during the load is ignored (it must not kill the process); the key file is read
    again as the server starts, so a key rotated meanwhile is not served with its old value."""
    from fastapi.testclient import TestClient

    from prefixserve.config import ServerConfig
    from prefixserve.server.app import create_app
    from tests.helpers.fake_engine import FakeEngine

    keys = KeyStore.from_specs(["alice sk-leaked"])  # as read before the load
    app = create_app(FakeEngine(), ServerConfig(), keys=keys, keys_source=lambda: KeyStore.from_specs(["alice sk-fresh"]),
                     response_store=None)
    body = {"prompt": "abc", "max_tokens": 1}
    with TestClient(app) as client:
        assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-fresh"}).status_code == 200
        assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-leaked"}).status_code == 401


def test_a_sighup_while_the_server_starts_does_not_kill_it() -> None:
    """QA: a SIGHUP in the first second (before the model load) killed the process."""
    import threading

    srv = ServerProcess(["--api-key", "sk-a", "--no-ledger"])

    def hup() -> None:
        deadline = time.monotonic() + 10
        while srv.proc is None and time.monotonic() < deadline:
            time.sleep(0.01)
        for wait in (0.5, 0.5):  # past the interpreter's own start, before and into the model load
            time.sleep(wait)
            if srv.proc is not None and srv.proc.poll() is None:
                srv.proc.send_signal(signal.SIGHUP)

    sender = threading.Thread(target=hup)
    sender.start()
    with srv:
        sender.join()
        assert _ask(srv, "sk-a", "Hi").status_code == 200
    assert srv.returncode == 0


def _ask(srv: ServerProcess, key: str, question: str) -> httpx.Response:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{srv.openai_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=120)


def _after_hup(srv: ServerProcess, key: str, expect: int) -> httpx.Response:
    assert srv.proc is not None
    srv.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while True:  # the handler runs on the server's loop, between requests
        r = _ask(srv, key, "Where is 1805?")
        if r.status_code == expect or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def test_sighup_rotates_adds_and_removes_keys_and_the_tenant_keeps_its_cache(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("alice sk-alice-1\n")
    with ServerProcess(["--api-keys-file", str(keys_file), "--no-ledger"]) as srv:
        assert _ask(srv, "sk-alice-1", "Where is 1803?").status_code == 200
        keys_file.write_text("alice sk-alice-2\nbob sk-bob-1\n")  # alice's key rotated, bob added
        r = _after_hup(srv, "sk-alice-2", 200)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 200  # alice's cache survived
        assert _ask(srv, "sk-alice-1", "Where is 1805?").status_code == 401
        bob = _ask(srv, "sk-bob-1", "Where is 1805?")
        assert bob.status_code == 200 and bob.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        keys_file.write_text("# nobody\n")  # a file that would leave the server open: refused, keys kept
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while "the API keys are unchanged" not in srv.log_text():
            assert time.monotonic() < deadline, srv.log_tail()
            time.sleep(0.2)
        assert _ask(srv, "sk-alice-2", "Where is 1805?").status_code == 200
        assert _ask(srv, "sk-nobody", "Where is 1805?").status_code == 401
    assert srv.returncode == 0


def test_sighup_without_a_keys_file_is_no_death(tmp_path: Path) -> None:
    with ServerProcess(["--api-key", "sk-a", "--no-ledger"]) as srv:
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while "no --api-keys-file" not in srv.log_text():
            assert time.monotonic() < deadline and srv.proc.poll() is None, srv.log_tail()
            time.sleep(0.2)
        assert _ask(srv, "sk-a", "Hi").status_code == 200
    assert srv.returncode == 0
