"""Response shapes, usage accounting, tenancy and salts over the HTTP layer, on a fake engine."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import replace
from typing import Any

from fastapi.testclient import TestClient

from prefixserve.engine.protocol import EngineHealth
from prefixserve.types import HistoryForm
from tests.helpers.fake_engine import FakeEngine
from tests.server.conftest import ADMIN, KEY_A, KEY_B, FakeLedger, auth

SYSTEM = "You are a helpful assistant. " * 4


def chat_body(user: str = "hi", **extra: Any) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": 5,
        **extra,
    }


def sse_events(resp: Any) -> list[Any]:
    """Parsed `data:` payloads; the literal [DONE] is kept as the string."""
    out: list[Any] = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def check_usage(usage: dict[str, Any], prompt: int, completion: int, cached: int) -> None:
    assert usage == {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "accepted_prediction_tokens": 0,
                                      "rejected_prediction_tokens": 0, "audio_tokens": 0},
    }


def test_completion_non_streaming_shape_and_usage(client: TestClient) -> None:
    r = client.post(
        "/v1/completions", json={"model": "fake-model", "prompt": "abcdef", "max_tokens": 4}, headers=auth()
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "fake-model"
    assert body["choices"] == [{"index": 0, "text": "abcd", "logprobs": None, "finish_reason": "length"}]
    check_usage(body["usage"], 6, 4, 0)
    r2 = client.post("/v1/completions", json={"prompt": "abcdef", "max_tokens": 4}, headers=auth())
    check_usage(r2.json()["usage"], 6, 4, 5)  # the fake engine caps a full hit at len - 1


def test_completion_prompt_as_token_ids(client: TestClient, engine: FakeEngine) -> None:
    for prompt in ([100, 101, 102], [[100, 101, 102]], ["abc"]):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}, headers=auth())
        assert r.status_code == 200, r.text
    assert engine.requests[0].prompt_ids == (100, 101, 102)
    assert engine.requests[2].prompt_ids == tuple(b + 3 for b in b"abc")
    # a client of ids sends the sampled ids back; of text, the text (engine/cache_writer.py offer_turn)
    assert [r.text_history for r in engine.requests] == [False, False, True]
    r = client.post("/v1/completions", json={"prompt": ["abc", [100, 101]], "max_tokens": 2}, headers=auth())
    assert r.status_code == 200, r.text
    assert [r.text_history for r in engine.requests[3:]] == [True, False]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = client.post("/v1/chat/completions", json=chat, headers=auth())
    assert r.status_code == 200, r.text
    assert engine.requests[-1].text_history and engine.requests[-1].history is None  # the reply follows the prompt
    # a template that writes replies back its own way, a thinking model: the finished turn's key says so
    engine.tokenizer.form = (4, "x", None)  # type: ignore[attr-defined]
    engine.tokenizer.thinks = True  # type: ignore[attr-defined]
    r = client.post("/v1/chat/completions", json=chat, headers=auth())
    assert r.status_code == 200, r.text
    assert engine.requests[-1].history == HistoryForm(4, "x", False)


def test_chat_non_streaming_shape_and_usage(client: TestClient, engine: FakeEngine) -> None:
    r = client.post("/v1/chat/completions", json=chat_body(), headers=auth())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    prompt_len = len(engine.requests[0].prompt_ids)
    check_usage(body["usage"], prompt_len, 5, 0)
    assert choice["message"]["content"] == engine.tokenizer.decode(engine.requests[0].prompt_ids[:5])


def test_chat_stream_with_usage(client: TestClient, engine: FakeEngine) -> None:
    body = chat_body(stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body, headers=auth()) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["usage"] is None for c in chunks[:-1])
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length"
    last = chunks[-1]
    assert last["choices"] == []
    check_usage(last["usage"], len(engine.requests[0].prompt_ids), 5, 0)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    nonstream = client.post("/v1/chat/completions", json=chat_body(), headers=auth()).json()
    assert text == nonstream["choices"][0]["message"]["content"]
    assert nonstream["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_completion_stream_with_and_without_usage(client: TestClient) -> None:
    body = {"prompt": "hello", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body, headers=auth()) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in events[:-2]) == "hel"
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"] == []
    check_usage(events[-2]["usage"], 5, 3, 0)
    with client.stream("POST", "/v1/completions", json={**body, "stream_options": None}, headers=auth()) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all("usage" not in c for c in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_stop_string_passes_through(client: TestClient, engine: FakeEngine) -> None:
    r = client.post(
        "/v1/completions", json={"prompt": "abcdef", "max_tokens": 6, "stop": "cd"}, headers=auth()
    )
    assert r.json()["choices"][0] == {"index": 0, "text": "ab", "logprobs": None, "finish_reason": "stop"}
    assert engine.requests[0].sampling.stop == ("cd",)


def test_sampling_fields_reach_the_engine(client: TestClient, engine: FakeEngine) -> None:
    body = {
        "prompt": "x",
        "max_tokens": 3,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "seed": 42,
        "stop": ["a", "b"],
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "n": 1,
        "user": "u1",
        "echo": False,
        "logit_bias": {},
        "unknown_field": {"ignored": True},
    }
    assert client.post("/v1/completions", json=body, headers=auth()).status_code == 200
    s = engine.requests[0].sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop) == (3, 0.5, 0.9, 7, 42, ("a", "b"))
    body = chat_body(max_completion_tokens=2, max_tokens=9, temperature=0, top_k=-1)
    assert client.post("/v1/chat/completions", json=body, headers=auth()).status_code == 200
    s = engine.requests[1].sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.greedy) == (2, 0.0, 0, True)


def test_default_max_tokens_caps_a_request_that_names_none(client: TestClient, engine: FakeEngine) -> None:
    """Without max_tokens: the server's --default-max-tokens (1,024) for chat, within the room the
    prompt leaves in the context (here 512 tokens); OpenAI's 16 for completions. Both reported."""
    body = chat_body()
    del body["max_tokens"]
    r = client.post("/v1/chat/completions", json=body, headers=auth())
    prompt_len = len(engine.requests[0].prompt_ids)
    assert engine.requests[0].sampling.max_tokens == min(1024, engine.max_model_len - prompt_len)
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert client.post("/v1/completions", json={"prompt": "hello"}, headers=auth()).status_code == 200
    assert engine.requests[1].sampling.max_tokens == 16
    assert client.get("/health").json()["default_max_tokens"] == 1024
    card = client.get("/v1/models", headers=auth()).json()["data"][0]
    assert (card["default_max_tokens"], card["max_model_len"]) == (1024, engine.max_model_len)


