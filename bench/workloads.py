"""The workloads. Every workload is the same code for both servers.

Nonces are built from `BenchPlan.run_tag`, random per bench invocation, so no server (nor a
persistent cache) has seen a "cold" prompt before; within one invocation both servers get
byte-identical requests.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from client import BenchClient, StreamResult
from prompts import DECODE_PROMPT, PromptFactory, user_question

Tick = Callable[[int], None]
Messages = list[dict[str, str]]


@dataclass(frozen=True, slots=True)
class BenchPlan:
    """How much to run. `num_runs` is the sample count for each sequential workload."""

    run_tag: str
    num_runs: int = 7
    prompt_lens: tuple[int, ...] = (600, 2000)
    decode_max_tokens: tuple[int, ...] = (64, 256)
    concurrency_levels: tuple[int, ...] = (1, 4, 8, 16)
    concurrency_rounds: int = 5
    concurrency_prompt_len: int = 600
    concurrency_max_tokens: int = 64
    ttft_max_tokens: int = 4
    unrelated_prompt_len: int = 200
    contended_prompt_len: int = 600  # cold and warm TTFT again with a busy process on one core
    long_prompt_len: int = 8000  # a cold long prompt alone, then again while short requests arrive
    long_runs: int = 2
    short_clients: int = 3  # clients sending short cold requests, one after another, during the long prefill
    short_prompt_len: int = 100
    deep_decode_prompt_len: int = 4000  # single-stream decode again, after a long (cached) system prompt
    deep_decode_max_tokens: int = 128

    def __post_init__(self) -> None:
        if self.num_runs < 1 or self.concurrency_rounds < 1 or self.long_runs < 0:
            raise ValueError("num_runs and concurrency_rounds must be >= 1, long_runs >= 0")

    def num_requests(self) -> int:
        """Requests a full suite sends; drives the progress bar."""
        num_lens = len(self.prompt_lens)
        per_len = self.num_runs + (1 + 2 * self.num_runs) + (1 + self.num_runs) + (1 + 2 * self.num_runs)
        concurrency = 1 + self.concurrency_rounds * sum(self.concurrency_levels)
        contended = self.num_runs + (1 + 2 * self.num_runs)
        long = 2 * self.long_runs  # the short requests are not counted: how many fit is measured
        decode = (len(self.decode_max_tokens) + 1) * self.num_runs + 1
        return num_lens * per_len + decode + concurrency + contended + long


# ---------------------------------------------------------------- workloads


@dataclass(slots=True)
class SuiteResult:
    """Raw per-request records of one server, keyed by workload name."""

    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    rounds: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def add(self, key: str, result: StreamResult) -> None:
        self.records.setdefault(key, []).append(result.to_json())


# A step is a coroutine, or an async generator that yields after each measured request: serve_bench.py
# `interleave` then alternates the servers request by request, so a slow stretch of the machine (seconds
# long; a median of 7 warm requests read 8.9 ms in one run and 5.2 ms in an A/B minutes later) falls
# on both servers' samples alike, not on one server's whole workload.
Step = Callable[[BenchClient, SuiteResult, Tick], Awaitable[None] | AsyncIterator[None]]


async def drain(run: AsyncIterator[None]) -> None:
    """Run a per-request workload to its end on one server."""
    async for _ in run:
        pass


def suite_steps(plan: BenchPlan, prompts: PromptFactory) -> list[tuple[str, Step]]:
    """Every workload, in a fixed order, as (name, step): a step runs one workload against one server.
    serve_bench.py runs each step on one server and then the other before the next step (a per-request
    step request by request, `Step`), so a pair of numbers is never minutes of machine drift apart."""
    steps: list[tuple[str, Step]] = []
    for n in plan.prompt_lens:
        steps += [
            (f"cold TTFT {n}", lambda c, s, t, n=n: cold_ttft(c, plan, prompts, n, s, t)),
            (f"warm TTFT {n}", lambda c, s, t, n=n: warm_ttft(c, plan, prompts, n, s, t)),
            (f"partial TTFT {n}", lambda c, s, t, n=n: partial_ttft(c, plan, prompts, n, s, t, interleaved=False)),
            (f"partial TTFT {n}, interleaved",
             lambda c, s, t, n=n: partial_ttft(c, plan, prompts, n, s, t, interleaved=True)),
        ]
    steps += [(f"decode {m}", lambda c, s, t, m=m: decode(c, plan, m, s, t)) for m in plan.decode_max_tokens]
    steps += [("decode after a long prompt", lambda c, s, t: deep_decode(c, plan, prompts, s, t))]
    steps += [
        ("concurrency", lambda c, s, t: concurrency(c, plan, prompts, s, t)),
        ("contended", lambda c, s, t: contended(c, plan, prompts, s, t)),
        ("long prompt", lambda c, s, t: long_prompt(c, plan, prompts, s, t)),
    ]
    return steps


async def long_prompt(
    client: BenchClient, plan: BenchPlan, prompts: PromptFactory, suite: SuiteResult, tick: Tick
) -> None:
    """A cold `long_prompt_len`-token prompt alone (`cold_ttft_<len>`, to set beside the shorter
    cold prompts), then another while `short_clients` other clients each send short cold requests
    one after another until it answers: their TTFTs (`short_during_long`) say whether one long
    prompt holds up everybody else."""
    n = plan.long_prompt_len
    for run in range(plan.long_runs):
        system = prompts.system_prompt(n, f"{plan.run_tag}-long{n}-{run}")
        suite.add(f"cold_ttft_{n}", await client.chat(_messages(system, user_question(0)), plan.ttft_max_tokens))
        tick(1)
    for run in range(plan.long_runs):
        system = prompts.system_prompt(n, f"{plan.run_tag}-longbusy{n}-{run}")
        long = asyncio.create_task(client.chat(_messages(system, user_question(0)), plan.ttft_max_tokens))
        await asyncio.sleep(0.5)  # its prefill is under way

        async def shorts(c: int) -> None:
            k = 0
            while not long.done():
                other = prompts.system_prompt(
                    plan.short_prompt_len, f"{plan.run_tag}-short{run}-{c}-{k}", topic_seed="other"
                )
                suite.add("short_during_long", await client.chat(_messages(other, user_question(k)), plan.ttft_max_tokens))
                k += 1

        await asyncio.gather(*(shorts(c) for c in range(plan.short_clients)))
        suite.add(f"long_busy_ttft_{n}", await long)
        tick(1)


async def contended(
    client: BenchClient, plan: BenchPlan, prompts: PromptFactory, suite: SuiteResult, tick: Tick
) -> None:
    """Cold and warm TTFT while another process keeps one core busy (a plain Python loop): servers
    share machines. Recorded under `busy_` keys beside the quiet ones."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        await asyncio.sleep(0.5)
        inner = SuiteResult()
        tag = replace(plan, run_tag=f"{plan.run_tag}-busy")
        await drain(cold_ttft(client, tag, prompts, plan.contended_prompt_len, inner, tick))
        await drain(warm_ttft(client, tag, prompts, plan.contended_prompt_len, inner, tick))
        for key, records in inner.records.items():
            suite.records[f"busy_{key}"] = records
    finally:
        busy.kill()
        busy.wait()


