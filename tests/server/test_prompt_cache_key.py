"""OpenAI's `prompt_cache_key` on chat completions, completions and the Responses API: accepted (a
string), a placement hint for a gateway and never a cache namespace: it neither widens reuse across
tenants or salts nor narrows it within one; the Responses object echoes it."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.helpers.fake_engine import FakeEngine
from tests.server.conftest import KEY_A, KEY_B, auth

PROMPT = "the same long system prompt, then a question"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def body_for(path: str, key: Any, salt: str | None = None) -> dict[str, Any]:
    body: dict[str, Any]
    if path == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}
    elif path == "/v1/completions":
        body = {"prompt": PROMPT, "max_tokens": 1}
    else:
        body = {"input": PROMPT, "max_output_tokens": 1}
    if key is not None:
        body["prompt_cache_key"] = key
    if salt is not None:
        body["cache_salt"] = salt
    return body


def cached(client: TestClient, path: str, key: Any, api_key: str = KEY_A, salt: str | None = None) -> int:
    r = client.post(path, json=body_for(path, key, salt), headers=auth(api_key))
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    details = usage["input_tokens_details"] if path == "/v1/responses" else usage["prompt_tokens_details"]
    return int(details["cached_tokens"])


@pytest.mark.parametrize("path", ENDPOINTS)
def test_the_key_neither_splits_a_tenants_cache_nor_crosses_tenants_or_salts(
        client: TestClient, engine: FakeEngine, path: str) -> None:
    assert cached(client, path, "user-1") == 0
    assert cached(client, path, "user-2") > 0  # another key, same tenant and salt: shares the cache
    assert cached(client, path, None) > 0  # and so does no key
    assert cached(client, path, "user-1", api_key=KEY_B) == 0  # the same key from another tenant misses
    assert cached(client, path, "user-1", salt="s1") == 0  # ... and under another salt
    namespaces = [r.namespace for r in engine.requests]
    assert namespaces[0] == namespaces[1] == namespaces[2]
    assert namespaces[3].tenant_id == "bob" and namespaces[4].cache_salt == "s1"


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("bad", [7, ["k"], {"k": 1}, "x" * 1025])
def test_a_key_that_is_not_a_string_is_a_400_naming_it(client: TestClient, path: str, bad: Any) -> None:
    r = client.post(path, json=body_for(path, bad), headers=auth())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt_cache_key"


def test_the_responses_object_echoes_the_key(client: TestClient) -> None:
    r = client.post("/v1/responses", json=body_for("/v1/responses", "tenant-affine-7"), headers=auth())
    assert r.status_code == 200, r.text
    assert r.json()["prompt_cache_key"] == "tenant-affine-7"
    stored = client.get(f"/v1/responses/{r.json()['id']}", headers=auth())
    assert stored.json()["prompt_cache_key"] == "tenant-affine-7"
    r = client.post("/v1/responses", json=body_for("/v1/responses", None), headers=auth())
    assert r.json()["prompt_cache_key"] is None  # OpenAI's null when not given
