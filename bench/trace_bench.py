"""The trace benchmark: a Mooncake production trace replayed over HTTP against prefixserve and
llama.cpp's llama-server at one cache byte budget, beside the offline bounds, and an exactness check.

    .venv/bin/python bench/trace_bench.py bench/data/conversation_trace.jsonl --out bench/results/raw/trace

For each budget (`--fractions` of the trace's working set at the replay's scale, in KV bytes), each
server is started alone, the sampled trace is replayed against it at its arrival times / `--speedup`
(bench/trace_replay.py: streamed completions, one API key per tenant), and it is stopped:

- ours: `--ours-cmd` with `--cache-max-bytes BUDGET --cache-eviction POLICY` for each of `--policies`;
- the peer: `--peer-bin` (bench/peer.sh builds it) on the same GGUF with `--cache-ram BUDGET/MiB`
  (its RAM prompt cache; its slots' KV, `-c` tokens, is working memory beside it, as ours'
  `--max-session-bytes` is) and `--peer-args`. It has no tenants: every key sees one cache.

Then (`--exact N`) two of ours, one at the first budget and one with `--cache-max-bytes 0`, get the
first N requests of the sample's multi-turn conversations one at a time, greedy, `--max-output`
tokens (`trace_replay.compare`): every completion must be equal. Figures go to OUT/trace.json, the
servers' logs beside it; the offline bounds at the same budgets are computed first (seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shlex
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from readme import cpu_name
from serve_bench import raise_interrupt, default_gguf
from servers import ServerProcess, free_port
from trace_model import (
    SMOLLM2_KV_BYTES_PER_TOKEN,
    SMOLLM2_LOGITS_BYTES,
    Scale,
    TraceRequest,
    api_keys_file_text,
    multi_turn_requests,
    parse_trace,
    sample_conversations,
    scaled_blocks,
    tenant_key,
    tenant_of,
)
from trace_replay import compare, offline, print_offline, print_replay, replay
from trace_sim import working_set_tokens

PEER_ARGS = "-c 32768 -np 8 --kv-unified -t 2 -tb 2"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, nargs="?", default=Path("bench/data/conversation_trace.jsonl"))
    p.add_argument("--out", type=Path, default=Path("bench/results/raw/trace"))
    p.add_argument("--sample", type=int, default=64, help="keep 1 in K conversations (default 64)")
    p.add_argument("--part", type=int, default=0, help="which of the K parts (default 0)")
    p.add_argument("--limit", type=int, default=None, help="only the first N sampled requests")
    p.add_argument("--block-tokens", type=int, default=8, help="tokens per 512-token trace block (default 8)")
    p.add_argument("--max-output", type=int, default=16, help="output length cap (default 16)")
    p.add_argument("--tenants", type=int, default=4, help="API keys the conversations are spread over (default 4)")
    p.add_argument("--speedup", type=float, default=20.0, help="arrival times this many times faster (default 20)")
    p.add_argument("--fractions", default="0.25", help="budgets, fractions of the working set (default 0.25)")
    p.add_argument("--servers", default="ours,peer", help="comma-separated: ours, peer (default ours,peer)")
    p.add_argument("--policies", default="lru", help="ours' --cache-eviction values to run (default lru)")
    p.add_argument("--ours-cmd", default=".venv/bin/prefixserve serve --no-ledger")
    p.add_argument("--peer-bin", default=".peer/bin/llama-server")
    p.add_argument("--peer-args", default=PEER_ARGS, help=f"default {PEER_ARGS!r}")
    p.add_argument("--model", default=None, help="the GGUF both serve (default: the embedded SmolLM2-135M)")
    p.add_argument("--exact", type=int, default=40, help="requests of the exactness check (0: none; default 40)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, raise_interrupt)  # so the servers are stopped on `kill` too

    scale = Scale(block_tokens=args.block_tokens, max_output=args.max_output)
    with args.trace.open() as f:
        requests = sample_conversations(parse_trace(f), args.sample, 1, args.part)[: args.limit]
    units = [scaled_blocks(r, scale, tenant_of(r, args.tenants)) for r in requests]
    ws_bytes = working_set_tokens(units) * SMOLLM2_KV_BYTES_PER_TOKEN
    fractions = [float(x) for x in args.fractions.split(",") if x.strip()]
    budgets = [int(f * ws_bytes) for f in fractions]
    gguf = args.model or default_gguf()
    args.out.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu_name(),
        "command": shlex.join(["python", "bench/trace_bench.py", *(argv if argv is not None else sys.argv[1:])]),
        "trace": str(args.trace),
        "sample": args.sample,
        "part": args.part,
        "num_requests": len(requests),
        "scale": asdict(scale),
        "tenants": args.tenants,
        "speedup": args.speedup,
        "runs": [],
    }
    print(f"{args.trace}: conversations of part {args.part} of {args.sample}, {len(requests)} requests; "
          f"scale: {scale.describe()}")
    report = offline(requests, scale, args.tenants, 1, fractions, [], SMOLLM2_KV_BYTES_PER_TOKEN,
                     SMOLLM2_LOGITS_BYTES, ("lru", "gdsf"), True)
    print_offline(report)
    out["offline"] = asdict(report)
    keys_file = args.out / "keys.txt"
    keys_file.write_text(api_keys_file_text(args.tenants))
    keys_file.chmod(0o600)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    for fraction, budget in zip(fractions, budgets, strict=True):
        for name in servers:
            for policy in args.policies.split(",") if name == "ours" else ["-"]:
                out["runs"].append(_measure(args, name, policy, fraction, budget, gguf, requests, scale))
                _dump(args.out / "trace.json", out)
    if args.exact:
        sample = multi_turn_requests(requests, args.exact)
        print(f"\n[exact] {len(sample)} requests of multi-turn conversations, cache at {budgets[0]:,} B vs 0")
        result = _exact(args, sample, scale, budgets[0])
        print(f"{result['equal']} of {result['requests']} completions equal "
              f"(cached tokens on the caching server: {result['cached_tokens']:,})")
        for m in result["mismatches"]:
            print(f"  request {m['request']}: {m['ours']!r} != {m['other']!r}")
        out["exact"] = result
        _dump(args.out / "trace.json", out)
        if result["equal"] != result["requests"]:
            return 1
    return 0


# ---------------------------------------------------------------- servers


def _measure(
    args: argparse.Namespace, name: str, policy: str, fraction: float, budget: int, gguf: str,
    requests: Sequence[TraceRequest], scale: Scale,
) -> dict[str, Any]:
    """One server ("ours" with `policy`, or "peer") started at `budget`, the replay, the server stopped."""
    label = f"{name}-{policy}-{fraction:g}" if name == "ours" else f"{name}-{fraction:g}"
    keys_file = args.out / "keys.txt"
    if name == "ours":
        cmd = _ours_cmd(args.ours_cmd, keys_file, budget, policy, args.out / f"data-{label}")
    else:
        cmd = _peer_cmd(args.peer_bin, gguf, args.tenants, budget, args.peer_args)
    print(f"\n[{label}] budget {budget / (1 << 20):,.0f} MiB ({fraction:.0%} of the working set)")
    load_before = os.getloadavg()[0]
    result = _replay_on(label, cmd, args, requests, scale)
    print_replay(result)
    load = (load_before, os.getloadavg()[0])
    print(f"load average (1 min) {load[0]:.1f} before, {load[1]:.1f} after")
    return {"server": name, "policy": policy, "fraction": fraction, "budget_bytes": budget,
            "command": shlex.join(cmd(0)), "load_average": load, **result}


Command = Callable[[int], list[str]]  # port -> argv


def _ours_cmd(base: str, keys_file: Path, budget: int, policy: str, data_dir: Path) -> Command:
    """`base` at `budget` with `policy`, its own data directory (responses store: nothing shared)."""

    def make(port: int) -> list[str]:
        return [*shlex.split(base), "--host", "127.0.0.1", "--port", str(port), "--api-keys-file", str(keys_file),
                "--cache-max-bytes", str(budget), "--cache-eviction", policy, "--data-dir", str(data_dir)]

    return make


def _peer_cmd(peer_bin: str, gguf: str, num_tenants: int, budget: int, extra: str) -> Command:
    keys = ",".join(tenant_key(t)[1] for t in range(num_tenants))

    def make(port: int) -> list[str]:
        return [peer_bin, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--api-key", keys,
                "--cache-ram", str(max(1, budget >> 20)), *shlex.split(extra)]

    return make


def _replay_on(
    label: str, make_cmd: Command, args: argparse.Namespace, requests: Sequence[TraceRequest], scale: Scale
) -> dict[str, Any]:
    port = free_port()
    with ServerProcess(label, make_cmd(port), port, tenant_key(0)[1], args.out / f"{label}.log") as server:
        return asyncio.run(replay(requests, scale, f"{server.base_url}/v1", None, args.tenants, 1, args.speedup,
                                  0, 600.0))


def _exact(args: argparse.Namespace, sample: Sequence[TraceRequest], scale: Scale, budget: int) -> dict[str, Any]:
    keys_file = args.out / "keys.txt"
    on = _ours_cmd(args.ours_cmd, keys_file, budget, "lru", args.out / "data-exact-on")
    off = _ours_cmd(args.ours_cmd, keys_file, 0, "lru", args.out / "data-exact-off")
    port_on, port_off = free_port(), free_port()
    key = tenant_key(0)[1]
    with (
        ServerProcess("exact-on", on(port_on), port_on, key, args.out / "exact-on.log") as a,
        ServerProcess("exact-off", off(port_off), port_off, key, args.out / "exact-off.log") as b,
    ):
        return compare(sample, scale, f"{a.base_url}/v1", f"{b.base_url}/v1", None, args.tenants, 1, scale.max_output)




def _dump(path: Path, out: dict[str, Any]) -> None:
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
