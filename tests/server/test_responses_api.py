"""POST /v1/responses on the fake engine (it replays the prompt's bytes): a Responses body is the chat
request it means (the same prompt ids, so the same cache entries), answered as a `response` object or
its typed event stream, with usage (cached tokens included) and OpenAI-shaped errors."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.helpers.fake_engine import FakeEngine
from tests.server.conftest import ADMIN, KEY_A, KEY_B, auth

R, CH = "/v1/responses", "/v1/chat/completions"
TOOLS_R = [{"type": "function", "name": "add", "description": "Add.", "parameters": {"type": "object"}}]
TOOLS_CH = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'


def events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]


@pytest.mark.parametrize(
    ("body", "messages", "extra"),
    [
        ({"input": "hi"}, [{"role": "user", "content": "hi"}], {}),
        ({"instructions": "Be terse.", "input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]},
                                                 {"type": "message", "role": "assistant",
                                                  "content": [{"type": "output_text", "text": "b"}]},
                                                 {"role": "developer", "content": "c"}]},
         [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "a"},
          {"role": "assistant", "content": "b"}, {"role": "system", "content": "c"}], {}),
        ({"input": [{"role": "user", "content": "add"},
                    {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1}'},
                    {"type": "function_call_output", "call_id": "call_1", "output": "2"}], "tools": TOOLS_R},
         [{"role": "user", "content": "add"},
          {"role": "assistant", "content": None, "tool_calls": [
              {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "2"}], {"tools": TOOLS_CH}),
    ],
)
def test_a_responses_body_is_keyed_as_the_chat_request_it_means(
    client: TestClient, engine: FakeEngine, body: dict[str, Any], messages: list[dict[str, Any]], extra: dict[str, Any],
) -> None:
    r = client.post(R, json={**body, "max_output_tokens": 3}, headers=auth())
    assert r.status_code == 200, r.text
    client.post(CH, json={"messages": messages, "max_tokens": 3, **extra}, headers=auth())
    assert engine.requests[-2].prompt_ids == engine.requests[-1].prompt_ids
    assert engine.requests[-2].namespace == engine.requests[-1].namespace


def test_response_object_and_its_usage(client: TestClient, engine: FakeEngine) -> None:
    body = {"input": "hello", "max_output_tokens": 4, "metadata": {"k": "v"}}
    first = client.post(R, json=body, headers=auth()).json()
    assert first["object"] == "response" and first["id"].startswith("resp_")
    assert first["status"] == "incomplete" and first["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = first["output"]
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt_ids)
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "incomplete"
    assert message["content"] == [{"type": "output_text", "text": prompt[:4], "annotations": [], "logprobs": []}]
    assert first["usage"] == {"input_tokens": len(prompt), "input_tokens_details": {"cached_tokens": 0},
                              "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": len(prompt) + 4}
    assert first["metadata"] == {"k": "v"} and first["store"] is True and first["max_output_tokens"] == 4
    again = client.post(R, json=body, headers=auth()).json()
    assert again["usage"]["input_tokens_details"]["cached_tokens"] == len(prompt) - 1  # the fake's full hit


def test_streamed_events_end_with_the_whole_response(client: TestClient) -> None:
    raw = client.post(R, json={"input": "hello", "max_output_tokens": 5, "stream": True}, headers=auth()).text
    assert "[DONE]" not in raw  # the stream ends with its last event, as OpenAI's
    evs = events(raw)
    kinds = [e["type"] for e in evs]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    named = [block.split("\n") for block in raw.strip().split("\n\n")]  # each event names its type, as OpenAI's
    assert [(lines[0], json.loads(lines[1][6:])["type"]) for lines in named] == [(f"event: {k}", k) for k in kinds]
    text = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    final = evs[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == text == evs[-4]["text"] and len(text) == 5
    assert final["usage"]["output_tokens"] == 5 and final["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert evs[0]["response"]["status"] == "in_progress" and evs[0]["response"]["usage"] is None


def test_a_tool_call_is_a_function_call_item_streamed_and_not(client: TestClient, engine: FakeEngine) -> None:
    prompt_len = len(engine.tokenizer.render_chat([{"role": "user", "content": CALL}], TOOLS_CH))
    body = {"input": CALL, "tools": TOOLS_R, "max_output_tokens": prompt_len}  # the fake replays the prompt
    out = client.post(R, json=body, headers=auth()).json()["output"]
    assert [o["type"] for o in out] == ["message", "function_call"]
    call = out[1]
    assert (call["name"], call["arguments"], call["status"]) == ("add", '{"a": 1}', "completed")
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    evs = events(client.post(R, json={**body, "stream": True}, headers=auth()).text)
    kinds = [e["type"] for e in evs]
    assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert evs[-3]["arguments"] == '{"a": 1}' and evs[-3]["name"] == "add"
    assert [o["type"] for o in evs[-1]["response"]["output"]] == ["message", "function_call"]
    assert evs[-1]["response"]["status"] == "completed" and evs[-1]["response"]["incomplete_details"] is None
    assert evs[-1]["response"]["output"][0]["status"] == "completed"  # the text before the call: not cut
    replayed = engine.tokenizer.decode(engine.tokenizer.render_chat([{"role": "user", "content": CALL}], TOOLS_CH))
    cut = {**body, "max_output_tokens": replayed.index(CALL) + CALL.index("1}}")}  # inside the arguments
    for response in (client.post(R, json=cut, headers=auth()).json(),
                     events(client.post(R, json={**cut, "stream": True}, headers=auth()).text)[-1]["response"]):
        assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
        assert "<tool_call>" not in response["output"][0]["content"][0]["text"]  # never call syntax as text
        assert {k: response["output"][1][k] for k in ("name", "arguments", "status")} == {
            "name": "add", "arguments": '{"a":', "status": "incomplete"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": []}, "input"),
        ({}, "input"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
        ({"input": [{"type": "reasoning", "content": "thought"}, {"role": "user", "content": "a"}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "input[0].content[0].type"),
        ({"instructions": "s", "input": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]},
         "input[1].role"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": "x", "temperature": 9}, "temperature"),
        ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
        ({"input": "x", "include": ["message.output_text.logprob"]}, "include[0]"),  # a typo is reported
        ({"input": "x", "metadata": {"k": 1}}, "metadata"),
        ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),
        ({"input": "x", "metadata": {str(k): "v" for k in range(17)}}, "metadata"),
        ({"input": [{"role": "user", "content": "a"}, {"type": "function_call_output", "call_id": "c9", "output": "1"}]},
         "input[1].call_id"),  # answers no call
    ],
)
def test_bad_input_names_the_responses_field(client: TestClient, body: dict[str, Any], param: str) -> None:
    r = client.post(R, json=body, headers=auth())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    assert "messages" not in r.json()["error"]["message"]  # the message names the Responses field too


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tools": [{"type": "function", "parameters": {"type": "object"}}]}, "tools[0].name", "tools[0].name"),
        ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tool_choice", "{'type': 'function', 'name': ...}"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "{'type': 'function', 'name': ...}"),
        ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format", "text.format"),
    ],
)
def test_bad_input_is_told_in_the_responses_shape(client: TestClient, body: dict[str, Any], param: str,
                                                  says: str) -> None:
    """QA: the messages described the chat shapes (`tools[0].function.name`, `{'type': 'function',
    'function': {'name': ...}}`, `response_format.json_schema`) to a Responses client."""
    err = client.post(R, json={"input": "x", **body}, headers=auth()).json()["error"]
    assert err["param"] == param and says in err["message"], err
    assert ".function." not in err["message"] and "response_format" not in err["message"], err


def test_an_engine_failure_is_a_500_or_a_response_failed_event(client: TestClient, engine: FakeEngine) -> None:
    engine.fail_with = "boom"
    r = client.post(R, json={"input": "p"}, headers=auth())
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
    evs = events(client.post(R, json={"input": "p", "stream": True}, headers=auth()).text)
    assert [e["type"] for e in evs] == ["response.created", "response.in_progress", "response.failed"]
    assert evs[-1]["response"]["status"] == "failed" and evs[-1]["response"]["error"]["message"] == "boom"
    engine.fail_with = None
    assert client.post(R, json={"input": "p"}, headers=auth()).status_code == 200


def test_response_failed_keeps_the_text_already_streamed(client: TestClient, engine: FakeEngine) -> None:
    """A stream that fails after some text: the failed response holds that text, as an incomplete
    message (a client keeping the last event's response loses nothing it was shown)."""
    engine.fail_with, engine.fail_after = "boom", 3
    try:
        evs = events(client.post(R, json={"input": "pqrs", "stream": True}, headers=auth()).text)
    finally:
        engine.fail_with, engine.fail_after = None, 0
    shown = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    assert len(shown) > 0 and evs[-1]["type"] == "response.failed"
    failed = evs[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "boom"
    [message] = failed["output"]
    opened = next(e["item"] for e in evs if e["type"] == "response.output_item.added")
    assert message["id"] == opened["id"] and message["status"] == "incomplete"
    assert message["content"][0]["text"] == shown
    assert client.get(f"{R}/{failed['id']}", headers=auth()).json() == failed  # stored, as OpenAI keeps it


def test_requests_to_the_new_routes_are_counted_under_their_own_label(client: TestClient) -> None:
    client.post(R, json={"input": "p", "max_output_tokens": 1}, headers=auth())
    client.post("/tokenize", json={"prompt": "p"}, headers=auth())
    text = client.get("/metrics", headers=auth(ADMIN)).text
    for route in ("/v1/responses", "/tokenize"):
        assert f'prefixserve_http_requests_total{{endpoint="{route}",status_class="2xx"}}' in text, route


def test_previous_response_id_continues_the_stored_conversation(client: TestClient, engine: FakeEngine) -> None:
    """The chained request renders the history a client re-sending it would (its own instructions,
    not the previous ones), so it is keyed, and served from the cache, the same way."""
    first = client.post(R, json={"instructions": "Old.", "input": "hello", "max_output_tokens": 3}, headers=auth()).json()
    assert first["store"] is True and first["previous_response_id"] is None
    said = first["output"][0]["content"][0]["text"]
    second = client.post(R, json={"instructions": "New.", "input": "more", "previous_response_id": first["id"],
                                  "max_output_tokens": 3}, headers=auth()).json()
    assert second["previous_response_id"] == first["id"]
    client.post(CH, json={"messages": [{"role": "system", "content": "New."}, {"role": "user", "content": "hello"},
                                       {"role": "assistant", "content": said}, {"role": "user", "content": "more"}],
                          "max_tokens": 3}, headers=auth())
    assert engine.requests[-2].prompt_ids == engine.requests[-1].prompt_ids
    third = client.post(R, json={"input": [{"role": "user", "content": "again"}], "previous_response_id": second["id"],
                                 "max_output_tokens": 3}, headers=auth())
    assert third.status_code == 200  # a chain of three: the second's stored history includes the first's
    assert engine.tokenizer.decode(engine.requests[-1].prompt_ids).count("<user>") == 3


def test_a_chain_stays_in_its_cache_salt_unless_a_request_names_another(client: TestClient, engine: FakeEngine) -> None:
    """A continuation that does not repeat the first request's cache_salt is keyed in its namespace,
    where its history is cached (it used to land unsalted and miss)."""
    first = client.post(R, json={"input": "hello", "cache_salt": "s1", "max_output_tokens": 3}, headers=auth()).json()
    assert first["cache_salt"] == "s1"
    salted = engine.requests[-1].namespace
    second = client.post(R, json={"input": "more", "previous_response_id": first["id"], "max_output_tokens": 3},
                         headers=auth()).json()
    assert engine.requests[-1].namespace == salted and second["cache_salt"] == "s1"
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0
    third = client.post(R, json={"input": "again", "previous_response_id": second["id"], "cache_salt": "s2",
                                 "max_output_tokens": 3}, headers=auth()).json()
    assert third["cache_salt"] == "s2" and engine.requests[-1].namespace not in (salted,)
    assert third["usage"]["input_tokens_details"]["cached_tokens"] == 0
    plain = client.post(R, json={"input": "x", "max_output_tokens": 1}, headers=auth()).json()
    assert plain["cache_salt"] is None and engine.requests[-1].namespace.cache_salt == ""


def test_a_function_call_output_continues_a_stored_call(client: TestClient, engine: FakeEngine) -> None:
    prompt_len = len(engine.tokenizer.render_chat([{"role": "user", "content": CALL}], TOOLS_CH))
    first = client.post(R, json={"input": CALL, "tools": TOOLS_R, "max_output_tokens": prompt_len},
                        headers=auth()).json()
    call = first["output"][-1]
    follow = [{"type": "function_call_output", "call_id": call["call_id"], "output": "2"}]
    r = client.post(R, json={"input": follow, "tools": TOOLS_R, "previous_response_id": first["id"],
                             "max_output_tokens": 2}, headers=auth())
    assert r.status_code == 200, r.text
    rendered = engine.tokenizer.decode(engine.requests[-1].prompt_ids)
    assert '"id": "' + call["call_id"] in rendered and "<tool>2" in rendered


def test_stored_responses_are_the_tenants_own(client: TestClient) -> None:
    made = client.post(R, json={"input": "mine", "max_output_tokens": 2, "stream": True}, headers=auth()).text
    rid = events(made)[-1]["response"]["id"]
    got = client.get(f"{R}/{rid}", headers=auth())
    assert got.status_code == 200 and got.json() == events(made)[-1]["response"]
    for call in (lambda: client.get(f"{R}/{rid}", headers=auth(KEY_B)),
                 lambda: client.delete(f"{R}/{rid}", headers=auth(KEY_B)),
                 lambda: client.post(R, json={"input": "x", "previous_response_id": rid}, headers=auth(KEY_B))):
        r = call()
        assert r.status_code == 404 and rid in r.json()["error"]["message"]
    assert client.delete(f"{R}/{rid}", headers=auth()).json() == {"id": rid, "object": "response.deleted",
                                                                   "deleted": True}
    assert client.get(f"{R}/{rid}", headers=auth()).status_code == 404
    unstored = client.post(R, json={"input": "x", "store": False, "max_output_tokens": 1}, headers=auth()).json()
    assert unstored["store"] is False
    r = client.post(R, json={"input": "x", "previous_response_id": unstored["id"]}, headers=auth())
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_input_items_list_the_conversation_a_response_answered(client: TestClient) -> None:
    """GET /v1/responses/{id}/input_items: OpenAI's list of the items the response took as input, a
    chain's earlier turns included, newest first unless order=asc, paged by item id."""
    first = client.post(R, json={"instructions": "Be terse.", "input": "hello", "max_output_tokens": 2},
                        headers=auth()).json()
    said = first["output"][0]
    listed = client.get(f"{R}/{first['id']}/input_items", headers=auth()).json()
    [item] = listed["data"]
    assert listed["object"] == "list" and listed["has_more"] is False and listed["first_id"] == item["id"]
    assert item["type"] == "message" and item["role"] == "user" and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "input_text", "text": "hello"}]  # instructions are no input item
    later = [{"role": "user", "content": [{"type": "input_text", "text": "more"}]},
             {"type": "function_call", "call_id": "call_9", "name": "add", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_9", "output": "42", "id": "fco_given"}]
    second = client.post(R, json={"input": later, "previous_response_id": first["id"], "max_output_tokens": 2},
                         headers=auth()).json()
    asc = client.get(f"{R}/{second['id']}/input_items", params={"order": "asc", "limit": 100}, headers=auth()).json()
    assert [i["id"] for i in asc["data"][:2]] == [item["id"], said["id"]]  # the first turn, its answer
    assert asc["data"][1]["content"][0]["text"] == said["content"][0]["text"]
    assert asc["data"][3]["type"] == "function_call" and asc["data"][3]["id"].startswith("fc_")
    assert asc["data"][4] == {"type": "function_call_output", "id": "fco_given", "call_id": "call_9", "output": "42",
                              "status": "completed"}
    ids = [i["id"] for i in asc["data"]]
    page = client.get(f"{R}/{second['id']}/input_items", params={"limit": 2}, headers=auth()).json()
    assert [i["id"] for i in page["data"]] == ids[::-1][:2] and page["has_more"] is True
    rest = client.get(f"{R}/{second['id']}/input_items", params={"after": page["last_id"]}, headers=auth()).json()
    assert [i["id"] for i in rest["data"]] == ids[::-1][2:] and rest["has_more"] is False
    for query, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after")):
        r = client.get(f"{R}/{second['id']}/input_items", params=query, headers=auth())
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert client.get(f"{R}/{second['id']}/input_items", headers=auth(KEY_B)).status_code == 404


def test_an_item_reference_replays_a_stored_item(client: TestClient, engine: FakeEngine) -> None:
    """{"type": "item_reference", "id": ...} (as the Codex CLI replays a conversation) stands for that
    item of one of the key's stored responses: keyed as the same conversation sent in full."""
    first = client.post(R, json={"input": "hello", "max_output_tokens": 3}, headers=auth()).json()
    user_id = client.get(f"{R}/{first['id']}/input_items", headers=auth()).json()["first_id"]
    answer = first["output"][0]
    by_ref = [{"type": "item_reference", "id": user_id}, {"type": "item_reference", "id": answer["id"]},
              {"role": "user", "content": "more"}]
    assert client.post(R, json={"input": by_ref, "max_output_tokens": 2}, headers=auth()).status_code == 200
    in_full = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": answer["content"][0]["text"]},
               {"role": "user", "content": "more"}]
    client.post(CH, json={"messages": in_full, "max_tokens": 2}, headers=auth())
    assert engine.requests[-2].prompt_ids == engine.requests[-1].prompt_ids
    for key, ref in ((KEY_B, answer["id"]), (KEY_A, "msg_unknown")):  # another key's item is not found either
        r = client.post(R, json={"input": [{"type": "item_reference", "id": ref}]}, headers=auth(key))
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].id"


