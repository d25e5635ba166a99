"""`DELETE /v1/cache` over HTTP (fake engine): who may flush what, and what is forgotten."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from tests.server.conftest import ADMIN, KEY_A, KEY_B, auth

PROMPT = "the same prompt for everyone"


def cached_tokens(client: TestClient, key: str, salt: str | None = None) -> int:
    body: dict[str, Any] = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    r = client.post("/v1/completions", json=body, headers=auth(key))
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def seed(client: TestClient) -> None:
    """Tenant a (unsalted and salt s1) and tenant bob each cache PROMPT once."""
    assert cached_tokens(client, KEY_A) == 0
    assert cached_tokens(client, KEY_A, "s1") == 0
    assert cached_tokens(client, KEY_B) == 0


def flush(client: TestClient, key: str, **kw: Any) -> Any:
    return client.request("DELETE", "/v1/cache", headers=auth(key), **kw)


def test_tenant_flushes_only_its_own_namespaces(client: TestClient) -> None:
    seed(client)
    r = flush(client, KEY_A)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "cache.flush" and body["cache_salt"] is None
    assert (body["deleted_entries"], body["deleted_bytes"]) == (2, 200)  # a and a/s1
    assert body["tiers"] == {"ram": {"deleted_entries": 2, "deleted_bytes": 200}}
    assert cached_tokens(client, KEY_A) == 0
    assert cached_tokens(client, KEY_A, "s1") == 0
    assert cached_tokens(client, KEY_B) == len(PROMPT) - 1  # bob's entry untouched


def test_a_flush_a_tier_did_not_answer_is_a_503_to_retry(client: TestClient, engine: Any) -> None:
    """QA: with Redis down or stalled the flush answered 200 with 0 deleted there, which reads as
    "nothing to forget" while the tenant's values stayed in Redis for any replica to serve."""
    seed(client)
    engine.redis_down = True
    r = flush(client, KEY_A)
    assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
    err = r.json()["error"]
    assert err["code"] == "flush_incomplete" and "redis" in err["message"] and "ram 2" in err["message"]
    assert cached_tokens(client, KEY_A) == 0  # what answered forgot
    engine.redis_down = False
    assert flush(client, KEY_A).status_code == 200  # the retry


def test_salt_flushes_only_that_salt(client: TestClient) -> None:
    seed(client)
    r = flush(client, KEY_A, json={"cache_salt": "s1"})
    assert r.status_code == 200 and r.json()["deleted_entries"] == 1
    assert cached_tokens(client, KEY_A, "s1") == 0
    assert cached_tokens(client, KEY_A) > 0
    r = flush(client, KEY_A, params={"cache_salt": "nope"})  # the query string works too
    assert r.status_code == 200 and r.json()["deleted_entries"] == 0


def test_tenant_cannot_flush_another_or_everything(client: TestClient) -> None:
    seed(client)
    for kw in ({"json": {"tenant": "bob"}}, {"params": {"tenant": "bob"}}, {"json": {"all": True}}):
        r = flush(client, KEY_A, **kw)
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "admin_only"
    assert cached_tokens(client, KEY_B) > 0


def test_a_tenant_may_name_itself(client: TestClient) -> None:
    """Naming one's own tenant flushes what leaving it out does; only naming another needs the admin key."""
    seed(client)
    for kw in ({"json": {"tenant": "bob"}}, {"params": {"tenant": "bob"}}):
        r = flush(client, KEY_B, **kw)
        assert r.status_code == 200, r.text
        assert r.json()["tenant"] == "bob"
    assert cached_tokens(client, KEY_B) == 0
    assert cached_tokens(client, KEY_A) > 0  # a's entries untouched
    r = flush(client, KEY_B, json={"tenant": "bob", "all": True})
    assert r.status_code == 403 and r.json()["error"]["param"] == "all"


def test_admin_flushes_a_named_tenant_or_all(client: TestClient) -> None:
    seed(client)
    r = flush(client, ADMIN)  # the bare admin key must say whom
    assert r.status_code == 400 and r.json()["error"]["param"] == "tenant"
    r = flush(client, ADMIN, json={"tenant": "bob"})
    assert r.status_code == 200 and r.json()["deleted_entries"] == 1
    assert cached_tokens(client, KEY_B) == 0
    assert cached_tokens(client, KEY_A) > 0
    r = flush(client, ADMIN, params={"all": "true"})
    assert r.status_code == 200 and r.json()["deleted_entries"] == 4  # the fake keeps one per request: a twice, a/s1, bob
    assert cached_tokens(client, KEY_A) == 0


def test_bad_input_is_an_openai_shaped_400(client: TestClient) -> None:
    cases = [
        ({"content": b"{not json"}, None),
        ({"json": [1]}, None),
        ({"json": {"cache_salt": ""}}, "cache_salt"),
        ({"json": {"cache_salt": 5}}, "cache_salt"),
        ({"json": {"tenant": "bob", "extra": 1}}, "extra"),
        ({"params": {"all": "maybe"}}, "all"),
        ({"json": {"cache_salt": "x"}, "params": {"cache_salt": "y"}}, "cache_salt"),
    ]
    for kw, param in cases:
        r = flush(client, ADMIN if "tenant" in str(kw) else KEY_A, **kw)
        assert r.status_code == 400, (kw, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (kw, err)
    r = client.request("DELETE", "/v1/cache")
    assert r.status_code == 401
