"""POST /tokenize, /detokenize and GET /tokenizer_info (fake engine, and the embedded SmolLM2's
tokenizer): the ids are exactly those a completion or a chat request hands the engine (the cache's
key), vLLM's request forms and fields are taken (lm-eval's remote tokenizer sends
`add_special_tokens: false`), nothing runs, and bad input is an OpenAI-shaped 400."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from prefixserve.models.loaders.load import embedded_model_path
from prefixserve.models.tokenizer import Tokenizer, load_tokenizer_gguf
from tests.helpers.fake_engine import FakeEngine
from tests.server.conftest import ADMIN, auth

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def test_a_prompt_tokenizes_to_what_a_completion_sends(client: TestClient, engine: FakeEngine) -> None:
    r = client.post("/tokenize", json={"prompt": "héllo", "return_token_strs": True}, headers=auth())
    assert r.status_code == 200, r.text
    body = r.json()
    client.post("/v1/completions", json={"prompt": "héllo", "max_tokens": 1}, headers=auth())
    assert body["tokens"] == list(engine.requests[-1].prompt_ids) and body["count"] == 6
    assert body["max_model_len"] == engine.max_model_len
    assert body["token_strs"] == [engine.tokenizer.decode([i]) for i in body["tokens"]]
    assert client.post("/tokenize", json={"prompt": [5, 6, 7]}, headers=auth()).json()["tokens"] == [5, 6, 7]
    assert client.post("/tokenize", json={"prompt": "x"}, headers=auth()).json()["token_strs"] is None


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_messages_tokenize_to_what_a_chat_request_sends(client: TestClient, engine: FakeEngine, tools: Any) -> None:
    extra = {} if tools is None else {"tools": tools}
    body = client.post("/tokenize", json={"messages": MESSAGES, **extra}, headers=auth()).json()
    num_before = len(engine.requests)
    client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, **extra}, headers=auth())
    assert len(engine.requests) == num_before + 1  # /tokenize ran nothing
    assert body["tokens"] == list(engine.requests[-1].prompt_ids)
    bare = client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False, **extra},
                       headers=auth()).json()
    assert body["tokens"][: bare["count"]] == bare["tokens"] and bare["count"] < body["count"]


def test_detokenize_round_trips(client: TestClient) -> None:
    ids = client.post("/tokenize", json={"prompt": "round trip ✓"}, headers=auth()).json()["tokens"]
    r = client.post("/detokenize", json={"tokens": ids}, headers=auth())
    assert r.status_code == 200 and r.json() == {"prompt": "round trip ✓"}


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return load_tokenizer_gguf(embedded_model_path())


def test_control_tokens_keep_their_text(make_client: Any, smol: Tokenizer) -> None:
    """The embedded SmolLM2's tokenizer: a `messages` result detokenizes to the rendered prompt, control
    tokens included (as vLLM's /detokenize), and their token_strs are their text, not ""."""
    engine = FakeEngine(max_model_len=2048)
    engine.tokenizer, engine.vocab_size = smol, len(smol.hf)  # type: ignore[assignment]
    client = make_client(eng=engine)
    r = client.post("/detokenize", json={"tokens": [1, 4093, 198, 26843, 2]}, headers=auth())
    assert r.status_code == 200 and r.json() == {"prompt": "<|im_start|>user\nHi<|im_end|>"}
    body = client.post("/tokenize", json={"messages": MESSAGES, "return_token_strs": True}, headers=auth()).json()
    text = client.post("/detokenize", json={"tokens": body["tokens"]}, headers=auth()).json()["prompt"]
    assert text == smol.hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert body["token_strs"][:3] == ["<|im_start|>", "system", "\n"] and "<|im_end|>" in body["token_strs"]
    assert "".join(body["token_strs"]) == text
    assert smol.decode(body["tokens"]) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")  # generation's


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {}, 400, "messages"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {"prompt": [1, 10**6]}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, 400, "add_generation_prompt"),
        ("/tokenize", {"prompt": "a", "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "messages"),
        ("/tokenize", {"messages": [*MESSAGES, {"role": "assistant", "content": "Hel"}],
                       "continue_final_message": True, "add_generation_prompt": True}, 400, "continue_final_message"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "bad name"}}]},
         400, "tools[0].function.name"),
        ("/tokenize", {"prompt": "a", "model": "gpt-4o"}, 404, "model"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
    ],
)
def test_bad_input_is_an_openai_shaped_error(client: TestClient, path: str, body: Any, status: int,
                                             param: str) -> None:
    r = client.post(path, json=body, headers=auth())
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and set(err) == {"message", "type", "param", "code"}


