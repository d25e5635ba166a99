"""The peer: llama.cpp's own C++ `llama-server` (bench/peer.sh builds it), its command line and thread tuning."""

from __future__ import annotations

import asyncio
import shlex
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from client import BenchClient
from prompts import DECODE_PROMPT, PromptFactory
from servers import ServerProcess, free_port
from tqdm import tqdm

# The machine class has 2 cores: -t (decode threads) and -tb (prompt threads) are measured, not guessed.
THREAD_GRID = ((1, 1), (1, 2), (2, 1), (2, 2))
# What users run: parallel slots with continuous batching in one unified KV of 32k tokens, and the RAM
# prompt cache (its budget in MiB), the setting issue #12 measured against.
SERVER_ARGS = ("-c", "32768", "-np", "8", "--kv-unified", "--cache-ram", "2048")

MakeCmd = Callable[[int, int, int], list[str]]  # (port, n_threads, n_threads_batch) -> argv


def peer_cmd(peer_bin: str, gguf: str, api_key: str, extra_args: str = "") -> MakeCmd:
    """A command factory for the peer on `gguf`; `extra_args` are appended (shell-split)."""

    def make(port: int, n_threads: int, n_threads_batch: int) -> list[str]:
        return [
            peer_bin, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--api-key", api_key,
            *SERVER_ARGS, "-t", str(n_threads), "-tb", str(n_threads_batch), *shlex.split(extra_args),
        ]  # fmt: skip

    return make


def tune_threads(
    make_cmd: MakeCmd, api_key: str, prompts: PromptFactory, run_tag: str, num_runs: int, log_dir: Path
) -> dict[str, Any]:
    """Measure cold 600-token TTFT and 64-token decode speed for each (n_threads, n_threads_batch).

    Returns the grid and `chosen`: n_threads by decode tok/s, n_threads_batch by cold TTFT, each
    judged over both values of the other knob (decode hardly uses the batch threads, nor prefill
    the decode threads, and pooling halves the noise).
    """
    grid: list[dict[str, Any]] = []
    for n_threads, n_threads_batch in tqdm(THREAD_GRID, desc="peer threads", unit="cfg"):
        port = free_port()
        log_path = log_dir / f"peer_tune_{n_threads}_{n_threads_batch}.log"
        with ServerProcess(
            "peer", make_cmd(port, n_threads, n_threads_batch), port, api_key, log_path
        ) as server:
            client = BenchClient(server.base_url, api_key, server.model_id())
            tag = f"{run_tag}-tune-{n_threads}{n_threads_batch}"
            ttfts, speeds = asyncio.run(_measure(client, prompts, num_runs, tag))
        grid.append(
            {
                "n_threads": n_threads,
                "n_threads_batch": n_threads_batch,
                "cold_ttft_600_ms": statistics.median(ttfts) * 1000,
                "decode_64_tok_s": statistics.median(speeds),
            }
        )
    values = sorted({n for n, _ in THREAD_GRID})

    def pooled(metric: str, knob: str, value: int) -> float:
        return statistics.mean(g[metric] for g in grid if g[knob] == value)

    chosen = (
        max(values, key=lambda n: pooled("decode_64_tok_s", "n_threads", n)),
        min(values, key=lambda n: pooled("cold_ttft_600_ms", "n_threads_batch", n)),
    )
    return {"grid": grid, "chosen": chosen, "num_runs": num_runs}


async def _measure(
    client: BenchClient, prompts: PromptFactory, num_runs: int, tag: str
) -> tuple[list[float], list[float]]:
    try:
        await client.chat([{"role": "user", "content": "Hello"}], 4)  # first-request overheads
        ttfts: list[float] = []
        speeds: list[float] = []
        for run in range(num_runs):
            system = prompts.system_prompt(600, f"{tag}-{run}")
            messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
            ttfts.append((await client.chat(messages, 4)).ttft_s)
        for _ in range(num_runs):
            result = await client.chat([{"role": "user", "content": DECODE_PROMPT}], 64)
            speeds.append(result.decode_tokens_per_s() or 0.0)
        return ttfts, speeds
    finally:
        await client.aclose()