def test_a_default_max_tokens_gives_each_of_n_choices_the_room_its_prompt_leaves(client: TestClient,
                                                                               engine: FakeEngine) -> None:
    """Each choice is a session of its own with the whole context: under a session budget far larger
    than n contexts, n choices get the default each, within the context. QA: a 3,031-token prompt with
    n 3 on an 8,192 context got 1 token a choice, the default fitted as if the n choices shared one
    context window ((8,192 - 3 x 3,031) / 3 < 1)."""
    prompt = "x" * (engine.max_model_len // 2)
    for n in (1, 2, 4):
        body = chat_body(prompt, n=n)
        del body["max_tokens"]
        assert client.post("/v1/chat/completions", json=body, headers=auth()).status_code == 200
        room = engine.max_model_len - len(engine.requests[-1].prompt_ids)
        assert engine.requests[-1].sampling.max_tokens == min(1024, room), n


def test_prompt_plus_max_tokens_beyond_the_context_is_400(client: TestClient, engine: FakeEngine) -> None:
    """OpenAI's and vLLM's answer: a 400 `context_length_exceeded` naming both numbers, nothing queued."""
    body = chat_body(max_tokens=engine.max_model_len)
    r = client.post("/v1/chat/completions", json=body, headers=auth())
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "max_tokens", err
    assert str(engine.max_model_len) in err["message"] and "prompt" in err["message"]
    r = client.post("/v1/completions", json={"prompt": ["a", "b " * 40], "max_tokens": engine.max_model_len - 5},
                    headers=auth())  # the longest of several prompts decides
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert engine.requests == []
    fits = engine.max_model_len - 1 - len(engine.tokenizer.encode("a"))
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": fits}, headers=auth()).status_code == 200


def test_a_default_max_tokens_is_fitted_into_the_session_budget(make_client: Any) -> None:
    """--max-session-bytes caps prompt + max_tokens (the engine's max_session_tokens, here 300 of the
    512-token context). QA: with a small budget, a request that named no max_tokens got the 1,024
    default and a 400 saying to lower max_tokens. Now the default fits into what the budget leaves,
    as it does into the context, on every endpoint; a max_tokens the client names is still refused."""
    eng = FakeEngine(max_session_tokens=300)
    client = make_client(eng=eng)
    body = chat_body()
    del body["max_tokens"]
    assert client.post("/v1/chat/completions", json=body, headers=auth()).status_code == 200
    assert eng.requests[-1].sampling.max_tokens == 300 - len(eng.requests[-1].prompt_ids)
    assert client.post("/v1/responses", json={"input": "hi"}, headers=auth()).status_code == 200
    assert eng.requests[-1].sampling.max_tokens == 300 - len(eng.requests[-1].prompt_ids)
    assert client.post("/v1/chat/completions", json={**body, "n": 2}, headers=auth()).status_code == 200
    assert eng.requests[-1].sampling.max_tokens == 150 - len(eng.requests[-1].prompt_ids)  # each choice holds its own
    r = client.post("/v1/completions", json={"prompt": "x" * 290}, headers=auth())  # OpenAI's 16, unless less is left
    assert r.status_code == 200 and eng.requests[-1].sampling.max_tokens == 10
    num_sent = len(eng.requests)
    r = client.post("/v1/completions", json={"prompt": "x" * 290, "max_tokens": 11}, headers=auth())
    assert r.status_code == 400 and "session budget" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "max_tokens"  # QA: it named the prompt ("messages" on chat)
    for path, field, body in (("/v1/chat/completions", "max_completion_tokens", chat_body()),
                              ("/v1/chat/completions", "max_tokens", chat_body()),
                              ("/v1/responses", "max_output_tokens", {"input": "hi"})):
        body = {k: v for k, v in body.items() if k != "max_tokens"}
        r = client.post(path, json={**body, field: 295}, headers=auth())
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field and f"lower {field}" in err["message"], (path, err)
    r = client.post("/v1/completions", json={"prompt": "x" * 300}, headers=auth())  # the prompt alone: no room
    assert r.status_code == 400 and len(eng.requests) == num_sent


def test_chat_messages_parts_tools_and_roles(client: TestClient, engine: FakeEngine) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    r = client.post(
        "/v1/chat/completions", json={"messages": messages, "tools": tools, "max_tokens": 2}, headers=auth()
    )
    assert r.status_code == 200, r.text
    prompt = engine.tokenizer.decode(engine.requests[0].prompt_ids)
    assert prompt.startswith('<tools>[{"function": {"name": "get_weather"')
    assert "<system>be brief\n<user>one\ntwo\n<assistant>" in prompt
    assert '"arguments": {"city": "Oslo"}' in prompt  # parsed from the JSON string for the template
    assert "<tool>sunny\n" in prompt
    r = client.post(
        "/v1/chat/completions",
        json={"messages": messages, "tools": tools, "tool_choice": "none", "max_tokens": 2},
        headers=auth(),
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"].get("tool_calls") is None
    # tool_choice none keeps the tools visible (as OpenAI): the same prompt as the turns that call them
    assert engine.requests[1].prompt_ids == engine.requests[0].prompt_ids
    # a tools request is cached like any other: the key is the rendered prompt
    r = client.post(
        "/v1/chat/completions", json={"messages": messages, "tools": tools, "max_tokens": 2}, headers=auth()
    )
    assert (
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(engine.requests[0].prompt_ids) - 1
    )


def test_tenants_and_salts_are_isolated(client: TestClient, engine: FakeEngine) -> None:
    def cached(key: str, salt: str | None) -> int:
        body = {"prompt": "the same long prompt", "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        r = client.post("/v1/completions", json=body, headers=auth(key))
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached(KEY_A, None) == 0
    assert cached(KEY_A, None) > 0
    assert cached(KEY_B, None) == 0  # another tenant misses
    assert cached(KEY_A, "s1") == 0  # another salt of the same tenant misses
    assert cached(KEY_A, "s1") > 0
    assert cached(KEY_B, "s1") == 0  # the same salt under another key still misses
    namespaces = [r.namespace for r in engine.requests]
    assert namespaces[0].tenant_id == namespaces[1].tenant_id != namespaces[2].tenant_id
    assert namespaces[2].tenant_id == "bob"
    assert all(ns.model_id == "fake-model" for ns in namespaces)
    assert all(KEY_A not in ns.tenant_id and KEY_B not in ns.tenant_id for ns in namespaces)
    assert [ns.cache_salt for ns in namespaces] == ["", "", "", "s1", "s1", "s1"]


def test_body_cannot_pick_a_tenant(client: TestClient, engine: FakeEngine) -> None:
    body = {
        "prompt": "p",
        "max_tokens": 1,
        "tenant_id": "bob",
        "namespace": {"tenant_id": "bob"},
        "user": "bob",
        "api_key": KEY_B,
    }
    assert client.post("/v1/completions", json=body, headers=auth(KEY_A)).status_code == 200
    assert engine.requests[0].namespace.tenant_id not in ("bob", KEY_B)


def test_auth(client: TestClient) -> None:
    body = {"prompt": "p", "max_tokens": 1}
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY_A},
        {"Authorization": "Basic x"},
    ):
        r = client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert "wrong" not in r.text
    assert client.get("/v1/models").status_code == 401
    assert client.post("/v1/completions", json=body, headers=auth(KEY_B)).status_code == 200
    assert (
        client.post("/v1/completions", json=body, headers={"Authorization": f"bearer {KEY_A}"}).status_code
        == 200
    )
    # the admin key is not a tenant for generation, but may call the other APIs
    r = client.post("/v1/completions", json=body, headers=auth(ADMIN))
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert client.get("/v1/models", headers=auth(ADMIN)).status_code == 200


def test_open_server_has_one_tenant_and_warns(make_client: Any, engine: FakeEngine, caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="prefixserve.server"):
        client = make_client(api_keys=(), admin_key=None)
    assert any("OPEN" in rec.getMessage() for rec in caplog.records)
    for headers in ({}, auth("anything"), auth("else")):
        assert (
            client.post("/v1/completions", json={"prompt": "p", "max_tokens": 1}, headers=headers).status_code
            == 200
        )
    assert len({r.namespace.tenant_id for r in engine.requests}) == 1


def test_health_answers_head_as_get(make_client: Any) -> None:
    """Load-balancer probes send HEAD: the GET's status, no body."""
    client = make_client()
    r = client.head("/health")
    assert r.status_code == 200 and r.content == b""

    class Unhealthy(FakeEngine):
        def health(self) -> EngineHealth:
            return replace(super().health(), ok=False)

    r = make_client(eng=Unhealthy()).head("/health")
    assert r.status_code == 503 and r.content == b""


def test_models_health_and_unknown_routes(client: TestClient) -> None:
    r = client.get("/v1/models", headers=auth())
    assert r.json()["object"] == "list" and r.json()["data"][0]["id"] == "fake-model"
    assert client.get("/v1/models/fake-model", headers=auth()).json()["id"] == "fake-model"
    assert client.get("/v1/models/other", headers=auth()).status_code == 404
    probe = client.get("/health").json()  # a load balancer's: no key, no other tenant's load
    assert probe["ok"] is True and not {"running", "waiting", "queued"} & set(probe)
    assert not {"running", "waiting", "queued"} & set(client.get("/health", headers=auth()).json())  # a tenant's
    h = client.get("/health", headers=auth(ADMIN))
    assert h.status_code == 200
    assert {k: h.json()[k] for k in ("ok", "exact_reuse", "detail", "running", "waiting", "queued")} == {
        "ok": True,
        "exact_reuse": True,
        "detail": "fake engine",
        "running": 0,
        "waiting": 0,
        "queued": 0,
    }
    for method, path in (("GET", "/nope"), ("POST", "/v1/nope"), ("GET", "/v1/completions")):
        r = client.request(method, path, headers=auth())
        assert r.status_code in (404, 405)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_metrics_take_the_admin_key_where_keys_are_configured(make_client: Any, caplog: Any) -> None:
    """/metrics is every tenant's traffic together: on a server with API keys only the admin key reads
    it (none: 401, a tenant key: 403, OpenAI-shaped), unless the operator opened it; an open server
    (no keys) serves it to anyone, like everything else."""
    keyed = make_client()
    assert keyed.get("/metrics").status_code == 401
    r = keyed.get("/metrics", headers=auth(KEY_A))
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    assert keyed.get("/metrics", headers=auth(ADMIN)).status_code == 200
    with caplog.at_level(logging.WARNING, logger="prefixserve.server"):
        no_admin = make_client(admin_key=None)
    assert any("/metrics answers no one" in rec.getMessage() for rec in caplog.records)  # said at start
    assert no_admin.get("/metrics", headers=auth(KEY_A)).status_code == 403
    assert make_client(metrics_open=True).get("/metrics").status_code == 200
    assert make_client(api_keys=(), admin_key=None).get("/metrics").status_code == 200


def test_browser_pages_of_allowed_origins_may_call_the_api(make_client: Any) -> None:
    """--allowed-origins: a browser's preflight (no key) is answered, and the answers, errors included,
    carry the origin, so a page there can read them; the key is still required. Without the flag, or
    from another origin, no CORS header: the browser refuses the page."""
    page = {"Origin": "https://app.example"}
    preflight = {**page, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    body = {"prompt": "abc", "max_tokens": 2}
    allowed = make_client(allowed_origins=("https://app.example",))
    r = allowed.options("/v1/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert r.headers["x-request-id"].startswith("req_")  # a preflight is named (and logged) too
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = allowed.post("/v1/completions", json=body, headers={**page, **auth()})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert r.headers["x-request-id"].startswith("req_")
    assert {"x-request-id", "retry-after"} <= set(r.headers["access-control-expose-headers"].split(", "))
    r = allowed.post("/v1/completions", json=body, headers=page)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"
    other = {"Origin": "https://evil.example"}
    assert allowed.options("/v1/completions", headers={**preflight, **other}).status_code == 400
    assert "access-control-allow-origin" not in allowed.post("/v1/completions", json=body,
                                                             headers={**other, **auth()}).headers
    closed = make_client()
    assert closed.options("/v1/completions", headers=preflight).status_code == 405
    assert "access-control-allow-origin" not in closed.post("/v1/completions", json=body,
                                                            headers={**page, **auth()}).headers
    anyone = make_client(allowed_origins=("*",))
    assert anyone.post("/v1/completions", json=body, headers={**page, **auth()}).headers[
        "access-control-allow-origin"] == "*"


def test_metrics_text(client: TestClient) -> None:
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3}, headers=auth())
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3}, headers=auth())
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 0}, headers=auth())
    client.post("/v1/completions", json={}, headers=auth("nope"))
    text = client.get("/metrics", headers=auth(ADMIN)).text
    assert 'prefixserve_http_requests_total{endpoint="/v1/completions",status_class="2xx"} 2.0' in text
    assert 'prefixserve_http_requests_total{endpoint="/v1/completions",status_class="4xx"} 2.0' in text
    assert "prefixserve_prompt_tokens_total 6.0" in text
    assert "prefixserve_cached_prompt_tokens_total 2.0" in text
    assert "prefixserve_completion_tokens_total 6.0" in text
    assert "prefixserve_cache_bytes 200.0" in text
    assert "prefixserve_cache_entries 2.0" in text
    assert "prefixserve_cache_evictions_total 0.0" in text  # only grows: a counter
    assert "# TYPE prefixserve_cache_bytes gauge" in text
    assert "prefixserve_cache_hit_ratio 0.25" in text
    assert "prefixserve_cache_token_hit_ratio 0.3333" in text
    assert "prefixserve_engine_weird_key_name 7.0" in text
    assert "prefixserve_engine_cache_misses_total 3.0" in text  # an engine total is a counter ...
    assert "# TYPE prefixserve_engine_cache_entries gauge" in text  # ... a level is not
    assert "prefixserve_time_to_first_token_seconds_bucket" in text
    assert "prefixserve_inter_token_latency_seconds_count 4.0" in text
    assert "prefixserve_requests_in_flight 0.0" in text
    assert "tenant" not in text and KEY_A not in text and "bob" not in text
    from prometheus_client import REGISTRY, generate_latest

    assert b"prefixserve_" not in generate_latest(REGISTRY)  # the app's own registry, not the global one