def test_the_store_forgets_least_recently_used_first_within_its_bounds() -> None:
    from prefixserve.server.openai.responses.store import ResponseStore

    store = ResponseStore(max_items=2, max_chars=10_000)
    for rid in ("a", "b"):
        store.put("t", rid, [{"role": "user", "content": rid}], (), {"id": rid})
    assert store.get("t", "a") is not None  # now the most recent
    store.put("t", "c", [], (), {"id": "c"})
    assert [store.get("t", r) is not None for r in "abc"] == [True, False, True]
    store.put("t", "big", [{"role": "user", "content": "x" * 9_950}], (), {"id": "big"})
    assert store.get("t", "big") is not None and len(store) == 1  # the rest made room
    store.put("t", "huge", [{"role": "user", "content": "x" * 20_000}], (), {"id": "huge"})
    assert store.get("t", "huge") is None and store.get("t", "big") is not None  # never kept, nothing evicted
    assert store.get("other", "big") is None


def test_a_tenant_storing_many_responses_evicts_its_own_first() -> None:
    """The server's bounds are shared fairly: past one, the tenant holding the most loses its oldest."""
    from prefixserve.server.openai.responses.store import ResponseStore

    store = ResponseStore(max_items=4, max_chars=10_000)
    store.put("carol", "c1", [], (), {"id": "c1"})
    for k in range(10):
        store.put("erin", f"e{k}", [], (), {"id": f"e{k}"})
    assert store.get("carol", "c1") is not None and len(store) == 4
    assert [store.get("erin", f"e{k}") is not None for k in range(10)] == [False] * 7 + [True] * 3
    by_chars = ResponseStore(max_items=100, max_chars=1_000)
    for rid in ("c1", "c2"):
        by_chars.put("carol", rid, [], (), {"id": rid})
    for rid in ("e1", "e2", "e3"):
        by_chars.put("erin", rid, [], (), {"id": rid})
    by_chars.put("carol", "big", [{"role": "user", "content": "x" * 900}], (), {"id": "big"})  # past the chars
    assert [by_chars.get("carol", r) is not None for r in ("c1", "c2", "big")] == [False, False, True]
    assert all(by_chars.get("erin", r) is not None for r in ("e1", "e2", "e3"))  # carol held the most characters


