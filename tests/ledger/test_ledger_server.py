"""End to end over a real `prefixserve serve`: the ledger agrees with what clients were told.

One module-scoped server (two tenants, an admin key, a pricing file, its own ledger path). The tests
run in file order and the last one SIGKILLs the server under load, so it must stay last.
"""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from prefixserve.ledger import Ledger, Pricing, UsageQuery
from tests.helpers.server_proc import ServerProcess

pytestmark = pytest.mark.slow

KEY_A, KEY_B, ADMIN = "sk-ledger-alice", "sk-ledger-bob", "sk-ledger-admin"
TENANT_OF = {KEY_A: "alice", KEY_B: "bob"}
PRICING = "[default]\ninput = 2.0\ncached_input = 0.5\noutput = 8.0\n"
SYSTEM = "You are the help desk of the Prefix Harbour ferry company. " + " ".join(
    f"Rule {i}: answer questions about route {i} briefly and politely." for i in range(20)
)
QUESTIONS = ["When does the first ferry leave?", "Can I bring a bicycle?", "Is there a cafe?", "Are pets allowed?",
             "Is there wifi?", "How long is the crossing?", "Where do I park?", "Can I change my ticket?"]  # fmt: skip


@dataclass(frozen=True)
class Served:
    tenant_id: str
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("ledger-e2e")
    (tmp / "pricing.toml").write_text(PRICING)
    args = ["--api-key", f"alice {KEY_A}", "--api-key", f"bob {KEY_B}", "--admin-key", ADMIN,
            "--pricing", str(tmp / "pricing.toml"), "--ledger-path", str(tmp / "ledger" / "usage.sqlite3")]  # fmt: skip
    with ServerProcess(args) as srv:
        yield srv


def ledger_path(srv: ServerProcess) -> Path:
    return Path(srv.args[srv.args.index("--ledger-path") + 1])


def client(srv: ServerProcess, key: str) -> OpenAI:
    return OpenAI(base_url=srv.openai_url, api_key=key, max_retries=0, timeout=300)


def model_id(srv: ServerProcess) -> str:
    return client(srv, KEY_A).models.list().data[0].id


def serve_one(srv: ServerProcess, key: str, kind: str, question: str) -> Served:
    """One request of `kind`; returns the usage the client was given."""
    c, model = client(srv, key), model_id(srv)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    stream_usage = {"stream": True, "stream_options": {"include_usage": True}}
    if kind == "chat":
        resp: Any = c.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)  # type: ignore[arg-type]
        rid, usage = resp.id, resp.usage
    elif kind == "chat_stream":
        chunks = list(c.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0,  # type: ignore[call-overload]
                                                **stream_usage))  # fmt: skip
        rid, usage = chunks[-1].id, chunks[-1].usage
    elif kind == "completion":
        resp = c.completions.create(
            model=model, prompt=SYSTEM + "\nQ: " + question + "\nA:", max_tokens=4, temperature=0
        )
        rid, usage = resp.id, resp.usage
    else:
        chunks = list(c.completions.create(model=model, prompt=SYSTEM + "\nQ: " + question + "\nA:", max_tokens=4,  # type: ignore[call-overload]
                                           temperature=0, **stream_usage))  # fmt: skip
        rid, usage = chunks[-1].id, chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = int(usage.prompt_tokens_details.cached_tokens or 0)
    return Served(TENANT_OF[key], rid, usage.prompt_tokens, cached, usage.completion_tokens)


def usage_page(srv: ServerProcess, key: str, **params: Any) -> httpx.Response:
    return httpx.get(
        srv.openai_url + "/usage", params=params, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )


def totals(page: dict[str, Any], by: str | None = None) -> dict[Any, tuple[int, int, int, int, float]]:
    """(requests, input, cached, output, cost) summed over every bucket, per value of `by`."""
    out: dict[Any, list[float]] = {}
    for bucket in page["data"]:
        for r in bucket["results"]:
            acc = out.setdefault(r[by] if by else None, [0, 0, 0, 0, 0.0])
            for i, name in enumerate(["num_model_requests", "input_tokens", "input_cached_tokens", "output_tokens",
                                      "cost_usd"]):  # fmt: skip
                acc[i] += r[name]
    return {k: (int(v[0]), int(v[1]), int(v[2]), int(v[3]), v[4]) for k, v in out.items()}


def expected(served: list[Served]) -> tuple[int, int, int, int, float]:
    cost = sum(((s.prompt_tokens - s.cached_tokens) * 2.0 + s.cached_tokens * 0.5 + s.completion_tokens * 8.0) / 1e6
               for s in served)  # fmt: skip
    return (len(served), sum(s.prompt_tokens for s in served), sum(s.cached_tokens for s in served),
            sum(s.completion_tokens for s in served), cost)  # fmt: skip