def test_ledger_gets_one_record_per_request_and_is_closed(make_client: Any) -> None:
    ledger = FakeLedger()
    client = make_client(ledger=ledger)
    r1 = client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 2}, headers=auth())
    r2 = client.post(
        "/v1/completions", json={"prompt": "abcd", "max_tokens": 2, "stream": True}, headers=auth(KEY_B)
    )
    assert r2.status_code == 200 and r2.text.endswith("data: [DONE]\n\n")
    client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": -1}, headers=auth())  # no record
    tenant_a = "key-" + hashlib.sha256(KEY_A.encode()).hexdigest()[:12]
    assert [
        (r.tenant_id, r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.finish_reason)
        for r in ledger.records
    ] == [(tenant_a, 4, 0, 2, "length"), ("bob", 4, 0, 2, "length")]
    assert ledger.records[0].request_id == r1.json()["id"] and ledger.records[0].model == "fake-model"
    client.__exit__(None, None, None)
    assert ledger.closed


def test_usage_api_over_the_real_ledger(make_client: Any, tmp_path: Any) -> None:
    from prefixserve.ledger import Ledger, Pricing

    client = make_client(ledger=Ledger(str(tmp_path / "usage.sqlite3"), Pricing.default()))
    for key in (KEY_A, KEY_A, KEY_B):
        assert (
            client.post(
                "/v1/completions", json={"prompt": "abcdef", "max_tokens": 2}, headers=auth(key)
            ).status_code
            == 200
        )
    start = int(time.time()) - 3600
    mine = client.get(f"/v1/usage?start_time={start}&group_by=tenant_id", headers=auth(KEY_A))
    assert mine.status_code == 200, mine.text
    results = [res for bucket in mine.json()["data"] for res in bucket["results"]]
    assert [
        (r["num_model_requests"], r["input_tokens"], r["input_cached_tokens"], r["output_tokens"])
        for r in results
    ] == [(2, 12, 5, 4)]
    assert all(r["tenant_id"] != "bob" for r in results)
    everyone = client.get(f"/v1/usage?start_time={start}&group_by=tenant_id", headers=auth(ADMIN))
    tenants = sorted(r["tenant_id"] for b in everyone.json()["data"] for r in b["results"])
    assert len(tenants) == 2 and "bob" in tenants
    bad = client.get(f"/v1/usage?start_time={start}&tenant_id=bob", headers=auth(KEY_A))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tenant_id"
    assert client.get("/v1/usage", headers=auth(KEY_A)).json()["error"]["param"] == "start_time"
    assert client.get(f"/v1/usage?start_time={start}").status_code == 401


