"""The scheduling gauges gateways read (Gateway API Inference Extension's endpoint picker, SGLang-aware
routers) under vLLM's and SGLang's names on /metrics: waiting, running and KV-cache usage, with the
prefixserve_* metrics, under the same access rules."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from prefixserve.cache import PrefixCache
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine import AsyncEngine, EngineCore
from prefixserve.server.operator.metrics import ServerMetrics, session_usage
from prefixserve.types import Namespace, Request, SamplingParams
from tests.conftest import load_embedded
from tests.helpers.fake_engine import FakeEngine
from tests.server.conftest import ADMIN, auth

GATEWAY_NAMES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "sglang:num_queue_reqs", "sglang:num_running_reqs",
                 "sglang:token_usage")


def gauges(text: str) -> dict[str, float]:
    """Each gauge's value by name (the one sample each gateway gauge has)."""
    return {family.name: family.samples[0].value for family in text_string_to_metric_families(text)
            if family.type == "gauge" and family.samples}


def test_session_usage_is_the_reserved_fraction_of_the_budget_within_0_and_1() -> None:
    assert session_usage({"reserved_session_bytes": 256.0, "max_session_bytes": 1024.0}) == 0.25
    assert session_usage({"reserved_session_bytes": 2048.0, "max_session_bytes": 1024.0}) == 1.0
    assert session_usage({"reserved_session_bytes": 0.0, "max_session_bytes": 0.0}) == 0.0
    assert session_usage({"cache_bytes": 1.0}) is None  # an engine that reports no session budget: no gauge


class BudgetEngine(FakeEngine):
    def metrics(self) -> dict[str, float]:
        return super().metrics() | {"reserved_session_bytes": 300.0, "max_session_bytes": 1200.0,
                                    "cache_max_bytes": 1000.0}


def test_gateway_gauges_are_on_metrics_with_its_access_rules(make_client: Callable[..., TestClient]) -> None:
    client = make_client(eng=BudgetEngine())
    assert client.get("/metrics").status_code == 401  # keys configured: the admin key, as for the rest
    text = client.get("/metrics", headers=auth(ADMIN)).text
    values = gauges(text)
    for name in GATEWAY_NAMES:
        assert name in values, name
        assert f'{name}{{model_name="fake-model"}}' in text
    assert values["vllm:kv_cache_usage_perc"] == values["sglang:token_usage"] == 0.25
    assert values["vllm:num_requests_waiting"] == values["vllm:num_requests_running"] == 0.0
    assert values["prefixserve_cache_usage_ratio"] == 0.0  # the fake's cache is empty
    assert "prefixserve_cache_entries" in values  # alongside the existing metrics


@pytest.mark.slow
def test_under_load_waiting_running_and_usage_are_plausible() -> None:
    """One session slot, three requests: while the first decodes, the other two wait; afterwards none
    run or wait and nothing is reserved."""
    model, runner = load_embedded("int4")
    core = EngineCore(runner, model.tokenizer, PrefixCache(CacheConfig(max_bytes=1 << 30)),
                      EngineConfig(max_num_seqs=1, max_session_bytes=64 << 20, prefill_chunk_tokens=128,
                                   max_batch_tokens=256), 2048, lambda r, d: None)
    engine = AsyncEngine(core, "smol", model.tokenizer, "test", model.arch.vocab_size)
    metrics = ServerMetrics(engine)
    ids = tuple(engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3))

    async def go() -> tuple[dict[str, float], dict[str, float]]:
        async def run(k: int, first: asyncio.Event | None) -> None:
            req = Request(f"g{k}", Namespace("smol", "t"), ids,
                          SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
            n = 0
            async for _ in engine.generate(req):
                n += 1
                if first is not None and n == 3:  # decoding, past the step that admitted it
                    first.set()

        decoding = asyncio.Event()
        tasks = [asyncio.ensure_future(run(0, decoding))]
        await asyncio.sleep(0)
        tasks += [asyncio.ensure_future(run(k, None)) for k in (1, 2)]
        await asyncio.wait_for(decoding.wait(), 120.0)
        during = gauges(metrics.render().decode())
        await asyncio.gather(*tasks)
        after = gauges(metrics.render().decode())
        await engine.shutdown()
        return during, after

    during, after = asyncio.run(go())
    assert during["vllm:num_requests_running"] == during["sglang:num_running_reqs"] == 1.0
    assert during["vllm:num_requests_waiting"] == during["sglang:num_queue_reqs"] == 2.0
    assert 0.0 < during["vllm:kv_cache_usage_perc"] <= 1.0
    assert during["vllm:gpu_cache_usage_perc"] == during["sglang:token_usage"] == during["vllm:kv_cache_usage_perc"]
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0.0
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    assert 0.0 < after["prefixserve_cache_usage_ratio"] <= 1.0  # the prompt is cached now
