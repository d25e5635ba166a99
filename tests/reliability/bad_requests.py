"""The malformed requests of test_bad_input: each names what is wrong with it and the exact status
(and, when the mistake is one field, the `param`) its OpenAI-shaped error must carry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.reliability.conftest import tenant_keys

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
VOCAB = 49152  # SmolLM2
CONTEXT = 8192
ALICE, BOB = tenant_keys()["alice"], tenant_keys()["bob"]


@dataclass(frozen=True)
class Bad:
    """One malformed request. `body` is JSON-encoded unless it is bytes; headers are (name, value)
    pairs so a header can be doubled; `auth=False` sends no Authorization header of our own."""

    name: str
    path: str
    body: Any
    status: int = 400
    param: str | None = None  # the `param` the error must name, when the mistake is one field
    method: str = "POST"
    headers: tuple[tuple[str, str], ...] = ()
    auth: bool = True


def chat(name: str, status: int = 400, param: str | None = None, **fields: Any) -> Bad:
    return Bad(name, CHAT, {"messages": MSGS, "max_tokens": 1, **fields}, status, param)


def cmpl(name: str, status: int = 400, param: str | None = None, **fields: Any) -> Bad:
    return Bad(name, CMPL, {"prompt": "hi", "max_tokens": 1, **fields}, status, param)


def fn_tool(**function: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", **function}}]


CASES: list[Bad] = [
    # -- the body as a whole
    Bad("json-syntax", CHAT, b"{bad json"),
    Bad("json-truncated", CMPL, b'{"prompt": "hi", "max_tokens": 1'),
    Bad("json-trailing-garbage", CMPL, b'{"prompt": "hi"} trailing'),
    Bad("body-empty", CHAT, b""),
    Bad("body-whitespace", CHAT, b"  \n\t "),
    Bad("body-array", CHAT, b"[]"),
    Bad("body-string", CMPL, b'"just a string"'),
    Bad("body-null", CMPL, b"null"),
    Bad("body-number", CMPL, b"42"),
    Bad("body-invalid-utf8", CMPL, b'{"prompt": "\xff\xfe\xc3(", "max_tokens": 1}'),
    Bad("body-lone-surrogate", CMPL, b'{"prompt": "a\\ud800b", "max_tokens": 1}', param="prompt"),
    Bad("body-nested-too-deep", CHAT, b"[" * 100_000),
    Bad("body-nan-literal", CMPL, b'{"prompt": "hi", "temperature": NaN}', param="temperature"),
    Bad("body-over-16MiB", CMPL, b'{"prompt": "' + b"a" * (17 << 20) + b'"}', status=413),
    # -- prompt (completions)
    cmpl("prompt-missing", prompt=None),
    cmpl("prompt-int", prompt=42, param="prompt"),
    cmpl("prompt-object", prompt={"text": "hi"}, param="prompt"),
    cmpl("prompt-empty-string", prompt="", param="prompt"),
    cmpl("prompt-empty-list", prompt=[], param="prompt"),
    cmpl("prompt-empty-nested-list", prompt=[[]], param="prompt"),
    cmpl("prompt-too-many", prompt=["one"] * 17, param="prompt"),
    cmpl("prompt-mixed-ids", prompt=[1, "a"], param="prompt"),
    cmpl("prompt-float-ids", prompt=[1.5, 2.0], param="prompt"),
    cmpl("prompt-bool-ids", prompt=[True, False], param="prompt"),
    cmpl("prompt-id-negative", prompt=[5, -1], param="prompt"),
    cmpl("prompt-id-past-vocab", prompt=[5, VOCAB], param="prompt"),
    cmpl("prompt-id-huge", prompt=[10**30], param="prompt"),
    cmpl("prompt-ids-over-context", prompt=[100] * CONTEXT, param="prompt"),
    cmpl("prompt-text-over-context", prompt="lorem ipsum " * 6000, param="prompt"),
    # -- sampling fields, both endpoints
    cmpl("max_tokens-string", max_tokens="5", param="max_tokens"),
    cmpl("max_tokens-negative", max_tokens=-1, param="max_tokens"),
    cmpl("max_tokens-zero", max_tokens=0, param="max_tokens"),
    cmpl("max_tokens-float", max_tokens=2.5, param="max_tokens"),
    cmpl("max_tokens-bool", max_tokens=True, param="max_tokens"),
    cmpl("max_tokens-huge", max_tokens=10**30, param="max_tokens"),
    chat("max_completion_tokens-negative", max_completion_tokens=-3, param="max_completion_tokens"),
    chat("temperature-negative", temperature=-1, param="temperature"),
    chat("temperature-string", temperature="hot", param="temperature"),
    chat("temperature-too-high", temperature=7.5, param="temperature"),
    Bad("temperature-infinite", CMPL, b'{"prompt": "hi", "temperature": 1e400}', param="temperature"),
    cmpl("top_p-zero", top_p=0, param="top_p"),
    cmpl("top_p-over-one", top_p=1.5, param="top_p"),
    cmpl("top_k-negative", top_k=-5, param="top_k"),
    cmpl("seed-over-64-bits", seed=2**70, param="seed"),
    cmpl("seed-string", seed="42", param="seed"),
    cmpl("stop-int", stop=5, param="stop"),
    cmpl("stop-empty-string", stop=[""], param="stop"),
    cmpl("stop-too-many", stop=[f"s{i}" for i in range(17)], param="stop"),
    cmpl("stop_token_ids-negative", stop_token_ids=[-1], param="stop_token_ids"),
    cmpl("n-zero", n=0, param="n"),
    cmpl("n-too-many", n=100, param="n"),
    cmpl("logit_bias-out-of-range", logit_bias={"1": 500}, param="logit_bias"),
    cmpl("logit_bias-not-an-id", logit_bias={"one": 5}, param="logit_bias"),
    cmpl("logit_bias-outside-vocab", logit_bias={"4000000": 5}, param="logit_bias"),
    cmpl("presence_penalty-too-high", presence_penalty=5, param="presence_penalty"),
    cmpl("frequency_penalty-too-low", frequency_penalty=-2.5, param="frequency_penalty"),
    cmpl("stream-string", stream="yes", param="stream"),
    cmpl("stream_options-without-stream", stream_options={"include_usage": True}, param="stream_options"),
    cmpl("max_tokens-0-without-echo", max_tokens=0, param="max_tokens"),
    cmpl("max_tokens-0-with-n", echo=True, max_tokens=0, n=2, param="n"),
    cmpl("best_of-below-n", n=3, best_of=2, param="best_of"),
    cmpl("logprobs-too-many", logprobs=9, param="logprobs"),
    cmpl("suffix-without-infill", suffix="x", param="suffix"),
    cmpl("model-unknown", status=404, model="gpt-4o", param="model"),
    cmpl("model-int", model=123, param="model"),
    # -- cache_salt
    cmpl("salt-int", cache_salt=123, param="cache_salt"),
    cmpl("salt-empty", cache_salt="", param="cache_salt"),
    chat("salt-list", cache_salt=["a"], param="cache_salt"),
    chat("salt-object", cache_salt={"a": 1}, param="cache_salt"),
    chat("salt-bool", cache_salt=True, param="cache_salt"),
    chat("salt-too-long", cache_salt="s" * 300, param="cache_salt"),
    # -- messages (chat)
    Bad("messages-missing", CHAT, {"max_tokens": 1}, param="messages"),
    chat("messages-empty", messages=[], param="messages"),
    chat("messages-string", messages="hi", param="messages"),
    chat("role-unknown", messages=[{"role": "wizard", "content": "hi"}], param="messages[0].role"),
    chat("role-missing", messages=[{"content": "hi"}], param="messages[0].role"),
    chat("content-int", messages=[{"role": "user", "content": 5}], param="messages[0].content"),
    chat("content-null-user", messages=[{"role": "user", "content": None}], param="messages[0].content"),
    chat(
        "content-part-image",
        param="messages[0].content[0].type",
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
    ),
    chat(
        "content-part-not-object",
        messages=[{"role": "user", "content": ["hi"]}],
        param="messages[0].content[0]",
    ),
    chat(
        "tool-message-without-id",
        messages=[{"role": "tool", "content": "42"}],
        param="messages[0].tool_call_id",
    ),
    chat(
        "tool_calls-on-user",
        param="messages[0].tool_calls",
        messages=[{"role": "user", "content": "x", "tool_calls": [{"id": "1", "function": {"name": "f"}}]}],
    ),
    chat(
        "message-content-over-context",
        messages=[{"role": "user", "content": "lorem ipsum " * 6000}],
        param="messages",
    ),
    # -- tools
    chat("tools-not-a-list", tools="f", param="tools"),
    chat("tools-item-not-object", tools=[5], param="tools[0]"),
    chat(
        "tools-function-not-object", tools=[{"type": "function", "function": "f"}], param="tools[0].function"
    ),
    chat(
        "tools-parameters-not-object",
        tools=fn_tool(parameters="not an object"),
        param="tools[0].function.parameters",
    ),
    chat("tools-parameters-list", tools=fn_tool(parameters=[1, 2]), param="tools[0].function.parameters"),
    chat(
        "tools-name-missing",
        tools=[{"type": "function", "function": {"description": "d"}}],
        param="tools[0].function.name",
    ),
    chat("tools-type-unknown", tools=[{"type": "retrieval"}], param="tools[0].type"),
    chat("tool_choice-required-without-tools", tool_choice="required", param="tool_choice"),
    chat("tool_choice-unknown-function", tools=fn_tool(), tool_choice={"type": "function", "function": {"name": "g"}},
         param="tool_choice"),
    chat("tools-parameters-a-string-schema", tools=fn_tool(parameters={"type": "string"}),
         param="tools[0].function.parameters"),
    chat("functions-legacy", functions=[{"name": "f"}], param="functions"),
    chat("response_format-unknown", response_format={"type": "xml"}, param="response_format"),
    chat("response_format-schema-not-object", response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": "a string"}}, param="response_format.json_schema.schema"),
    chat("logprobs-string", logprobs="yes", param="logprobs"),
    chat("top_logprobs-over-20", logprobs=True, top_logprobs=21, param="top_logprobs"),
    chat("top_logprobs-without-logprobs", top_logprobs=2, param="top_logprobs"),
    # -- credentials
    Bad("auth-missing", CHAT, {"messages": MSGS, "max_tokens": 1}, status=401, auth=False),
    Bad(
        "auth-wrong-key",
        CHAT,
        {"messages": MSGS, "max_tokens": 1},
        status=401,
        auth=False,
        headers=(("Authorization", "Bearer sk-nobody"),),
    ),
    Bad(
        "auth-basic-scheme",
        CMPL,
        {"prompt": "hi"},
        status=401,
        auth=False,
        headers=(("Authorization", f"Basic {ALICE}"),),
    ),
    Bad(
        "auth-bearer-no-token",
        CMPL,
        {"prompt": "hi"},
        status=401,
        auth=False,
        headers=(("Authorization", "Bearer"),),
    ),
    Bad(
        "auth-key-not-ascii",
        CMPL,
        {"prompt": "hi"},
        status=401,
        auth=False,
        headers=(("Authorization", "Bearer sk-\xe9\xe8"),),
    ),
    Bad("auth-on-models", "/v1/models", None, status=401, method="GET", auth=False),
    # -- routes and methods
    Bad("method-get-on-chat", CHAT, None, status=405, method="GET"),
    Bad("method-put-on-completions", CMPL, {"prompt": "hi"}, status=405, method="PUT"),
    Bad("path-unknown", "/v1/engines/davinci/completions", {"prompt": "hi"}, status=404),
    Bad("model-card-unknown", "/v1/models/gpt-4o", None, status=404, method="GET"),
    Bad("usage-without-start", "/v1/usage", None, method="GET", param="start_time"),
    Bad("usage-start-not-int", "/v1/usage?start_time=yesterday", None, method="GET", param="start_time"),
    Bad(
        "usage-bucket-unknown",
        "/v1/usage?start_time=0&bucket_width=1y",
        None,
        method="GET",
        param="bucket_width",
    ),
    Bad("usage-other-tenant", "/v1/usage?start_time=0&tenant_id=bob", None, method="GET", param="tenant_id"),
    # -- the Responses API and tokenization
    Bad("responses-no-input", "/v1/responses", {"max_output_tokens": 1}, param="input"),
    Bad("responses-previous-id-unknown", "/v1/responses", {"input": "hi", "previous_response_id": "resp_1"},
        status=404, param="previous_response_id"),
    Bad("responses-image-part", "/v1/responses",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
        param="input[0].content[0].type"),
    Bad("responses-max-output-too-big", "/v1/responses", {"input": "hi", "max_output_tokens": CONTEXT},
        param="max_output_tokens"),
    Bad("responses-hosted-tool", "/v1/responses", {"input": "hi", "tools": [{"type": "file_search"}]},
        param="tools[0].type"),
    Bad("tokenize-both", "/tokenize", {"prompt": "hi", "messages": MSGS}, param="prompt"),
    Bad("tokenize-unauthenticated", "/tokenize", {"prompt": "hi"}, status=401, auth=False),
    Bad("detokenize-outside-vocab", "/detokenize", {"tokens": [VOCAB]}, param="tokens"),
]

# Two Authorization headers are an ambiguous credential (RFC 9110 5.3: a field that is not a list
# must not be repeated): which tenant runs the request must not depend on header order.
DOUBLED_AUTH = [
    Bad(
        "auth-doubled-two-tenants",
        CMPL,
        {"prompt": "hi", "max_tokens": 1},
        status=400,
        auth=False,
        headers=(("Authorization", f"Bearer {ALICE}"), ("Authorization", f"Bearer {BOB}")),
    ),
    Bad(
        "auth-doubled-valid-then-wrong",
        CMPL,
        {"prompt": "hi", "max_tokens": 1},
        status=400,
        auth=False,
        headers=(("Authorization", f"Bearer {ALICE}"), ("Authorization", "Bearer sk-nobody")),
    ),
    Bad(
        "auth-doubled-same-key",
        CMPL,
        {"prompt": "hi", "max_tokens": 1},
        status=400,
        auth=False,
        headers=(("Authorization", f"Bearer {ALICE}"), ("Authorization", f"Bearer {ALICE}")),
    ),
]
