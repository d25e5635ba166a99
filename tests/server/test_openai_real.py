"""End to end: a real `prefixserve serve` process, the embedded model, the official `openai` client.

Two module-scoped servers: `server` (two tenant keys + an admin key, default cache) and `nocache`
(`--cache-max-bytes 0`, the reference for bit-exactness, and the SIGTERM drain test at the end).
Outputs are greedy and short (the model runs on the CPU).
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.helpers.server_proc import ServerProcess, server_fixture

pytestmark = pytest.mark.slow

KEY_A, KEY_B, ADMIN = "sk-real-a-111", "sk-real-b-222", "sk-real-admin"
server = server_fixture(
    ["--api-key", KEY_A, "--api-key", f"bob {KEY_B}", "--admin-key", ADMIN], scope="module"
)
nocache = server_fixture(["--api-key", KEY_A, "--cache-max-bytes", "0", "--no-ledger"], scope="module")

RULES = [
    "answer politely",
    "keep answers short",
    "never invent facts",
    "cite the manual",
    "prefer metric units",
    "explain acronyms",
    "avoid jargon",
    "ask before assuming",
    "use plain English",
    "respect privacy",
]
SYSTEM = "You are the support assistant of the Prefix Harbour ferry company.\n" + "\n".join(
    f"Rule {i + 1}: {RULES[i % len(RULES)]} when a passenger asks about route {i + 1} or cabin {100 + i}."
    for i in range(24)
)
QUESTIONS = [
    "When does the first ferry leave?",
    "Can I bring my bicycle?",
    "Is there a cafe on board?",
    "How much is a cabin?",
    "Are pets allowed?",
    "What if I miss the ferry?",
    "Is there wifi?",
    "Can I change my ticket?",
    "Where do I park?",
    "How long is the crossing?",
    "Do you sell snacks?",
    "Is the deck open at night?",
    "Can children travel alone?",
    "What should I pack?",
    "Is the ferry wheelchair accessible?",
    "Do you have lockers?",
]


def client(srv: ServerProcess, key: str = KEY_A) -> OpenAI:
    return OpenAI(base_url=srv.openai_url, api_key=key, max_retries=0, timeout=300)


def chat(
    srv: ServerProcess,
    question: str,
    *,
    key: str = KEY_A,
    salt: str | None = None,
    system: str = SYSTEM,
    max_tokens: int = 8,
    **kw: Any,
) -> Any:
    extra = {"cache_salt": salt} if salt is not None else None
    return client(srv, key).chat.completions.create(
        model=model_id(srv),
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body=extra,
        **kw,
    )


_MODEL_IDS: dict[str, str] = {}


def model_id(srv: ServerProcess) -> str:
    if srv.base_url not in _MODEL_IDS:
        _MODEL_IDS[srv.base_url] = client(srv).models.list().data[0].id
    return _MODEL_IDS[srv.base_url]


def cached(resp: Any) -> int:
    assert resp.usage.prompt_tokens_details is not None
    return int(resp.usage.prompt_tokens_details.cached_tokens)


def test_learning_sequence(server: ServerProcess) -> None:
    r1 = chat(server, QUESTIONS[0])
    r2 = chat(server, QUESTIONS[1])
    r3 = chat(server, QUESTIONS[2])
    assert r1.usage.prompt_tokens > 500
    assert cached(r1) == 0
    assert 0 < cached(r2) < r2.usage.prompt_tokens
    # the boundary entry at the longest common prefix (all but the user turn) serves the third
    assert cached(r3) >= cached(r2) and cached(r3) >= r3.usage.prompt_tokens - 20
    assert r3.usage.total_tokens == r3.usage.prompt_tokens + r3.usage.completion_tokens
    r4 = chat(server, QUESTIONS[2])  # the identical prompt: a full hit
    assert cached(r4) >= r4.usage.prompt_tokens - 1
    assert r4.choices[0].message.content == r3.choices[0].message.content


ISOLATION_CASES = [
    ((KEY_A, None), (KEY_B, None)),
    ((KEY_B, None), (KEY_A, None)),  # another key, both directions
    ((KEY_A, "salt-1"), (KEY_A, "salt-2")),
    ((KEY_A, "salt-2"), (KEY_A, "salt-1")),  # another salt
    ((KEY_A, "salt-3"), (KEY_A, None)),
    ((KEY_A, None), (KEY_A, "salt-3")),  # salted vs unsalted
    ((KEY_A, "shared"), (KEY_B, "shared")),  # the same salt under another key
]


@pytest.mark.parametrize(("case", "first", "second"), [(i, *c) for i, c in enumerate(ISOLATION_CASES)])
def test_isolation_between_keys_and_salts(
    server: ServerProcess, case: int, first: tuple[str, str | None], second: tuple[str, str | None]
) -> None:
    # Token-id prompts with a first token no other request uses, so the only possible hit is this
    # probe's own earlier request: the expected counts are exact.
    prompt = [40000 + case] + list(range(3000, 3300))

    def complete(who: tuple[str, str | None]) -> int:
        extra = {"cache_salt": who[1]} if who[1] is not None else None
        r = client(server, who[0]).completions.create(
            model=model_id(server), prompt=prompt, max_tokens=1, temperature=0, extra_body=extra
        )
        assert r.usage is not None and r.usage.prompt_tokens == len(prompt)
        return int(r.usage.prompt_tokens_details.cached_tokens)

    assert complete(first) == 0
    assert complete(first) >= len(prompt) - 1  # the first namespace learned it
    assert complete(second) == 0  # ... and the second sees none of it
    assert complete(second) >= len(prompt) - 1  # (it learns on its own)


def test_tools_request_caches_on_repeat(server: ServerProcess) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "ferry_times",
                "description": "Departure times of a route",
                "parameters": {
                    "type": "object",
                    "properties": {"route": {"type": "integer"}},
                    "required": ["route"],
                },
            },
        }
    ]
    r1 = chat(server, "When does route 3 leave?", tools=tools, max_tokens=4)
    r2 = chat(server, "When does route 3 leave?", tools=tools, max_tokens=4)
    # (SmolLM2-135M's chat template ignores `tools`; the fake-engine tests check that they are passed.)
    assert cached(r2) >= r2.usage.prompt_tokens - 1
    assert r2.choices[0].message.content == r1.choices[0].message.content


def test_streaming_and_non_streaming_agree_and_carry_usage(server: ServerProcess) -> None:
    c = client(server)
    full = chat(server, QUESTIONS[3], max_tokens=12)
    stream = c.chat.completions.create(
        model=model_id(server),
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[3]}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= full.usage.prompt_tokens - 1
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    prompt = SYSTEM[:600] + "\nQuestion: how long is the crossing?\nAnswer:"
    done = c.completions.create(model=model_id(server), prompt=prompt, max_tokens=10, temperature=0)
    assert done.usage is not None and done.usage.prompt_tokens_details.cached_tokens == 0
    streamed = list(
        c.completions.create(
            model=model_id(server),
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == done.choices[0].text
    last = streamed[-1]
    assert last.choices == [] and last.usage.completion_tokens == done.usage.completion_tokens
    assert last.usage.prompt_tokens_details.cached_tokens >= done.usage.prompt_tokens - 1

    # emoji replies: tokens that are parts of a character, their logprobs the same streamed and not
    ask = {"model": model_id(server), "prompt": "Emoji: 🐱", "max_tokens": 8, "temperature": 0, "logprobs": 2}
    whole = c.completions.create(**ask).choices[0]
    parts = [ch.choices[0] for ch in c.completions.create(**ask, stream=True) if ch.choices]
    assert "".join(p.text for p in parts) == whole.text
    assert whole.logprobs is not None and all(p.logprobs is not None for p in parts)
    for name in ("tokens", "text_offset", "token_logprobs"):
        assert [v for p in parts for v in getattr(p.logprobs, name)] == getattr(whole.logprobs, name), name
    offsets = whole.logprobs.text_offset
    assert offsets == sorted(offsets) and offsets[-1] <= len(whole.text)


def test_sixteen_concurrent_streams_share_the_system_prompt(server: ServerProcess) -> None:
    chat(server, "Warm-up question.", max_tokens=1)

    def one(q: str) -> tuple[str, Any]:
        stream = client(server).chat.completions.create(
            model=model_id(server),
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), chunks[-1].usage

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, [f"Concurrent question {i}: {q}" for i, q in enumerate(QUESTIONS)]))
    assert len(results) == 16
    for text, usage in results:
        assert usage is not None and usage.completion_tokens > 0 and text
        assert usage.prompt_tokens_details.cached_tokens > 500


def _abort_count(srv: ServerProcess) -> float:
    for line in srv.metrics().splitlines():
        if line.startswith('prefixserve_requests_finished_total{finish_reason="abort"}'):
            return float(line.split()[-1])
    return 0.0


def _wait_idle(srv: ServerProcess, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(srv.base_url + "/health", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        if health["running"] == 0 and health["waiting"] == 0 or time.monotonic() > deadline:
            return health
        time.sleep(0.1)


def test_client_disconnect_aborts_the_request(server: ServerProcess) -> None:
    body = {
        "model": model_id(server),
        "prompt": "Tell me a long story.",
        "max_tokens": 2000,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {KEY_A}"}
    before = _abort_count(server)
    with httpx.stream("POST", server.openai_url + "/completions", json={**body, "stream": True}, headers=headers,
                      timeout=120) as r:  # fmt: skip
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # the connection is closed after one chunk; the engine must stop long before 2000 tokens
    health = _wait_idle(server)
    assert health["running"] == 0, health
    assert _abort_count(server) == before + 1
    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up while it is generating
        httpx.post(server.openai_url + "/completions", json=body, headers=headers, timeout=3)
    health = _wait_idle(server)
    assert health["running"] == 0, health
    assert _abort_count(server) == before + 2


def test_cache_hits_are_bit_exact_against_a_server_without_cache(
    server: ServerProcess, nocache: ServerProcess
) -> None:
    chat(server, "Warm-up question.", max_tokens=1)  # the system prompt is cached before the 16
    hits = [chat(server, q, max_tokens=12) for q in QUESTIONS]
    ref = [chat(nocache, q, max_tokens=12) for q in QUESTIONS]
    assert all(cached(r) > 0 for r in hits)
    assert all(cached(r) == 0 for r in ref)
    assert [r.choices[0].message.content for r in hits] == [r.choices[0].message.content for r in ref]
    assert [r.usage.completion_tokens for r in hits] == [r.usage.completion_tokens for r in ref]


def test_exact_under_concurrent_load_with_nested_system_prompts(
    server: ServerProcess, nocache: ServerProcess
) -> None:
    """16 prompts whose system prompts extend one another (partial hits at many depths), sent 8 at a
    time beside two other streaming clients, twice: every answer equals a cache-less server's
    answering them one by one (docs/exactness.md)."""
    systems = [SYSTEM + "".join(f"\nExtra rule {k}: {RULES[k % len(RULES)]} on deck {k}." for k in range(i))
               for i in range(16)]
    prompts = [(systems[i], QUESTIONS[i]) for i in range(16)]
    ref = [chat(nocache, q, system=sy, max_tokens=24).choices[0].message.content for sy, q in prompts]
    stop = threading.Event()

    def background(k: int) -> None:  # other traffic: another tenant, streaming, other prompts
        while not stop.is_set():
            s = client(server, KEY_B).chat.completions.create(
                model=model_id(server), messages=[{"role": "user", "content": f"Tell me a story about ship {k}."}],
                max_tokens=16, temperature=0, stream=True)
            for _ in s:
                pass

    threads = [threading.Thread(target=background, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            for _ in range(2):
                got = list(pool.map(lambda p: chat(server, p[1], system=p[0], max_tokens=24), prompts))
                assert [r.choices[0].message.content for r in got] == ref
                assert all(0 <= cached(r) <= r.usage.prompt_tokens for r in got)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert sum(cached(r) for r in got) > 16 * 500  # the second pass hits


BAD_CALLS: list[tuple[str, dict[str, Any], str | None]] = [
    ("chat", {"n": 17}, "n"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"extra_body": {"cache_salt": ""}}, "cache_salt"),
    ("chat", {"extra_body": {"cache_salt": "x" * 300}}, "cache_salt"),
    ("chat", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_tokens": 10**9}, "max_tokens"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "narrator", "content": "hi"}]}, "messages[0].role"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0].type",
    ),
    ("chat", {"messages": [{"role": "user", "content": "word " * 9000}]}, "messages"),
    ("chat", {"temperature": 3}, "temperature"),
    ("chat", {"presence_penalty": 3}, "presence_penalty"),
    (
        "chat",
        {"tool_choice": {"type": "function", "function": {"name": "g"}},
         "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tool_choice",
    ),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"suffix": "end"}, "suffix"),
    ("completions", {"prompt": ["one", "two", ""]}, "prompt"),
    ("completions", {"prompt": [49152 + 10]}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"stop": [""]}, "stop"),
]


def test_scoring_a_prompt_as_evaluation_harnesses_do(server: ServerProcess, nocache: ServerProcess) -> None:
    """`echo` + `logprobs` + `max_tokens` 0 on token-id prompts (lm-evaluation-harness's loglikelihood
    request): the prompt alone, each token after the first scored. The distribution scored at the
    last context position is, bit for bit, the one that samples the context's first token: served
    from the cache or not, on a server with a cache or without."""
    ctx = [(97 * i + 1000) % 40000 + 100 for i in range(180)]
    cont = [ctx[5], ctx[9]]
    c = client(server)
    first = c.completions.create(model=model_id(server), prompt=ctx, max_tokens=1, temperature=0, logprobs=5)
    again = c.completions.create(model=model_id(server), prompt=ctx, max_tokens=1, temperature=0, logprobs=5)
    assert cached(again) == len(ctx)
    scores = {}
    for name, srv in (("cache", server), ("nocache", nocache)):
        r = client(srv).completions.create(model=model_id(srv), prompt=[ctx + cont, ctx], echo=True, max_tokens=0,
                                           logprobs=5, temperature=0)
        assert [ch.finish_reason for ch in r.choices] == ["length", "length"]
        assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == 2 * len(ctx) + 2 and cached(r) == 0
        lp = r.choices[0].logprobs
        assert lp is not None and len(lp.tokens) == len(ctx) + 2 and r.choices[0].text == "".join(lp.tokens)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert r.choices[1].logprobs is not None and r.choices[1].logprobs.tokens == lp.tokens[: len(ctx)]
        assert r.choices[1].logprobs.token_logprobs == lp.token_logprobs[: len(ctx)]
        scores[name] = lp
    assert scores["cache"] == scores["nocache"]
    at_end = scores["cache"].top_logprobs[len(ctx)]  # the 5 most likely after ctx, and cont[0]'s own entry
    for sampled in (first, again):
        s_lp = sampled.choices[0].logprobs
        assert s_lp is not None and {k: at_end[k] for k in s_lp.top_logprobs[0]} == s_lp.top_logprobs[0]


def test_an_echoed_prompt_keeps_its_control_tokens(server: ServerProcess) -> None:
    """QA: echo gave "HiBye" for "Hi<|endoftext|>Bye" (tokens "Hi", "", "By", "e") and every control
    token in a top_logprobs dict was the one key "" (tests/server/test_logprobs_bytes.py)."""
    r = client(server).completions.create(model=model_id(server), prompt="Hi<|endoftext|>Bye", echo=True,
                                          max_tokens=0, logprobs=5)
    lp = r.choices[0].logprobs
    assert lp is not None and r.choices[0].text == "Hi<|endoftext|>Bye" == "".join(lp.tokens)
    assert lp.tokens == ["Hi", "<|endoftext|>", "By", "e"] and lp.text_offset == [0, 2, 15, 17]
    assert all(len(top) >= 5 for top in lp.top_logprobs[1:])  # five distinct alternatives, and the token's own


@pytest.mark.parametrize(
    ("endpoint", "override", "param"), BAD_CALLS, ids=[p or "none" for _, _, p in BAD_CALLS]
)
def test_bad_input_is_a_400_and_the_next_request_works(
    server: ServerProcess, endpoint: str, override: dict[str, Any], param: str | None
) -> None:
    c = client(server)
    if endpoint == "chat":
        kwargs: dict[str, Any] = {
            "model": model_id(server),
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            **override,
        }
        call = c.chat.completions.create
    else:
        kwargs = {"model": model_id(server), "prompt": "hi", "max_tokens": 2, **override}
        call = c.completions.create
    with pytest.raises(openai.BadRequestError) as e:
        call(**kwargs)
    err = e.value.body
    assert (
        isinstance(err, dict) and err.get("param") == param and err.get("type") == "invalid_request_error"
    ), err
    good = c.chat.completions.create(
        model=model_id(server), messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert good.choices[0].message.content is not None


def test_raw_http_errors(server: ServerProcess) -> None:
    url = server.openai_url + "/chat/completions"
    for content, headers in ((b"{bad json", {}), (b'{"messages": "\xff"}', {}), (b"[]", {})):
        r = httpx.post(url, content=content, headers={"Authorization": f"Bearer {KEY_A}", **headers})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError):
        client(server, "sk-wrong").models.list()
    with pytest.raises(openai.PermissionDeniedError):
        chat(client_srv := server, "hi", key=ADMIN)  # the admin key is not a tenant
    assert httpx.get(client_srv.base_url + "/nowhere").json()["error"]["type"] == "invalid_request_error"
    health = httpx.get(server.base_url + "/health").json()  # a probe: no other tenant's load without the admin key
    assert health["ok"] is True and "exact_reuse" in health and "running" not in health
    health = httpx.get(server.base_url + "/health", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert {"exact_reuse", "detail", "running", "waiting"} <= set(health)
    # /metrics is every tenant's traffic together: with API keys, only the admin key reads it
    assert httpx.get(server.base_url + "/metrics").status_code == 401
    denied = httpx.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {KEY_A}"})
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "admin_key_required"
    metrics = server.metrics()
    for name in (
        "prefixserve_cache_bytes",
        "prefixserve_cache_entries",
        "prefixserve_cache_evictions",
        "prefixserve_cache_hit_ratio",
        "prefixserve_time_to_first_token_seconds_bucket",
        "prefixserve_inter_token_latency_seconds_bucket",
        "prefixserve_cached_prompt_tokens_total",
    ):
        assert name in metrics
    assert KEY_A not in metrics and "bob" not in metrics


def test_usage_api_sees_own_tenant_and_admin_sees_all(server: ServerProcess) -> None:
    chat(server, "Hello from bob", key=KEY_B, max_tokens=1)
    chat(server, "Hello from alice", key=KEY_A, max_tokens=1)
    start = int(time.time()) - 3600
    mine = httpx.get(
        server.openai_url + "/usage",
        params={"start_time": start, "group_by": "tenant_id"},
        headers={"Authorization": f"Bearer {KEY_B}"},
    ).json()
    assert {r["tenant_id"] for b in mine["data"] for r in b["results"]} == {"bob"}
    everyone = httpx.get(
        server.openai_url + "/usage",
        params={"start_time": start, "group_by": "tenant_id"},
        headers={"Authorization": f"Bearer {ADMIN}"},
    ).json()
    results = [r for b in everyone["data"] for r in b["results"]]
    assert len({r["tenant_id"] for r in results}) == 2
    assert sum(r["input_cached_tokens"] for r in results) > 0


def test_sigterm_drains_in_flight_streams_and_exits_0(nocache: ServerProcess) -> None:
    first_chunk = threading.Event()
    out: dict[str, Any] = {}

    def stream() -> None:
        s = client(nocache).completions.create(
            model=model_id(nocache),
            prompt="Count slowly: one, two,",
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = []
        for ch in s:
            chunks.append(ch)
            first_chunk.set()
        out["chunks"] = chunks

    t = threading.Thread(target=stream)
    t.start()
    assert first_chunk.wait(120)
    assert nocache.proc is not None
    nocache.proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    with pytest.raises(httpx.ConnectError):  # no longer accepting ...
        httpx.get(nocache.base_url + "/health", timeout=5)
    t.join(180)  # ... but the stream in flight runs to its end
    chunks = out["chunks"]
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == ["length"] and chunks[-1].usage.completion_tokens == 40
    assert nocache.terminate() == 0, nocache.log_tail()


def test_a_completion_that_samples_endoftext_has_ended(server: ServerProcess) -> None:
    """QA: the embedded model's file names <|im_end|> its eos, so a raw completion that sampled
    <|endoftext|> (id 0) went on past its document's end. The tokens that only ever end a text or a
    turn stop generation, as in llama.cpp's server."""
    r = client(server).completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=5,
                                          temperature=0, logit_bias={"0": 100})
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("", "stop")
    assert r.usage is not None and r.usage.completion_tokens == 1
