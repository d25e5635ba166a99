"""Recently encoded prompts (server/openai/prompt_memo.py): the same ids as encoding, kept per namespace, so
another tenant or salt encodes its own; bounded; forgotten by a cache flush; errors never kept."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from prefixserve.server.openai.prompt_memo import MIN_TOKENS, NotRemembered, PromptMemo, input_digest
from prefixserve.types import FlushScope, Namespace
from tests.helpers.fake_engine import FakeEngine
from tests.server.conftest import KEY_A, KEY_B

A = Namespace("m", "a")
B = Namespace("m", "b")
A_SALT = Namespace("m", "a", "s")


class Counting:
    def __init__(self, n: int = MIN_TOKENS) -> None:
        self.calls = 0
        self.n = n

    def __call__(self) -> list[int]:
        self.calls += 1
        return list(range(self.n))


def test_a_repeat_in_the_same_namespace_is_remembered_and_no_other() -> None:
    memo, enc = PromptMemo(), Counting()
    d = input_digest("chat", [{"role": "user", "content": "x"}], None)
    assert memo.ids(A, d, enc) == list(range(MIN_TOKENS))
    assert memo.ids(A, d, enc) == list(range(MIN_TOKENS)) and enc.calls == 1
    memo.ids(B, d, enc)  # another tenant
    memo.ids(A_SALT, d, enc)  # another salt of the same tenant
    assert enc.calls == 3
    memo.ids(A, input_digest("chat", [{"role": "user", "content": "y"}], None), enc)
    assert enc.calls == 4


def test_inputs_differing_in_key_order_kind_or_tools_are_different() -> None:
    m1 = [{"role": "user", "content": "x"}]
    m2 = [{"content": "x", "role": "user"}]  # a template may iterate a dict in order
    digests = {input_digest("chat", m1, None), input_digest("chat", m2, None),
               input_digest("chat", m1, [{"type": "function"}]), input_digest("text", "x")}
    assert len(digests) == 4
    assert input_digest("chat", [{"content": float("nan")}], None) is None  # not plain JSON: never kept
    assert input_digest("chat", [{"content": object()}], None) is None
    assert input_digest("text", "a \ud800 lone surrogate") is None


def test_a_recall_only_view_answers_what_is_held_and_never_encodes_or_adds() -> None:
    memo, enc = PromptMemo(), Counting()
    memo.ids(A, b"d1", enc)
    view = memo.recall_only()
    assert view.ids(A, b"d1", enc) == list(range(MIN_TOKENS)) and enc.calls == 1
    for ns, digest in ((A, b"d2"), (B, b"d1"), (A, None)):  # not held, another namespace, not digestible
        with pytest.raises(NotRemembered):
            view.ids(ns, digest, enc)
    assert enc.calls == 1 and len(memo) == 1
    memo.ids(A, b"d2", enc)  # what the memo learns later, the view sees (one store)
    assert view.ids(A, b"d2", enc) == list(range(MIN_TOKENS)) and enc.calls == 2


def test_short_prompts_and_failures_are_not_kept() -> None:
    memo = PromptMemo()
    short = Counting(MIN_TOKENS - 1)
    memo.ids(A, b"d1", short)
    memo.ids(A, b"d1", short)
    assert short.calls == 2 and len(memo) == 0

    def boom() -> list[int]:
        raise ValueError("template error")

    with pytest.raises(ValueError):
        memo.ids(A, b"d2", boom)
    assert len(memo) == 0
    enc = Counting()
    memo.ids(A, None, enc)
    memo.ids(A, None, enc)
    assert enc.calls == 2 and len(memo) == 0


def test_bounded_by_tokens_least_recently_used_out() -> None:
    memo = PromptMemo(max_tokens=3 * MIN_TOKENS)
    enc = Counting()
    for d in (b"1", b"2", b"3"):
        memo.ids(A, d, enc)
    memo.ids(A, b"1", enc)  # 1 is now the most recent
    memo.ids(A, b"4", enc)  # evicts 2
    assert len(memo) == 3 and enc.calls == 4
    memo.ids(A, b"1", enc)
    assert enc.calls == 4
    memo.ids(A, b"2", enc)
    assert enc.calls == 5


def test_forget_drops_the_flushed_namespaces_only() -> None:
    memo, enc = PromptMemo(), Counting()
    for ns in (A, A_SALT, B):
        memo.ids(ns, b"d", enc)
    assert memo.forget(FlushScope(tenant_id="a", cache_salt="s")) == 1
    assert memo.forget(FlushScope(tenant_id="a")) == 1
    assert len(memo) == 1
    memo.ids(B, b"d", enc)
    assert enc.calls == 3


class CountingTokenizerEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__(max_model_len=4096)
        self.renders = 0
        inner = self.tokenizer.render_chat

        def render(*a: Any, **k: Any) -> list[int]:
            self.renders += 1
            return inner(*a, **k)

        self.tokenizer.render_chat = render  # type: ignore[method-assign]


def test_http_a_repeated_chat_is_rendered_once_per_tenant_and_salt_and_again_after_a_flush(make_client) -> None:
    eng = CountingTokenizerEngine()
    client: TestClient = make_client(eng=eng)
    body: dict[str, Any] = {"model": "fake-model", "max_tokens": 2,
                            "messages": [{"role": "system", "content": "s" * 400}, {"role": "user", "content": "hi"}]}

    def post(key: str, **extra: Any) -> list[int]:
        r = client.post("/v1/chat/completions", json={**body, **extra}, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return list(eng.requests[-1].prompt_ids)

    first = post(KEY_A)
    assert post(KEY_A) == first and eng.renders == 1
    assert post(KEY_B) == first and eng.renders == 2  # another tenant renders its own
    post(KEY_A, cache_salt="s1")
    assert eng.renders == 3
    r = client.request("DELETE", "/v1/cache", headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 200
    assert post(KEY_A) == first and eng.renders == 4
    assert post(KEY_B) == first and eng.renders == 4  # B's was not flushed


def test_http_a_remembered_prompt_is_prepared_without_the_thread_pool(make_client, monkeypatch) -> None:
    """The first request of a prompt is prepared in the thread pool (its encoding must not stall the
    event loop); a repeat is prepared on the event loop: same ids, no thread hop. Tools (a grammar
    to check) always take the pool."""
    import prefixserve.server.openai.routes as app_module

    hops: list[str] = []
    real = app_module.run_in_threadpool

    async def counting(fn: Any, *a: Any, **k: Any) -> Any:
        hops.append(fn.__name__)
        return await real(fn, *a, **k)

    monkeypatch.setattr(app_module, "run_in_threadpool", counting)
    eng = CountingTokenizerEngine()
    client: TestClient = make_client(eng=eng)
    body: dict[str, Any] = {"model": "fake-model", "max_tokens": 2,
                            "messages": [{"role": "system", "content": "s" * 400}, {"role": "user", "content": "hi"}]}

    def post(path: str, payload: dict[str, Any]) -> list[int]:
        r = client.post(path, json=payload, headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 200, r.text
        return list(eng.requests[-1].prompt_ids)

    first = post("/v1/chat/completions", body)
    assert hops == ["prepare_chat"]
    assert post("/v1/chat/completions", {**body, "stream": True}) == first and hops == ["prepare_chat"]
    assert eng.renders == 1
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    post("/v1/chat/completions", {**body, "tools": tools})
    post("/v1/chat/completions", {**body, "tools": tools})
    assert hops == ["prepare_chat"] * 3
    text = {"model": "fake-model", "max_tokens": 2, "prompt": "p " * 400}
    assert post("/v1/completions", text) == post("/v1/completions", text)
    assert hops == ["prepare_chat"] * 3 + ["prepare_completion"]
    r = client.post("/v1/completions", json={**text, "max_tokens": -1}, headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # refused inline, the same error
