"""The cluster as deployed (bench/cluster.sh, docs/gateway.md "SMG in front of keyed replicas"): a
real redis-server, two `prefixserve serve` replicas sharing it, and SMG (the `smg` gateway from PyPI)
in front with round-robin routing, so consecutive requests land on both replicas.

SMG 1.13 registers a worker only after reading its /v1/models, with the key given as its own
--api-key, and then checks every client's key itself (--api-key and each --tenant-api-key); a key
it knows is forwarded unchanged. So the replicas hold a key for the gateway (a tenant of its own) and
the gateway the tenants' keys. Through it: each tenant's key reaches the replica (its namespace, its
cached_tokens); a key the gateway does not know is refused by the gateway (401, invalid_api_key,
never forwarded); cache_salt and tenants keep their namespaces (a first request in one misses
whatever the other replica holds); usage carries cached_tokens (a repeat is served from RAM or
Redis); streaming arrives chunk by chunk with its usage and [DONE]; a forced tool call comes back as
the replica sent it; the replica's 400s come back with its status and OpenAI-shaped body unchanged,
except for the fields SMG's own request schema checks first (its message, the same status and param)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.redis_proc import RedisServer
from tests.helpers.server_proc import ServerProcess, free_port

pytestmark = pytest.mark.slow
KEY_A, KEY_B, KEY_GATEWAY = "sk-a-0123456789", "sk-b-9876543210", "sk-gateway-0123456"
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Northwind Outfitters return policy. " + " ".join(
    f"Rule {i}: department {i} allows returns in {i + 20} days." for i in range(1, 9)) + " Summarise rule 3."
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def smg_binary() -> str:
    path = shutil.which("smg", path=os.path.dirname(sys.executable))
    if path is None:
        pytest.skip("smg is not installed (`make install` installs it: pip install smg)")
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ServerProcess]]:
    """(the gateway's base URL, replica 1 to compare with)."""
    smg = smg_binary()
    key_file = Path(tmp_path_factory.mktemp("secret")) / "redis.key"
    key_file.write_text("a-deployment-secret-of-32-bytes!\n")
    with RedisServer() as rs:
        args = ["--api-key", f"alice {KEY_A}", "--api-key", f"bob {KEY_B}", "--api-key", f"gateway {KEY_GATEWAY}",
                "--no-ledger", "--num-threads", "1",
                "--cache-redis-url", rs.url, "--cache-redis-key-file", str(key_file)]
        replicas = [ServerProcess(args), ServerProcess(args)]
        threads = [threading.Thread(target=r.start) for r in replicas]  # two model loads at once
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        port = free_port()
        log = open(Path(tmp_path_factory.mktemp("smg")) / "smg.log", "wb")  # noqa: SIM115 (closed below)
        gateway = subprocess.Popen(
            [smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
             "--api-key", KEY_GATEWAY, "--tenant-api-key", f"alice:{KEY_A}", "--tenant-api-key", f"bob:{KEY_B}",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--worker-urls", *(r.base_url for r in replicas)], stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            for r in replicas:
                assert r.proc is not None and r.proc.poll() is None, r.log_tail()
            deadline = time.monotonic() + 120
            while not _ready(base):
                assert gateway.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()[-3000:]
                time.sleep(0.5)
            yield base, replicas[0]
        finally:
            gateway.terminate()
            gateway.wait(30)
            log.close()
            for r in replicas:
                r.__exit__(None, None, None)


def _ready(base: str) -> bool:
    try:
        return httpx.get(base + "/v1/models", headers=auth(KEY_A), timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


def post(base: str, path: str, body: dict[str, Any], key: str | None = KEY_A) -> httpx.Response:
    return httpx.post(base + path, json=body, headers=auth(key), timeout=300)


def completion(prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}


def test_unknown_keys_stop_at_the_gateway_and_the_replicas_errors_come_back_unchanged(cluster: Any) -> None:
    base, replica = cluster
    for key in (None, "sk-wrong-000000000"):
        through, direct = post(base, "/v1/completions", completion(), key), post(replica.base_url, "/v1/completions",
                                                                                  completion(), key)
        assert through.status_code == direct.status_code == 401
        assert through.json()["error"]["code"] == direct.json()["error"]["code"] == "invalid_api_key"
    # what the replica decides comes back as it said it: a bad cache_salt or prompt_cache_key, no room
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**7}
    for path, body in (("/v1/completions", completion(cache_salt="x" * 300)),
                       ("/v1/completions", completion(prompt_cache_key="k" * 2000)), ("/v1/chat/completions", chat)):
        through, direct = post(base, path, body), post(replica.base_url, path, body)
        assert through.status_code == direct.status_code == 400, through.text
        assert through.json() == direct.json()
    # fields SMG's own schema checks are refused by the gateway: the same status and param, its wording
    for body in (completion(max_tokens=-1), completion(temperature="hot"), completion(logprobs=99), completion(n=0)):
        through, direct = post(base, "/v1/completions", body), post(replica.base_url, "/v1/completions", body)
        assert through.status_code == direct.status_code == 400, through.text
        assert through.json()["error"]["param"] == direct.json()["error"]["param"]
    # a model no replica serves: the gateway's own 404 (it routes by model), with OpenAI's code
    through = post(base, "/v1/completions", {**completion(), "model": "no-such-model"})
    assert through.status_code == 404 and through.json()["error"]["code"] == "model_not_found"


def test_usage_salt_and_tenants_pass_through(cluster: Any) -> None:
    base, replica = cluster
    prompt = "Salt test. " + PROMPT
    first = post(base, "/v1/completions", completion(prompt)).json()
    n = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = 0
    for _ in range(60):  # the next request goes to the other replica: a hit once the prompt reached Redis
        again = post(base, "/v1/completions", completion(prompt)).json()
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        if cached:
            break
        time.sleep(0.5)
    assert 0 < cached <= n
    # another salt, another tenant: their own namespaces on either replica, whatever alice's hold
    for key, salt in ((KEY_A, "s1"), (KEY_B, None), (KEY_A, "s2")):
        body = completion(prompt, **({"cache_salt": salt} if salt else {}))
        usage = post(base, "/v1/completions", body, key).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0, (key, salt)
    direct = post(replica.base_url, "/v1/completions", completion(prompt)).json()
    assert direct["choices"][0]["text"] == first["choices"][0]["text"]
    assert set(direct["usage"]) == set(first["usage"])


def test_streaming_arrives_in_chunks_with_its_usage(cluster: Any) -> None:
    base, _ = cluster
    whole = post(base, "/v1/completions", completion()).json()
    body = completion(stream=True, stream_options={"include_usage": True})
    chunks: list[dict[str, Any]] = []
    done = False
    with httpx.stream("POST", base + "/v1/completions", json=body, headers=auth(KEY_A), timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    assert done and len(chunks) >= 3
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["choices"][0]["text"]
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"] and "cached_tokens" in usage["prompt_tokens_details"]


def test_a_forced_tool_call_comes_back_as_the_replica_sends_it(cluster: Any) -> None:
    base, replica = cluster
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "temperature": 0,
            "max_tokens": 40}
    through, direct = post(base, "/v1/chat/completions", body).json(), post(replica.base_url, "/v1/chat/completions",
                                                                             body).json()
    calls = [c["function"] for c in through["choices"][0]["message"]["tool_calls"]]
    assert calls == [c["function"] for c in direct["choices"][0]["message"]["tool_calls"]]
    assert calls[0]["name"] == "get_weather" and through["choices"][0]["finish_reason"] == "tool_calls"