def assert_totals(got: tuple[int, int, int, int, float], want: tuple[int, int, int, int, float]) -> None:
    assert got[:4] == want[:4]
    assert got[4] == pytest.approx(want[4], rel=1e-9)


def test_mixed_workload_sums_equal_the_clients_usage(server: ServerProcess) -> None:
    start = int(time.time()) - 5
    kinds = ["chat", "chat", "chat_stream", "completion", "completion_stream", "chat"]
    jobs = [(key, kind, QUESTIONS[i]) for key in (KEY_A, KEY_B) for i, kind in enumerate(kinds)]
    with ThreadPoolExecutor(4) as pool:
        served = list(pool.map(lambda job: serve_one(server, *job), jobs))
    assert any(s.cached_tokens > 0 for s in served), "the workload should hit the prefix cache"

    for key in (KEY_A, KEY_B):
        page = usage_page(server, key, start_time=start, bucket_width="1h", group_by="model")
        assert page.status_code == 200, page.text
        got = totals(page.json())
        assert list(got) == [None] or len(got) == 1  # one model
        assert_totals(
            next(iter(got.values())), expected([s for s in served if s.tenant_id == TENANT_OF[key]])
        )

    admin = usage_page(server, ADMIN, start_time=start, bucket_width="1m", limit=1440, group_by="tenant_id")
    per_tenant = totals(admin.json(), by="tenant_id")
    assert sorted(per_tenant) == ["alice", "bob"]
    for tenant in ("alice", "bob"):
        assert_totals(per_tenant[tenant], expected([s for s in served if s.tenant_id == tenant]))


def test_usage_api_isolation_and_errors(server: ServerProcess) -> None:
    start = int(time.time()) - 3600
    serve_one(server, KEY_B, "chat", QUESTIONS[0])
    mine = usage_page(server, KEY_A, start_time=start, group_by="tenant_id").json()
    assert set(totals(mine, by="tenant_id")) <= {"alice"}
    refused = usage_page(server, KEY_A, start_time=start, tenant_id="bob")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tenant_id"
    only_bob = usage_page(server, ADMIN, start_time=start, tenant_id="bob", group_by="tenant_id").json()
    assert list(totals(only_bob, by="tenant_id")) == ["bob"]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"start_time": -1}, "start_time"),
        ({"start_time": start, "bucket_width": "1w"}, "bucket_width"),
        ({"start_time": start, "group_by": "project_id"}, "group_by"),
    ]
    for params, param in cases:
        bad = usage_page(server, KEY_A, **params)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param
    assert (
        httpx.get(server.openai_url + "/usage", params={"start_time": start}, timeout=30).status_code == 401
    )


def test_sigkill_under_load_loses_at_most_the_last_second(server: ServerProcess) -> None:
    """Must stay last: it kills the module's server."""
    done: list[tuple[str, float]] = []
    stop = threading.Event()

    def load(n: int) -> None:
        key = (KEY_A, KEY_B)[n % 2]
        i = n
        while not stop.is_set():
            try:
                s = serve_one(
                    server, key, ("chat", "chat_stream")[i % 2], QUESTIONS[i % len(QUESTIONS)] + f" #{i}"
                )
            except (openai.APIError, httpx.HTTPError):
                return  # the server is gone
            done.append((s.request_id, time.time()))
            i += 4

    threads = [threading.Thread(target=load, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    begin = time.monotonic()  # at least 5 s of load and 12 answers, at most 240 s
    while time.monotonic() - begin < 240 and (len(done) < 12 or time.monotonic() - begin < 5):
        time.sleep(0.1)
    assert server.proc is not None
    kill_time = time.time()
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    stop.set()
    for t in threads:
        t.join(timeout=60)

    conn = sqlite3.connect(ledger_path(server))
    ids = [rid for (rid,) in conn.execute("SELECT request_id FROM usage_records")]
    conn.close()
    must_have = {rid for rid, t in done if t < kill_time - 1.0}
    print(
        f"\n{len(done)} answered before the kill, {len(must_have)} over 1 s before, {len(ids)} rows in the ledger"
    )
    assert len(must_have) >= 4
    assert must_have <= set(ids), f"lost: {sorted(must_have - set(ids))}"
    assert len(ids) == len(set(ids)), "a request was recorded twice"

    with Ledger(str(ledger_path(server)), Pricing.default()) as reopened:  # what a restarted server sees
        assert reopened.check_integrity() == len(ids)
        rows = reopened.query(UsageQuery(0, int(time.time()) + 60, 10**9))
        assert sum(r.num_requests for r in rows) == len(ids)