def test_usage_api_while_the_ledger_cannot_commit_is_a_503_to_retry(make_client: Any, tmp_path: Any,
                                                                      monkeypatch: Any) -> None:
    """A full or failing disk: the ledger holds its records and cannot make them durable, so a query
    (which reads its own writes) cannot answer now: a 503 with Retry-After, not a 500."""
    from prefixserve.ledger import Ledger, Pricing

    ledger = Ledger(str(tmp_path / "usage.sqlite3"), Pricing.default())
    client = make_client(ledger=ledger)

    def stuck(timeout: float = 5.0) -> None:
        raise TimeoutError(f"usage ledger: records not durable after {timeout} s")

    monkeypatch.setattr(ledger, "flush", stuck)
    r = client.get(f"/v1/usage?start_time={int(time.time()) - 3600}", headers=auth(ADMIN))
    assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
    assert r.json()["error"]["code"] == "ledger_not_durable"


def test_usage_api_without_a_ledger_is_404(client: TestClient) -> None:
    r = client.get("/v1/usage?start_time=0", headers=auth())
    assert r.status_code == 404 and r.json()["error"]["code"] == "ledger_disabled"


def test_shutdown_drains_the_engine(make_client: Any, engine: FakeEngine) -> None:
    client = make_client()
    client.__exit__(None, None, None)
    assert engine.shutdown_calls == [True]


