"""Multi-turn chats under load: U users share one long system prompt and each holds a conversation of T
turns, sending the next turn 0-2*THINK s after the previous reply (the reply sent back verbatim).
Prints how many follow-up turns got less from the cache than their previous prompt + reply as
`/tokenize` renders it (more than 2 tokens short), and, with --probe, the gaps between streamed
tokens of one more client sending one-shot requests meanwhile (docs/cache.md, "Finished turns":
eager refills). Against a running server, e.g. `make serve`; from the repository root:

    .venv/bin/python bench/multiturn.py [--url http://127.0.0.1:8000] [--users 6] [--turns 8] [--think 0.5]
"""

from __future__ import annotations

import argparse
import random
import threading
import time
import uuid

import httpx

SYSTEM = "You are the concierge of the Harbour Hotel. " + " ".join(
    f"Rule {i}: rooms on floor {i} are quiet after {20 + i % 4} o'clock, and breakfast there is served from "
    f"{6 + i % 3} am." for i in range(62))
QUESTIONS = ["When is it quiet on floor 3?", "And breakfast on floor 7?", "Can I swap rooms?",
             "Is there a gym?", "What about floor 12?", "Thanks! Anything else I should know?"]


def common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def user(c: httpx.Client, url: str, uid: int, turns: int, think: float, salt: str, short: list[int]) -> None:
    messages = [{"role": "system", "content": SYSTEM}]
    before: list[int] | None = None  # the previous turn's prompt + reply, as rendered
    for t in range(turns):
        messages.append({"role": "user", "content": f"I am guest {uid}. {QUESTIONS[(t + uid) % len(QUESTIONS)]}"})
        ids = c.post(url + "/tokenize", json={"messages": messages}).json()["tokens"]
        r = c.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 24, "temperature": 0,
                                                       "cache_salt": salt}).json()
        if before is not None and r["usage"]["prompt_tokens_details"]["cached_tokens"] < common(before, ids) - 2:
            short.append(t + 1)
        messages.append({"role": "assistant", "content": r["choices"][0]["message"]["content"] or ""})
        before = c.post(url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["tokens"]
        time.sleep(think * random.random() * 2)


def probe(url: str, stop: threading.Event, gaps: list[float]) -> None:
    with httpx.Client(timeout=600) as c:
        while not stop.is_set():
            body = {"messages": [{"role": "user", "content": "Write a long story about a cat."}], "max_tokens": 100,
                    "stream": True, "temperature": 0.7}
            last = None
            with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--key", default=None)
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--think", type=float, default=0.5, help="mean seconds between a reply and the next turn")
    ap.add_argument("--probe", action="store_true", help="one more client streaming one-shot replies meanwhile")
    a = ap.parse_args()
    headers = {"Authorization": f"Bearer {a.key}"} if a.key else {}
    salt = uuid.uuid4().hex  # a namespace of this run's own: nothing cached before it
    short: list[int] = []
    with httpx.Client(timeout=600, headers=headers) as c:
        c.post(a.url + "/v1/chat/completions", json={"messages": [{"role": "system", "content": SYSTEM},
               {"role": "user", "content": "warm up"}], "max_tokens": 4, "cache_salt": salt})
        stop, gaps = threading.Event(), []
        prober = threading.Thread(target=probe, args=(a.url, stop, gaps)) if a.probe else None
        users = [threading.Thread(target=user, args=(c, a.url, u, a.turns, a.think, salt, short)) for u in range(a.users)]
        t0 = time.time()
        for th in ([prober] if prober else []) + users:
            th.start()
        for th in users:
            th.join()
        stop.set()
        if prober:
            prober.join()
    follow_ups = a.users * (a.turns - 1)
    print(f"{a.users} users x {a.turns} turns in {time.time() - t0:.1f} s: {len(short)} of {follow_ups} follow-up "
          f"turns short of their previous prompt + reply ({short.count(2)} of them second turns)")
    if gaps:
        g = sorted(gaps)
        print(f"probe: {len(g)} gaps, p50 {g[len(g) // 2] * 1000:.1f} ms, p90 {g[int(len(g) * 0.9)] * 1000:.1f} ms")


if __name__ == "__main__":
    main()