async def cold_ttft(
    client: BenchClient,
    plan: BenchPlan,
    prompts: PromptFactory,
    prompt_len: int,
    suite: SuiteResult,
    tick: Tick,
) -> AsyncIterator[None]:
    """A system prompt this server has never seen: a fresh nonce at its start each run."""
    for run in range(plan.num_runs):
        system = prompts.system_prompt(prompt_len, f"{plan.run_tag}-cold{prompt_len}-{run}")
        result = await client.chat(_messages(system, user_question(0)), plan.ttft_max_tokens)
        suite.add(f"cold_ttft_{prompt_len}", result)
        tick(1)
        yield


async def warm_ttft(
    client: BenchClient,
    plan: BenchPlan,
    prompts: PromptFactory,
    prompt_len: int,
    suite: SuiteResult,
    tick: Tick,
) -> AsyncIterator[None]:
    """The identical request repeated; the first (seeding) request is not measured. Each measured
    request follows an unmeasured repeat on the same server, so it meets a process as hot as in a run
    of repeats even though the servers alternate request by request: right after the other server's
    request (its caches and pages cold) ours read 5.5 ms, after its own repeat 4.1 ms, on the AMX Xeon
    (bench/warm_gap.py)."""
    messages = _messages(
        prompts.system_prompt(prompt_len, f"{plan.run_tag}-warm{prompt_len}"), user_question(0)
    )
    suite.add(f"seed_warm_{prompt_len}", await client.chat(messages, plan.ttft_max_tokens))
    tick(1)
    for _ in range(plan.num_runs):
        await client.chat(messages, plan.ttft_max_tokens)
        suite.add(f"warm_ttft_{prompt_len}", await client.chat(messages, plan.ttft_max_tokens))
        tick(2)
        yield


