"""The engine over the embedded model as the server runs it here by default (4-bit decode rows), one
per test module: a 1 GiB cache, 128-token prefill chunks, 256 tokens a step, 2,048 of context."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from prefixserve.cache import PrefixCache
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine import AsyncEngine, EngineCore
from tests.conftest import load_embedded


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    model, runner = load_embedded("int4")
    core = EngineCore(runner, model.tokenizer, PrefixCache(CacheConfig(max_bytes=1 << 30)),
                      EngineConfig(prefill_chunk_tokens=128, max_batch_tokens=256), 2048, lambda r, d: None)
    engine = AsyncEngine(core, "smol", model.tokenizer, "test", model.arch.vocab_size)
    yield engine
    asyncio.run(engine.shutdown())
