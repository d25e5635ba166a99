"""`prefixserve serve --model DIR` on a tiny random hybrid (Qwen3.5 dense) saved to a temp dir:
the learning sequence over HTTP, outputs equal to a `--cache-max-bytes 0` server, another tenant misses."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.server_proc import ServerProcess
from tests.hybrid.tiny import make_model

pytestmark = pytest.mark.slow
SYSTEM = "You are a terse assistant for the Hybrid Test Suite. " * 5
KEYS = ["--api-key", "sk-a", "--api-key", "sk-b"]


def _chat(srv: ServerProcess, key: str, user: str) -> tuple[str, int, int]:
    body = {"model": "tiny-qwen35", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}
    r = httpx.post(srv.openai_url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                   timeout=120)
    assert r.status_code == 200, r.text
    j = r.json()
    return j["choices"][0]["message"]["content"], j["usage"]["prompt_tokens_details"]["cached_tokens"], \
        j["usage"]["prompt_tokens"]


def test_hybrid_over_http(tmp_path):
    folder = str(tmp_path / "tiny-qwen35")
    make_model(folder, layers=4, seed=31)
    env = {"PREFIXSERVE_DTYPE": "fp32"}
    users = ["Alpha question here?", "Bravo, tell me more.", "Charlie wants to know.", "Delta is last."]
    common = ["--model", folder, "--no-ledger", "--num-threads", "1", *KEYS]
    with ServerProcess(common, env=env) as srv:
        health = httpx.get(srv.base_url + "/health").json()
        got = [_chat(srv, "sk-a", u) for u in users]
        other = _chat(srv, "sk-b", users[2])
    with ServerProcess([*common, "--cache-max-bytes", "0"], env=env) as plain:
        ref = [_chat(plain, "sk-a", u) for u in users]
    assert health["exact_reuse"] is True, health
    assert [g[0] for g in got] == [r[0] for r in ref]  # the same answers as with no cache
    assert other[0] == ref[2][0] and other[1] == 0  # another tenant misses
    # the common prefix: system prompt + the template up to the user message (byte-level tokenizer)
    cached = [g[1] for g in got]
    assert cached[0] == 0 and cached[1] == 0  # request 1's full prompt is snapshot-only, not a prefix of 2
    assert cached[2] > len(SYSTEM) and cached[3] == cached[2]  # 3 and 4 resume at request 2's boundary
    assert all(r[1] == 0 for r in ref)
