"""A hybrid's finished turn, sent back as text that the tokenizer splits otherwise than the model
sampled it, is cached as the client sends it: the session's recurrent state cannot go back, so the
turn is re-fed from a copy of the prompt's cached entry (engine/inserts.py, docs/cache.md "Finished
turns"), and the entry equals a fresh prefill of the history."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from prefixserve.cache import PrefixCache
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine import AsyncEngine, EngineCore
from prefixserve.models import load_model
from prefixserve.runner import ModelRunner
from prefixserve.types import Namespace, Request, SamplingParams, Usage
from tests.hybrid.tiny import CHAT_TEMPLATE, SPECIALS, VOCAB, make_model

torch.set_num_threads(1)
SYSTEM = "You are a terse assistant for the Hybrid Test Suite. " * 4


def save_merging_tokenizer(folder: str) -> None:
    """The tiny byte-level tokenizer plus one merge, "a" + "a" -> "aa" (id 256; the control tokens
    after it): a model that writes "a" eight times wrote text the tokenizer encodes as four tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["aa"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "a")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen35m"))
    make_model(folder, layers=4, seed=5, with_tokenizer=False, vocab=VOCAB + 1)
    save_merging_tokenizer(folder)
    return load_model(folder, torch.float32)


def make_engine(model, max_bytes: int) -> AsyncEngine:
    core = EngineCore(ModelRunner(model.decoder, 1), model.tokenizer, PrefixCache(CacheConfig(max_bytes=max_bytes)),
                      EngineConfig(prefill_chunk_tokens=64, max_batch_tokens=128), 2048, lambda r, d: None)
    return AsyncEngine(core, "tiny", model.tokenizer, "test", model.arch.vocab_size)


async def run(engine: AsyncEngine, ids: list[int], ns: Namespace, max_tokens: int,
              bias: tuple[tuple[int, float], ...] = ()) -> tuple[list[int], Usage]:
    req = Request(uuid.uuid4().hex, ns, tuple(ids), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   ignore_eos=True, logit_bias=bias))
    out: list[int] = []
    usage = None
    async for d in engine.generate(req):
        out += d.token_ids
        usage = d.usage or usage
    assert usage is not None
    return out, usage


def test_a_hybrid_turn_is_cached_as_its_text_encodes(model):
    tok = model.tokenizer
    a, aa = tok.encode("a"), tok.encode("aa")
    assert len(a) == 1 and len(aa) == 1 and aa != a + a
    ns = Namespace("tiny", "t")
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say a."}]
    ids = tok.render_chat(first)
    second = tok.render_chat(first + [{"role": "assistant", "content": "a" * 8}, {"role": "user", "content": "More?"}])
    turn = list(ids) + aa * 4
    assert second[: len(turn)] == turn
    cached, plain = make_engine(model, 1 << 30), make_engine(model, 0)

    async def go():
        out, _ = await run(cached, ids, ns, 8, bias=((a[0], 100.0),))
        for _ in range(200):
            if not cached.core.refills:
                break
            await asyncio.sleep(0.02)
        assert not cached.core.refills
        got = await run(cached, second, ns, 16)
        want = await run(plain, second, ns, 16)
        await cached.shutdown()
        await plain.shutdown()
        return out, got, want

    out, (out2, u2), (ref2, _) = asyncio.run(go())
    assert out == a * 8  # sampled one "a" at a time; the history holds "aa" four times
    assert u2.cached_tokens == len(turn)  # was len(ids): the sampled turn's entry ends where the reply begins
    assert out2 == ref2
    entry = cached.core.cache.get(ns, tuple(turn))
    assert entry is not None
    runner = cached.core.runner
    fresh = runner.new_state()
    runner.prefill(fresh, turn, 64)
    restored = entry.state.restore(len(turn), 0)
    assert torch.equal(restored.kv[..., : len(turn), :], fresh.kv[..., : len(turn), :])
    for name in ("conv", "cell", "delta"):
        assert torch.equal(getattr(restored.rec, name), getattr(fresh.rec, name)), name