def test_a_key_is_needed_and_the_admin_key_does_not_generate(client: TestClient) -> None:
    assert client.post("/tokenize", json={"prompt": "a"}).status_code == 401
    assert client.get("/tokenizer_info").status_code == 401
    assert client.get("/tokenizer_info", headers=auth("sk-wrong")).json()["error"]["code"] == "invalid_api_key"
    assert client.get("/tokenizer_info", headers=auth(ADMIN)).status_code == 200  # settings, as /v1/models
    assert client.post("/detokenize", json={"tokens": [5]}, headers=auth("sk-wrong")).status_code == 401
    assert client.post("/tokenize", json={"prompt": "a"}, headers=auth(ADMIN)).status_code == 403


def test_vllm_prompt_form_with_and_without_special_tokens(client: TestClient) -> None:
    """The fake tokenizer adds no special tokens: both settings give the completion's ids; an empty
    text is no tokens, as vLLM answers."""
    with_sp = client.post("/tokenize", json={"model": "fake-model", "prompt": "ab", "add_special_tokens": True},
                          headers=auth()).json()
    plain = client.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False}, headers=auth()).json()
    assert with_sp["tokens"] == plain["tokens"] == [ord("a") + 3, ord("b") + 3]
    assert client.post("/tokenize", json={"prompt": ""}, headers=auth()).json() == {
        "count": 0, "max_model_len": 512, "tokens": [], "token_strs": None}
    assert client.post("/detokenize", json={"tokens": []}, headers=auth()).json() == {"prompt": ""}


def test_continue_final_message_ends_with_its_content(client: TestClient, engine: FakeEngine) -> None:
    msgs = [*MESSAGES, {"role": "assistant", "content": "Hello, I am"}]
    body = client.post("/tokenize", json={"messages": msgs, "continue_final_message": True}, headers=auth()).json()
    assert engine.tokenizer.decode(body["tokens"]).endswith("<assistant>Hello, I am")
    closed = client.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False}, headers=auth()).json()
    assert closed["tokens"][: body["count"]] == body["tokens"] and closed["count"] > body["count"]


def test_tokenizer_info_fake(client: TestClient) -> None:
    info = client.get("/tokenizer_info", headers=auth()).json()
    assert info["tokenizer_class"] == "FakeTokenizer" and info["model_max_length"] == 512 and "eos_token" in info


def test_the_embedded_tokenizer_as_lm_eval_reads_it(make_client: Any, smol: Tokenizer) -> None:
    """What lm-eval's RemoteTokenizer reads: /tokenizer_info's eos/bos/pad tokens and chat template,
    and /tokenize with add_special_tokens false, whose eos text encodes to the eos id (its
    eot_token_id). No path of the server's disk is in the answer."""
    engine = FakeEngine(max_model_len=2048)
    engine.tokenizer, engine.vocab_size = smol, len(smol.hf)  # type: ignore[assignment]
    client = make_client(eng=engine)
    r = client.get("/tokenizer_info", headers=auth())
    assert r.status_code == 200, r.text
    info = r.json()
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("<|im_end|>", "<|im_start|>", "<|im_end|>")
    assert info["chat_template"] == smol.hf.chat_template and info["tokenizer_class"]
    assert info["model_max_length"] == 2048
    assert "name_or_path" not in info and "/" not in str({k: v for k, v in info.items() if k != "chat_template"})
    eos = client.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}, headers=auth())
    assert eos.json()["tokens"] == [2] == [smol.eos_token_ids[0]]
    text = " The capital of France is Paris."
    plain = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}, headers=auth()).json()
    assert plain["tokens"] == smol.encode(text)  # SmolLM2 adds no BOS: the completion's ids
    msgs = [*MESSAGES, {"role": "assistant", "content": "Hello"}]
    cont = client.post("/tokenize", json={"messages": msgs, "continue_final_message": True}, headers=auth()).json()
    rendered = client.post("/detokenize", json={"tokens": cont["tokens"]}, headers=auth()).json()["prompt"]
    assert rendered.endswith("<|im_start|>assistant\nHello")
