"""Malformed requests against a real server: each one an OpenAI-shaped 4xx, the server healthy after.

Every case names what is wrong with it and the exact status it must get (400 for a bad body or
field, 401 for missing or wrong credentials, 404/405 for routes, 413 for an oversized body). After
all of them: /health is ok with nothing running, a normal request is answered, and the server
counted no 5xx. A client that hangs up while still sending its body is not the server's error either
(`test_client_gone_while_sending_the_body_is_not_a_5xx`).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.reliability.bad_requests import CASES, CHAT, CMPL, DOUBLED_AUTH, MSGS, Bad
from tests.reliability.client import (
    Target,
    connect,
    count_5xx,
    hang_up,
    health,
    openai_error,
    raw_request,
    scrape,
    wait_idle,
)

pytestmark = pytest.mark.slow


def send(target: Target, case: Bad, client: httpx.Client) -> httpx.Response:
    headers: list[tuple[str, str]] = (
        [("Authorization", f"Bearer {target.keys['alice']}")] if case.auth else []
    )
    headers += list(case.headers)
    if isinstance(case.body, bytes):
        content = case.body
    elif case.body is None:
        content = b""
    else:
        content = json.dumps({k: v for k, v in case.body.items() if v is not None}).encode()
    if content:
        headers.append(("Content-Type", "application/json"))
    raw = [
        (k.encode("latin-1"), v.encode("latin-1")) for k, v in headers
    ]  # bytes: a non-ASCII key goes as is
    return client.request(case.method, target.base_url + case.path, content=content or None, headers=raw)


def check_refused(r: httpx.Response, case: Bad) -> None:
    assert r.status_code == case.status, f"{case.name}: {r.status_code} {r.text[:300]}"
    err = openai_error(r)
    if case.param is not None:
        assert err["param"] == case.param, f"{case.name}: {err}"
    if case.status == 401:
        assert r.headers.get("www-authenticate", "").lower().startswith("bearer"), case.name


def test_enough_distinct_cases() -> None:
    names = [c.name for c in CASES + DOUBLED_AUTH]
    assert len(set(names)) == len(names) >= 40


def test_every_malformed_request_gets_an_openai_4xx_and_the_server_stays_healthy(main: Target) -> None:
    before = scrape(main)
    with httpx.Client(timeout=120) as client:
        failures = []
        for case in CASES:
            try:
                check_refused(send(main, case, client), case)
            except AssertionError as e:
                failures.append(str(e))
        assert not failures, "\n".join(failures)
        wait_idle(main)
        ok = client.post(
            main.base_url + CHAT, json={"messages": MSGS, "max_tokens": 2}, headers=main.auth("alice")
        )
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1, ok.text
    after = scrape(main)
    assert count_5xx(after) == count_5xx(before)
    # Nothing malformed reached the engine: the one good request is all it saw.
    assert after["prefixserve_engine_requests_total"] - before["prefixserve_engine_requests_total"] == 1
    print(f"\nbad input: {len(CASES)} distinct malformed requests, all OpenAI-shaped 4xx, server healthy")


@pytest.mark.parametrize("case", DOUBLED_AUTH, ids=lambda c: c.name)
def test_doubled_authorization_header_is_refused(main: Target, case: Bad) -> None:
    with httpx.Client(timeout=120) as client:
        check_refused(send(main, case, client), case)


def test_client_gone_while_sending_the_body_is_not_a_5xx(main: Target) -> None:
    """The client announces a body, sends part of it and hangs up (or resets). Nobody is left to
    answer, so this is a 499-style abort, never an 'unhandled error' counted as a 5xx."""
    before = scrape(main)
    body = json.dumps({"prompt": "hello " * 50, "max_tokens": 4}).encode()
    for reset in (False, True):
        s = connect(main)
        s.sendall(raw_request(CMPL, body, main.auth("alice"))[: -len(body) // 2])
        time.sleep(0.2)
        hang_up(s, reset)
    time.sleep(0.5)
    wait_idle(main)
    assert health(main)["ok"]
    assert count_5xx(scrape(main)) == count_5xx(before)


def test_an_oversized_prompt_is_refused_without_stalling_other_streams(main: Target) -> None:
    """A 4 MB prompt string (well inside the 16 MiB body limit, 500x the context) must be refused
    quickly, and must not freeze the streams of other clients while the server finds out it is too
    long: the largest gap between two SSE events of a concurrent stream stays under a second."""
    gaps: list[float] = []
    started = threading.Event()

    def consume() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 80, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST", main.base_url + CMPL, json=body, headers=main.auth("bob"), timeout=300
        ) as r:
            last = None
            for line in r.iter_lines():
                if line.startswith("data: "):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    started.set()

    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(120)
    time.sleep(0.5)
    t0 = time.perf_counter()
    r = httpx.post(main.base_url + CMPL, json={"prompt": "lorem ipsum " * 350_000, "max_tokens": 1},
                   headers=main.auth("alice"), timeout=300)  # fmt: skip
    refused_s = time.perf_counter() - t0
    t.join(300)
    assert r.status_code == 400 and openai_error(r)["code"] == "context_length_exceeded"
    print(
        f"\n4.2 MB prompt refused in {refused_s:.2f} s; largest gap in a concurrent stream {max(gaps):.2f} s"
    )
    assert max(gaps) < 1.0, (
        f"a concurrent stream stalled for {max(gaps):.1f} s (refusal took {refused_s:.1f} s)"
    )
