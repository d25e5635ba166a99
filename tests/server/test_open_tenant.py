"""The open server's tenant and named tenants live in separate name spaces (types.OPEN_TENANT_ID):
a tenant a key file names `default` (the open tenant's id before) gets none of an open server's
cached prompts, stored responses or usage, on the same data; ledgers and stored-responses files
written by an open server before the change read as the open tenant's."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from prefixserve.config import ServerConfig
from prefixserve.ledger import Ledger
from prefixserve.ledger import store as ledger_store
from prefixserve.server.app import create_app
from prefixserve.server.openai.responses.disk import TABLE, open_disk
from prefixserve.server.operator.auth import KeyStore, parse_key_spec, read_keys_file
from prefixserve.types import LEGACY_OPEN_TENANT_ID, OPEN_TENANT_ID
from tests.helpers.fake_engine import FakeEngine

KEY = "sk-named-default-0123456789"
ADMIN = "sk-admin-0123456789"
PROMPT = {"model": "fake-model", "prompt": "The open server's long system prompt, asked once. " * 4, "max_tokens": 3}


def _app(engine: FakeEngine, tmp_path: Path, api_keys: tuple[str, ...] = ()) -> tuple[TestClient, Ledger]:
    """A server on `engine` (whose cache outlives the app, as the disk and Redis tiers outlive a
    restart) with its ledger and stored responses in `tmp_path`, as `serve` sets them up."""
    config = ServerConfig(api_keys=api_keys, admin_key=ADMIN if api_keys else None,
                          responses_path=str(tmp_path / "responses.sqlite3"))
    ledger = Ledger(str(tmp_path / "usage.sqlite3"))
    return TestClient(create_app(engine, config, ledger)), ledger


def _usage(client: TestClient, ledger: Ledger, headers: dict[str, str], **params: Any) -> list[dict[str, Any]]:
    ledger.flush()  # records are committed off the request path
    today = int(time.time()) // 86400 * 86400
    r = client.get("/v1/usage", params={"start_time": today, "bucket_width": "1d", **params}, headers=headers)
    assert r.status_code == 200, r.text
    return [row for bucket in r.json()["data"] for row in bucket["results"]]


def test_no_key_spec_can_name_the_open_tenant() -> None:
    assert KeyStore().identify(None).tenant_id == OPEN_TENANT_ID != LEGACY_OPEN_TENANT_ID
    assert KeyStore.from_specs([f"default {KEY}"]).identify(f"Bearer {KEY}").tenant_id == "default"
    with pytest.raises(ValueError, match="invalid tenant name"):
        parse_key_spec(f"{OPEN_TENANT_ID} {KEY}")
    assert parse_key_spec(OPEN_TENANT_ID)[0].startswith("key-")  # a bare spec is a key, its id derived


def test_a_named_tenant_default_sees_none_of_the_open_servers_prompts_responses_or_usage(tmp_path: Path) -> None:
    engine = FakeEngine()
    app, ledger = _app(engine, tmp_path)
    with app as client:  # open: no keys
        assert client.post("/v1/completions", json=PROMPT).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert client.post("/v1/completions", json=PROMPT).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        stored = client.post("/v1/responses", json={"input": "remember me", "max_output_tokens": 2}).json()
        assert client.get(f"/v1/responses/{stored['id']}").status_code == 200
        assert {row["tenant_id"] for row in _usage(client, ledger, {}, group_by="tenant_id")} == {OPEN_TENANT_ID}

    (tmp_path / "keys").write_text(f"default {KEY}\n")  # the operator adds keys, one tenant named `default`
    named = {"Authorization": f"Bearer {KEY}"}
    app, ledger = _app(engine, tmp_path, tuple(read_keys_file(tmp_path / "keys")))
    with app as client:
        r = client.post("/v1/completions", json=PROMPT, headers=named).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the open tenant's prompt is not its
        assert client.get(f"/v1/responses/{stored['id']}", headers=named).status_code == 404
        chained = client.post("/v1/responses", headers=named,
                              json={"input": "and?", "previous_response_id": stored["id"], "max_output_tokens": 2})
        assert chained.status_code == 404, chained.text
        mine = _usage(client, ledger, named, group_by="tenant_id")
        assert [(row["tenant_id"], row["num_model_requests"]) for row in mine] == [("default", 1)]
        by_tenant = {row["tenant_id"]: row["num_model_requests"]
                     for row in _usage(client, ledger, {"Authorization": f"Bearer {ADMIN}"}, group_by="tenant_id")}
        assert set(by_tenant) == {OPEN_TENANT_ID, "default"} and by_tenant[OPEN_TENANT_ID] == 3


def test_an_open_servers_ledger_and_responses_of_before_read_as_the_open_tenants(tmp_path: Path) -> None:
    """Files of schema version 1, where an open server wrote tenant "default": the first open by this
    version moves those rows to OPEN_TENANT_ID and leaves other tenants' be; the CLI (read-only)
    asks for that first open rather than misreading one."""
    ledger_path = tmp_path / "usage.sqlite3"
    Ledger(str(ledger_path)).close()
    with sqlite3.connect(ledger_path) as conn:
        columns = ledger_store._COLUMNS
        for request_id, tenant in (("r1", LEGACY_OPEN_TENANT_ID), ("r2", LEGACY_OPEN_TENANT_ID), ("r3", "alice")):
            conn.execute(f"INSERT INTO {ledger_store.TABLE} ({columns}) VALUES (?, ?, ?, 'm', 10, 4, 2, 'stop', 0, 0, 0, 0)",
                         (request_id, time.time(), tenant))
        conn.execute("PRAGMA user_version = 1")
    with pytest.raises(RuntimeError, match="start the server on it once"):
        ledger_store.open_existing(str(ledger_path))
    Ledger(str(ledger_path)).close()
    with sqlite3.connect(ledger_path) as conn:
        rows = sorted(conn.execute(f"SELECT request_id, tenant_id FROM {ledger_store.TABLE}").fetchall())
        assert rows == [("r1", OPEN_TENANT_ID), ("r2", OPEN_TENANT_ID), ("r3", "alice")]
        assert conn.execute("PRAGMA user_version").fetchone()[0] == ledger_store.SCHEMA_VERSION
    ledger_store.open_existing(str(ledger_path)).close()

    responses_path = tmp_path / "responses.sqlite3"
    open_disk(responses_path).close()
    with sqlite3.connect(responses_path) as conn:
        for tenant, response_id in ((LEGACY_OPEN_TENANT_ID, "resp_1"), ("alice", "resp_2")):
            conn.execute(f"INSERT INTO {TABLE} VALUES (?, ?, 1, '[]', '[]', '{{\"output\": []}}')", (tenant, response_id))
        conn.execute("PRAGMA user_version = 1")
    open_disk(responses_path).close()
    with sqlite3.connect(responses_path) as conn:
        assert sorted(conn.execute(f"SELECT tenant_id, response_id FROM {TABLE}").fetchall()) == [
            (OPEN_TENANT_ID, "resp_1"), ("alice", "resp_2")]