async def partial_ttft(
    client: BenchClient,
    plan: BenchPlan,
    prompts: PromptFactory,
    prompt_len: int,
    suite: SuiteResult,
    tick: Tick,
    interleaved: bool,
) -> AsyncIterator[None]:
    """A seen system prompt with a new user message, back to back or after an unrelated request."""
    variant = "interleaved" if interleaved else "b2b"
    system = prompts.system_prompt(prompt_len, f"{plan.run_tag}-part-{variant}{prompt_len}")
    suite.add(
        f"seed_partial_{variant}_{prompt_len}", await client.chat(_messages(system, user_question(99)), 4)
    )
    tick(1)
    for run in range(plan.num_runs):
        if interleaved:
            other = prompts.system_prompt(
                plan.unrelated_prompt_len, f"{plan.run_tag}-unrelated{prompt_len}-{run}", topic_seed="other"
            )
            suite.add(
                f"unrelated_{prompt_len}", await client.chat(_messages(other, user_question(run + 3)), 4)
            )
            tick(1)
        question = user_question(run + 1, salt=f"{variant}-")
        result = await client.chat(_messages(system, question), plan.ttft_max_tokens)
        suite.add(f"partial_{variant}_ttft_{prompt_len}", result)
        tick(1)
        yield


async def decode(
    client: BenchClient, plan: BenchPlan, max_tokens: int, suite: SuiteResult, tick: Tick
) -> AsyncIterator[None]:
    """Single-stream decode speed on a prompt that asks for a long answer."""
    messages = [{"role": "user", "content": DECODE_PROMPT}]
    for _ in range(plan.num_runs):
        suite.add(f"decode_{max_tokens}", await client.chat(messages, max_tokens))
        tick(1)
        yield


async def deep_decode(
    client: BenchClient, plan: BenchPlan, prompts: PromptFactory, suite: SuiteResult, tick: Tick
) -> AsyncIterator[None]:
    """Single-stream decode with `deep_decode_prompt_len` tokens of context before the answer: every
    token attends to all of them (the request repeats, so its prompt is cached after the first)."""
    n = plan.deep_decode_prompt_len
    system = prompts.system_prompt(n, f"{plan.run_tag}-deep{n}")
    suite.add(f"seed_decode_deep_{n}", await client.chat(_messages(system, DECODE_PROMPT), 4))
    tick(1)
    for _ in range(plan.num_runs):
        suite.add(f"decode_deep_{n}", await client.chat(_messages(system, DECODE_PROMPT), plan.deep_decode_max_tokens))
        tick(1)
        yield


async def concurrency(
    client: BenchClient, plan: BenchPlan, prompts: PromptFactory, suite: SuiteResult, tick: Tick
) -> None:
    """C clients at once, sharing one (already seen) system prompt, each with its own question."""
    system = prompts.system_prompt(plan.concurrency_prompt_len, f"{plan.run_tag}-shared")
    suite.add("seed_concurrency", await client.chat(_messages(system, user_question(0)), 4))
    tick(1)

    async def one(question: str) -> StreamResult:
        result = await client.chat(_messages(system, question), plan.concurrency_max_tokens)
        tick(1)
        return result

    for num_clients in plan.concurrency_levels:
        key = f"concurrency_{num_clients}"
        for round_index in range(plan.concurrency_rounds):
            questions = [user_question(k, salt=f"c{num_clients}r{round_index}-") for k in range(num_clients)]
            start = time.perf_counter()
            results = await asyncio.gather(*(one(q) for q in questions))
            wall_s = time.perf_counter() - start
            num_tokens = sum(r.num_completion_tokens for r in results)
            suite.rounds.setdefault(key, []).append(
                {"wall_s": wall_s, "num_tokens": num_tokens, "tokens_per_s": num_tokens / wall_s}
            )
            for result in results:
                suite.add(key, result)


def _messages(system: str, user: str) -> Messages:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]
