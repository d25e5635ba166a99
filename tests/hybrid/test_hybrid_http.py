"""`prefixserve serve --model DIR` on a tiny random hybrid (Qwen3.5 dense) saved to a temp dir:
the learning sequence over HTTP (issue #14: request 2 resumes at the grid-aligned common prefix,
docs/hybrid.md), outputs equal to a `--cache-max-bytes 0` server, another tenant and a salt miss."""

from __future__ import annotations

import httpx
import pytest

from prefixserve.models.tokenizer import load_tokenizer_folder
from prefixserve.runner.hybrid_state import GRID
from tests.conftest import TEST_DEVICE
from tests.helpers.server_proc import ServerProcess
from tests.hybrid.tiny import make_model

pytestmark = pytest.mark.slow
SYSTEM = "You are a terse assistant for the Hybrid Test Suite. " * 5
KEYS = ["--api-key", "sk-a", "--api-key", "sk-b"]


def _messages(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def _chat(srv: ServerProcess, key: str, user: str, salt: str | None = None) -> tuple[str, int, int]:
    body: dict = {"model": "tiny-qwen35", "max_tokens": 8, "temperature": 0, "messages": _messages(user)}
    if salt is not None:
        body["cache_salt"] = salt
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
    common = ["--model", folder, "--device", TEST_DEVICE, "--no-ledger", "--num-threads", "1", *KEYS]
    with ServerProcess(common, env=env) as srv:
        health = httpx.get(srv.base_url + "/health").json()
        got = [_chat(srv, "sk-a", u) for u in users]
        other = _chat(srv, "sk-b", users[2])
        salted = _chat(srv, "sk-a", users[2], salt="s-1")
    with ServerProcess([*common, "--cache-max-bytes", "0"], env=env) as plain:
        ref = [_chat(plain, "sk-a", u) for u in users]
    assert health["exact_reuse"] is True, health
    assert [g[0] for g in got] == [r[0] for r in ref]  # the same answers as with no cache
    assert other[0] == ref[2][0] and other[1] == 0  # another tenant misses
    assert salted[0] == ref[2][0] and salted[1] == 0  # so does a salt of the same tenant
    # the common prefix of the rendered prompts: system prompt + the template up to the user message
    tok = load_tokenizer_folder(folder)
    ids = [tok.render_chat(_messages(u)) for u in users]
    assert [g[2] for g in got] == [len(i) for i in ids]
    lcp = next(i for i, (a, b) in enumerate(zip(ids[0], ids[1], strict=False)) if a != b)
    cached = [g[1] for g in got]
    # 1 stores its full prompt with its checkpoints; 2 resumes at the grid position <= the common
    # prefix (one of 1's checkpoints); 3 and 4 at least there
    assert lcp > len(SYSTEM) and cached[0] == 0 and cached[1] == lcp - lcp % GRID > 0
    assert cached[2] >= cached[1] and cached[3] >= cached[1]
    assert all(r[1] == 0 for r in ref)
