"""Our warm TTFT (the identical 600-token chat again) right after a request to llama-server, after such
a request and a pause, and right after our own repeat: why `make bench` measures each warm request after
an unmeasured repeat on the same server (bench/workloads.py `warm_ttft`). Needs `make bench`'s peer
(.peer/bin/llama-server). Run from the repository root: .venv/bin/python bench/warm_gap.py [--rounds N]"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from client import BenchClient
from peer import peer_cmd
from prompts import PromptFactory, load_token_counter, user_question
from serve_bench import API_KEY, default_gguf
from servers import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]


async def measure(ours: ServerProcess, peer: ServerProcess, prompts: PromptFactory, rounds: int) -> dict[str, list[float]]:
    co = BenchClient(ours.base_url, API_KEY, ours.model_id())
    cp = BenchClient(peer.base_url, API_KEY, peer.model_id())
    messages = [{"role": "system", "content": prompts.system_prompt(600, "warm-gap")},
                {"role": "user", "content": user_question(0)}]
    await co.chat(messages, 4)
    await cp.chat(messages, 4)
    ms: dict[str, list[float]] = {}
    for _ in range(rounds):
        for case, pause in (("after a peer request", 0.0), ("after a peer request and 200 ms", 0.2),
                            ("after our own repeat", None)):
            for _ in range(10):
                if pause is None:
                    await co.chat(messages, 4)
                else:
                    await cp.chat(messages, 4)
                    await asyncio.sleep(pause)
                ms.setdefault(case, []).append((await co.chat(messages, 4)).ttft_s * 1e3)
    await co.aclose()
    await cp.aclose()
    return ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of 10 requests per case")
    args = parser.parse_args()
    gguf = default_gguf()
    prompts = PromptFactory(load_token_counter(gguf)[0])
    tmp = Path(tempfile.mkdtemp(prefix="warm-gap-"))
    po, pp = free_port(), free_port()
    ours = ServerProcess("ours", [str(ROOT / ".venv/bin/prefixserve"), "serve", "--no-ledger", "--host", "127.0.0.1",
                                  "--port", str(po), "--api-key", API_KEY], po, API_KEY, tmp / "ours.log")
    peer = ServerProcess("peer", peer_cmd(str(ROOT / ".peer/bin/llama-server"), gguf, API_KEY)(pp, 2, 2), pp, API_KEY,
                         tmp / "peer.log")
    with ours, peer:
        ms = asyncio.run(measure(ours, peer, prompts, args.rounds))
    for case, values in ms.items():
        values.sort()
        print(f"ours' warm TTFT {case}: median {statistics.median(values):.2f} ms, "
              f"p90 {values[int(0.9 * len(values))]:.2f} ms ({len(values)} requests)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
