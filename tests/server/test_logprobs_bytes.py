"""Logprobs of tokens that hold part of a UTF-8 character: `bytes` are the token's raw bytes (joined,
the text's UTF-8), `token` is the legacy ``bytes:\\xNN`` spelling where they are not valid UTF-8, and
completions' text_offset counts characters. Over the embedded SmolLM2's byte-level tokenizer (an
emoji is ' \\xf0\\x9f' + '\\x90' + '\\xb1'), and over HTTP with the fake engine's one-byte tokens."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from prefixserve.models.loaders.load import embedded_model_path
from prefixserve.models.tokenizer import Tokenizer, load_tokenizer_gguf
from prefixserve.server.openai.logprobs import LogprobRenderer
from prefixserve.types import TokenLogprob
from tests.server.conftest import KEY_A

TEXT = "Hi 🐱🐱 你好, café"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer_gguf(embedded_model_path())


def entries(ids: list[int], alternatives: list[int]) -> list[TokenLogprob]:
    return [TokenLogprob(i, -1.0, tuple((a, -2.0 - k) for k, a in enumerate(alternatives))) for i in ids]


def test_token_bytes_join_to_the_text(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    assert b"".join(tok.token_bytes(i) for i in ids) == TEXT.encode()
    assert [tok.token_bytes(i) for i in ids[1:4]] == [b" \xf0\x9f", b"\x90", b"\xb1"]
    assert tok.token_bytes(tok.eos_token_ids[0]) == b""  # a special token: its (skipped) text


def test_chat_bytes_are_the_raw_bytes(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    content = LogprobRenderer(tok).chat(entries(ids, ids[2:4]))["content"]
    assert bytes(b for e in content for b in e["bytes"]) == TEXT.encode()
    assert [e["token"] for e in content[1:4]] == ["bytes:\\x20\\xf0\\x9f", "bytes:\\x90", "bytes:\\xb1"]
    assert content[0] == {"token": "Hi", "logprob": -1.0, "bytes": [72, 105], "top_logprobs": content[0]["top_logprobs"]}
    assert [(t["token"], t["bytes"]) for t in content[1]["top_logprobs"]] == [("bytes:\\x90", [0x90]),
                                                                                  ("bytes:\\xb1", [0xB1])]


def test_completion_offsets_count_characters_and_top_keys_stay_distinct(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    out = LogprobRenderer(tok).completion(entries(ids, [ids[2], ids[3], ids[9]]), 5)
    offsets = out["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 5 and offsets[-1] < 5 + len(TEXT)
    for k, i in enumerate(ids):  # each token starts where the characters of the tokens before it end
        before = b"".join(tok.token_bytes(j) for j in ids[:k]).decode("utf-8", "ignore")
        assert offsets[k] == 5 + len(before), (k, i)
    assert len(out["top_logprobs"][0]) == 4  # 'Hi' and three byte tokens: all "\ufffd" before, one key


def test_echoed_prompt_offsets_count_characters(tok: Tokenizer) -> None:
    ids = tok.encode("Emoji: 🐱")
    out = LogprobRenderer(tok).prompt(ids[0], entries(ids[1:], []))
    assert out["tokens"][:3] == ["Em", "oji", ":"] and out["tokens"][3] == "bytes:\\x20\\xf0\\x9f"
    assert out["text_offset"] == [0, 2, 5, 6, 7, 7]  # ' ' + the emoji's first bytes, then its rest at 7
    assert out["token_logprobs"][0] is None and out["top_logprobs"][0] is None


def test_http_shapes_with_one_byte_tokens(client: TestClient) -> None:
    """The fake engine replays the prompt, one byte a token: 'é' is two tokens, neither a character."""
    auth = {"Authorization": f"Bearer {KEY_A}"}
    body = {"messages": [{"role": "user", "content": "é"}], "max_tokens": 8, "logprobs": True, "top_logprobs": 1}
    r = client.post("/v1/chat/completions", json=body, headers=auth).json()
    content = r["choices"][0]["logprobs"]["content"]  # '<user>' then 'é'
    assert [(e["token"], e["bytes"]) for e in content[-3:]] == [(">", [62]), ("bytes:\\xc3", [0xC3]),
                                                                ("bytes:\\xa9", [0xA9])]
    assert [t["token"] for t in content[-1]["top_logprobs"]] == ["bytes:\\xa9"]
    r = client.post("/v1/completions", json={"prompt": "éa", "max_tokens": 3, "logprobs": 1}, headers=auth).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == ["bytes:\\xc3", "bytes:\\xa9", "a"]
    assert lp["text_offset"] == [0, 0, 1]  # 'é' is one character, 'a' the second


def test_control_tokens_are_named_and_echoed(tok: Tokenizer) -> None:
    """QA: every control token was `""`, token and bytes, so in a completions top_logprobs dict they
    overwrote one another (3 alternatives of 5 listed, one with the logprob of another), and an echoed
    prompt lost them from its text ("Hi<|endoftext|>Bye" came back "HiBye"). They are named by their
    spelling, as vLLM names them; a generated reply's text still skips them, an echoed prompt's keeps them."""
    specials = tok.encode("<|im_start|><|im_end|><|endoftext|>")
    assert len(specials) == 3
    r = LogprobRenderer(tok)
    out = r.completion([TokenLogprob(specials[0], -0.5, tuple((s, -1.0 - k) for k, s in enumerate(specials)))], 0)
    assert out["top_logprobs"] == [{"<|im_start|>": -1.0, "<|im_end|>": -2.0, "<|endoftext|>": -3.0}]
    [entry] = r.chat([TokenLogprob(specials[1], -0.5, ())])["content"]
    assert (entry["token"], bytes(entry["bytes"])) == ("<|im_end|>", b"<|im_end|>")
    ids = tok.encode("Hi<|endoftext|>Bye")
    echoed = r.prompt(ids[0], entries(ids[1:], []))
    assert echoed["tokens"] == ["Hi", "<|endoftext|>", "By", "e"] and echoed["text_offset"] == [0, 2, 15, 17]
    assert r.completion(entries(ids, []), 0)["text_offset"] == [0, 2, 2, 4]  # generated: no text of its own



def test_streamed_offsets_are_the_tokens_own_whatever_text_each_chunk_carries(tok: Tokenizer) -> None:
    """A streamed choice's chunks need not carry their tokens' text: text that may begin a stop string
    is held back and goes out with a later token, and a stop cuts a token's text short. Its offsets
    are still the whole response's (tokens' own characters, an emoji's split bytes counted once
    whole), chunk after chunk: they were the characters sent so far."""
    from prefixserve.server.openai.shapes import ChoiceOutput, CompletionShape
    from prefixserve.types import Usage

    ids = tok.encode(TEXT)
    lps = entries(ids, [])
    whole = CompletionShape(id="c", model="m", logprobs=LogprobRenderer(tok)).full(
        [ChoiceOutput(0, TEXT, "stop", lps)], Usage(1, len(ids), 0))["choices"][0]["logprobs"]["text_offset"]
    shape = CompletionShape(id="c", model="m", logprobs=LogprobRenderer(tok))
    held = [TEXT[:1], "", TEXT[1:5], ""] + [""] * (len(ids) - 5) + [TEXT[5:9]]  # held back, then let go at once
    streamed = []
    for k, (text, lp) in enumerate(zip(held, lps, strict=True)):
        for chunk in shape.chunks(0, text, (lp,), "stop" if k == len(ids) - 1 else None):
            streamed += chunk["choices"][0]["logprobs"]["text_offset"]
    assert streamed == whole
    assert whole == [o for o in whole if o <= len(TEXT)] and whole == sorted(whole)
