"""Single-stream decode of both servers, interleaved: the check behind docs/benchmarks.md's decode row.

    .venv/bin/python bench/decode_ab.py [--rounds 8] [--max-tokens 256]

Starts ours (`prefixserve serve --no-ledger`) and the peer (`.peer/bin/llama-server` with
`make bench`'s flags, `-t 2 -tb 2`) side by side, idle while the other answers, then sends the same
greedy streaming chat request (bench/client.py, `make bench`'s decode prompt) to one and then the
other, alternating which goes first, and prints each one's decode tokens/s (after the first token)
and the ratio of the medians. On a VM whose speed drifts by tens of percent within minutes, a
one-server-then-the-other run can disagree with itself; alternating puts both under the same drift.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from client import BenchClient
from peer import peer_cmd
from prompts import DECODE_PROMPT
from serve_bench import API_KEY, default_gguf, interleave
from servers import ServerProcess, free_port
from workloads import BenchPlan, SuiteResult, Tick, decode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--ours-cmd", default=".venv/bin/prefixserve serve --no-ledger")
    parser.add_argument("--peer-bin", default=".peer/bin/llama-server")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="decode-ab-"))
    ours_port, peer_port = free_port(), free_port()
    ours_cmd = [*args.ours_cmd.split(), "--host", "127.0.0.1", "--port", str(ours_port), "--api-key", API_KEY]
    peer = peer_cmd(args.peer_bin, default_gguf(), API_KEY)(peer_port, 2, 2)
    plan = BenchPlan(run_tag="decode-ab", num_runs=1)

    async def first(client: BenchClient, suite: SuiteResult, tick: Tick) -> None:  # nothing of a cold start is timed
        await client.chat([{"role": "user", "content": DECODE_PROMPT}], 16)

    steps = [("first request", first)] + [
        ("decode", lambda c, s, t: decode(c, plan, args.max_tokens, s, t))] * args.rounds
    suites = {"ours": SuiteResult(), "peer": SuiteResult()}
    with ServerProcess("ours", ours_cmd, ours_port, API_KEY, logs / "ours.log") as a, \
            ServerProcess("peer", peer, peer_port, API_KEY, logs / "peer.log") as b:
        servers = {"ours": a, "peer": b}
        asyncio.run(interleave(servers, {n: s.model_id() for n, s in servers.items()}, steps, suites, lambda n: None))
    speeds = {name: [v for r in suite.records[f"decode_{args.max_tokens}"] if (v := r["decode_tokens_per_s"]) is not None]
              for name, suite in suites.items()}
    for name, values in speeds.items():
        print(f"{name}: median {statistics.median(values):.1f} tok/s ({', '.join(f'{v:.0f}' for v in values)})")
    print(f"ours/peer: {statistics.median(speeds['ours']) / statistics.median(speeds['peer']):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