def test_an_assistant_refusal_part_is_its_text(client: TestClient, engine: FakeEngine) -> None:
    """A client replaying an assistant message that refused (OpenAI's content part {"type": "refusal"})."""
    messages = [{"role": "user", "content": "do it"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
                {"role": "user", "content": "ok"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, headers=auth())
    assert r.status_code == 200, r.text
    assert "<assistant>I can't help with that.\n" in engine.tokenizer.decode(engine.requests[-1].prompt_ids)


def test_a_turn_likely_to_be_continued_is_marked_for_an_eager_refill(client: TestClient, engine: FakeEngine) -> None:
    """Request.continues (engine/refill.py): a chat whose history holds a reply, or that offers tools
    (a call's result comes back), is likely to be continued; a one-shot question, a completion, or
    tools with tool_choice none are not."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    cases = [("/v1/chat/completions", chat_body(), False),
             ("/v1/chat/completions", {**chat_body(), "messages": history}, True),
             ("/v1/chat/completions", chat_body(tools=tools), True),
             ("/v1/chat/completions", chat_body(tools=tools, tool_choice="none"), False),
             ("/v1/completions", {"prompt": "a", "max_tokens": 2}, False),
             ("/v1/responses", {"input": history}, True)]
    for path, body, continues in cases:
        assert client.post(path, json=body, headers=auth()).status_code == 200, body
        assert engine.requests[-1].continues is continues, body
