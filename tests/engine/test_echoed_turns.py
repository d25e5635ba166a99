"""A finished turn is cached as its client will send it back: a chat client sends the reply's text,
which the tokenizer may split otherwise than the model sampled it ("\\n\\n" then "1" where encoding
gives "\\n" then "\\n1"); a client of token ids sends the sampled ids. Either way the next turn's
cache hit covers the whole history (docs/cache.md, "Finished turns")."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from prefixserve.cache import Hit
from prefixserve.models.loaders.load import embedded_model_path
from prefixserve.models.tokenizer import Tokenizer, load_tokenizer_gguf
from prefixserve.types import Namespace, Request, SamplingParams, Usage
from tests.engine.test_engine_cache import make_engine
from tests.helpers.engine_run import assert_fresh_prefill, collect, echoed

SYSTEM = "You are a helpful assistant."
ASK = ["Give me three tips for sleeping better.", "Who are you?", "Translate 'good morning' into French.",
       "How do I make pancakes?", "Why is the sky blue?", "List the planets of the solar system."]
# "Sure!\n\n1. Sleep well." as a model may sample it: "\n\n" one token, the encoding's "\n" + "\n"
PIECES = ["Sure", "!", "\n\n", "1", ".", " Sleep", " well", ".", "\n", "2", ".", " Don", "'", "t", " worry", "."]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer_gguf(embedded_model_path())


def sampled(tok: Tokenizer, pieces: list[str]) -> list[int]:
    return [t for p in pieces for t in tok.hf.encode(p, add_special_tokens=False)]


def history(tok: Tokenizer, user: str, reply: str) -> tuple[list[int], list[int]]:
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Thanks."}]
    return tok.render_chat(first), tok.render_chat(second)


def test_echoed_is_the_next_turns_encoding(tok):
    text = "".join(PIECES)
    ids, second = history(tok, "Tips?", text)
    weird, eos = sampled(tok, PIECES), tok.eos_token_ids[0]
    back = echoed(tok, ids, weird + [eos])
    assert back is not None and list(back) != weird + [eos]
    assert second[: len(ids) + len(back)] == ids + list(back)  # the whole turn, its <|im_end|> too
    assert back[-1] == eos
    # a reply cut by max_tokens (no stop token): its text, encoded
    assert echoed(tok, ids, weird) == back[:-1]
    # a completion's text prompt (no control token at all): the prompt's run is re-encoded with the reply
    prompt = tok.encode("Here are some tips")
    run = echoed(tok, prompt, sampled(tok, ["!", "\n\n", "1", "."]))
    assert run is not None and list(prompt) + list(run) == tok.encode("Here are some tips!\n\n1.")


def test_echoed_declines_where_the_next_request_is_not_known(tok):
    ids, _ = history(tok, "Tips?", "x")
    # text that spells a control token: render_chat keeps it text, so its encoding is not ours to guess
    assert echoed(tok, ids, sampled(tok, ["<", "|", "im", "_", "end", "|", ">"])) is None
    # a prompt whose last run does not encode to itself (ids a client chose): the reply cannot be placed
    odd = tok.encode("Hello") + sampled(tok, [" ", "wor", "ld"])
    assert echoed(tok, odd, sampled(tok, ["!"])) is None


def run(engine, ids: list[int], ns: Namespace, max_tokens: int, temperature: float = 0.0, seed: int = 0,
        text_history: bool = True) -> tuple[list[int], Usage]:
    return asyncio.run(collect(engine, Request(uuid.uuid4().hex, ns, tuple(ids), SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=seed), text_history=text_history)))


def settle(engine) -> None:
    async def go() -> None:
        for _ in range(400):
            if not engine.core.refills:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the turn refills did not finish")
    asyncio.run(go())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "int4"])
def test_a_chat_history_hits_through_the_replys_end(mode):
    """Sampled replies (temperature 1: splits of the text that the tokenizer would not write are
    common) sent back as text: turn 2 is served from the cache through the reply's <|im_end|> (the
    whole reply where max_tokens cut it), in every decode mode, and its entry is bitwise a fresh
    prefill of that history. The bf16 mode (dense decode: no refill, its own path to the entry) runs
    the first three questions: its decode is torch's bf16 matmul, which CPUs without bf16 arithmetic
    emulate (153 s for six under the AVX2 emulation); the server's default mode runs all six."""
    engine = make_engine(1 << 30, mode)
    tok = engine.tokenizer
    ns = Namespace("smol", "t")
    turns: list[tuple[list[int], int]] = []
    for k, user in enumerate(ASK if mode == "int4" else ASK[:3]):
        ids, _ = history(tok, user, "")
        out, _ = run(engine, ids, ns, 96, temperature=1.0, seed=k)
        settle(engine)
        _, second = history(tok, user, tok.decode(out))
        stop = out[-1] in tok.eos_token_ids
        end = second.index(tok.eos_token_ids[0], len(ids)) + (1 if stop else 0)  # past <|im_end|>, or up to it
        least = end
        _, u2 = run(engine, second, ns, 1)
        assert u2.cached_tokens >= least, (user, tok.decode(second[u2.cached_tokens:end]))
        turns.append((second[:end], least))
    asyncio.run(engine.shutdown())
    for tokens, least in turns:  # the entries hold exactly what a fresh prefill of the history gives
        hit = engine.core.cache.lookup(ns, tuple(tokens) + (0,))
        assert isinstance(hit, Hit) and hit.num_cached_tokens >= least
        assert_fresh_prefill(engine.core.runner, hit.entry.state, tokens[: hit.num_cached_tokens], 128)
    assert engine.core.cache.check_integrity() is None


@pytest.mark.slow
def test_a_token_id_history_hits_the_sampled_ids():
    """A client of token ids (a completion's prompt given as ids) sends back the ids the model sampled:
    its turn is cached as sampled, whatever the tokenizer would write."""
    engine = make_engine(1 << 30, "int4")
    tok = engine.tokenizer
    ns = Namespace("smol", "t")
    ids, _ = history(tok, ASK[0], "")
    differing = 0
    for seed in range(12):
        out, _ = run(engine, ids, ns, 64, temperature=1.0, seed=seed, text_history=False)
        settle(engine)
        _, u2 = run(engine, ids + out + tok.encode("\n"), ns, 1, text_history=False)  # the turn, then more
        assert u2.cached_tokens == len(ids) + len(out)
        differing += echoed(tok, ids, out) not in (None, tuple(out))
        if differing == 2:
            break
    assert differing  # the sampled ids were cached where the tokenizer's would differ
    asyncio.run(engine.shutdown())


def test_a_long_text_prompt_is_re_encoded_only_near_its_end(tok, monkeypatch):
    """A completion's long text prompt (no control token to start from): only its last tokens are
    encoded again with the reply, and the reply comes out as the whole text's encoding has it."""
    text = " ".join(f"Item {i} costs {i * 3} dollars." for i in range(600))
    prompt = tok.encode(text)
    reply = sampled(tok, ["!", "\n\n", "1", ".", " n", "early"])
    seen: list[str] = []
    encode = tok.hf.encode
    monkeypatch.setattr(tok.hf, "encode", lambda t, **kw: (seen.append(t), encode(t, **kw))[1])
    back = echoed(tok, prompt, reply)
    assert back is not None and len(seen) == 1 and len(seen[0]) < 400
    assert list(prompt) + list(back) == encode(text + "!\n\n1. nearly", add_special_tokens=False)
