"""The session budget in tokens (--max-session-bytes over the KV bytes of a token): a request's prompt
alone beyond it, and a budget too small to start with."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from prefixserve.cache import PrefixCache
from prefixserve.config import MIN_SESSION_TOKENS, CacheConfig, ConfigError, EngineConfig
from prefixserve.engine import AsyncEngine, EngineCore
from prefixserve.types import InvalidRequest, Namespace, Request, SamplingParams
from tests.conftest import load_embedded

NS = Namespace("smol", "t")


def make_engine(**engine_kw) -> AsyncEngine:
    model, runner = load_embedded("int4")
    cfg = EngineConfig(prefill_chunk_tokens=64, max_batch_tokens=256, **engine_kw)
    core = EngineCore(runner, model.tokenizer, PrefixCache(CacheConfig(max_bytes=1 << 30)), cfg, 2048,
                      lambda r, d: None)
    return AsyncEngine(core, "smol", model.tokenizer, "test", model.arch.vocab_size)


def request(ids: list[int], max_tokens: int = 4) -> Request:
    return Request(uuid.uuid4().hex, NS, tuple(ids), SamplingParams(max_tokens=max_tokens, temperature=0.0))


@pytest.mark.slow
def test_the_session_budget_in_tokens_and_what_it_refuses() -> None:
    """max_session_tokens is what the server fits a default max_tokens into. A prompt that leaves no
    room for one token is refused as the prompt alone; an explicit max_tokens too many, as before."""
    _, runner = load_embedded("int4")
    engine = make_engine(max_session_bytes=100 * runner.kv_bytes_per_token() + 7)
    assert engine.max_session_tokens == 100
    engine.validate(request(list(range(1, 100)), max_tokens=1))  # 99 + 1 fits exactly
    with pytest.raises(InvalidRequest, match="the prompt alone \\(100 tokens\\) exceeds the server's session budget"):
        engine.validate(request(list(range(1, 101)), max_tokens=1))
    with pytest.raises(InvalidRequest, match="lower max_tokens or shorten the prompt"):
        engine.validate(request(list(range(1, 51)), max_tokens=51))
    asyncio.run(engine.shutdown())


@pytest.mark.slow
def test_a_budget_below_a_small_request_is_refused_when_the_engine_is_built() -> None:
    """`--max-session-bytes 1` started, said ok on /health, and answered every request 400."""
    model, runner = load_embedded("int4")
    per_token = runner.kv_bytes_per_token()

    def core(budget: int) -> EngineCore:
        return EngineCore(runner, model.tokenizer, PrefixCache(CacheConfig(max_bytes=0)),
                          EngineConfig(max_session_bytes=budget), 2048, lambda r, d: None)

    with pytest.raises(ConfigError, match="^--max-session-bytes 1 holds 0 tokens of this model's KV"):
        core(1)
    with pytest.raises(ConfigError, match=f"holds {MIN_SESSION_TOKENS - 1} tokens"):
        core(MIN_SESSION_TOKENS * per_token - 1)
    assert core(MIN_SESSION_TOKENS * per_token).max_session_tokens == MIN_SESSION_TOKENS