def test_a_server_that_keeps_no_responses_says_so(engine: FakeEngine) -> None:
    from prefixserve.config import ServerConfig
    from prefixserve.server.app import create_app

    with TestClient(create_app(engine, ServerConfig(max_stored_responses=0))) as open_client:
        made = open_client.post(R, json={"input": "x", "max_output_tokens": 1}).json()
        assert made["store"] is False
        assert open_client.get(f"{R}/{made['id']}").status_code == 404
        r = open_client.post(R, json={"input": "y", "previous_response_id": made["id"]})
        assert r.status_code == 400 and "keeps no responses" in r.json()["error"]["message"]


def test_logprobs_when_included_streamed_and_not(client: TestClient) -> None:
    body = {"input": "hello", "max_output_tokens": 4, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    part = client.post(R, json=body, headers=auth()).json()["output"][0]["content"][0]
    assert [e["token"] for e in part["logprobs"]] == list(part["text"]) and len(part["logprobs"]) == 4
    first = part["logprobs"][0]
    assert first["logprob"] == -0.5 and first["bytes"] == list(first["token"].encode())
    assert [t["logprob"] for t in first["top_logprobs"]] == [-0.5, -1.5]
    evs = events(client.post(R, json={**body, "stream": True}, headers=auth()).text)
    streamed = [e for ev in evs if ev["type"] == "response.output_text.delta" for e in ev["logprobs"]]
    done = next(ev for ev in evs if ev["type"] == "response.output_text.done")
    assert streamed == done["logprobs"] == evs[-1]["response"]["output"][0]["content"][0]["logprobs"] == part["logprobs"]
    plain = client.post(R, json={"input": "hello", "max_output_tokens": 4}, headers=auth()).json()
    assert plain["output"][0]["content"][0]["logprobs"] == []


def test_a_thinking_models_reasoning_is_a_reasoning_item(client: TestClient, engine: FakeEngine) -> None:
    """Output [reasoning, message], streamed as a reasoning item's events then the message's; chained or
    replayed, the reasoning goes back to the template with its assistant turn."""
    engine.tokenizer.thinks = engine.tokenizer.opens_think = True  # type: ignore[misc]
    body = {"input": "Let me add.</think>It is 4.", "max_output_tokens": 40}
    out = client.post(R, json=body, headers=auth()).json()["output"]
    assert [o["type"] for o in out] == ["reasoning", "message"]
    assert out[0]["content"][0]["text"] == "<user>Let me add." and out[0]["summary"] == []
    assert out[1]["content"][0]["text"].startswith("It is 4.")
    evs = events(client.post(R, json={**body, "stream": True}, headers=auth()).text)
    said = "".join(e["delta"] for e in evs if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    assert said == out[0]["content"][0]["text"] and text == out[1]["content"][0]["text"]
    kinds = [e["type"] for e in evs if e["type"].startswith("response.output_item")]
    assert kinds == ["response.output_item.added", "response.output_item.done"] * 2
    assert [e["output_index"] for e in evs if e["type"] == "response.output_item.added"] == [0, 1]
    final = evs[-1]["response"]["output"]
    assert [o["type"] for o in final] == ["reasoning", "message"] and final[0]["content"] == out[0]["content"]
    chained = client.post(R, json={"input": "next", "previous_response_id": evs[-1]["response"]["id"],
                                   "max_output_tokens": 1}, headers=auth())
    assert chained.status_code == 200, chained.text
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt_ids)
    assert f"<assistant><think>{said}</think>{text}" in prompt  # the turn's reasoning, given back
    replayed = [{"role": "user", "content": "Let me add.</think>It is 4."}, *final, {"role": "user", "content": "next"}]
    client.post(R, json={"input": replayed, "max_output_tokens": 1}, headers=auth())
    assert engine.requests[-1].prompt_ids == engine.requests[-2].prompt_ids  # replaying the items: the same prompt
