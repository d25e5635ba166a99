"""Two versions of prefixserve on `make bench`'s own workloads, interleaved: the check behind the
"old -> new" figures in docs/ and commit messages.

    .venv/bin/python bench/ab.py --rev REV [--rounds 6] [--steps "warm TTFT 600,warm TTFT 2000"]

Checks out REV (a commit) into a temporary git worktree and starts it (`python -m prefixserve.server
--no-ledger`, PYTHONPATH at the worktree) beside the working tree's server, both on this venv; then
runs each named `make bench` workload (bench/workloads.py `suite_steps`, by name) on one and then
the other, alternating which goes first, for `--rounds` rounds with fresh prompts each round, and
prints each one's median and p90 TTFT per record. Like `make bench`, only numbers measured in the
same run are compared.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prompts import PromptFactory, load_token_counter
from serve_bench import API_KEY, default_gguf, interleave
from servers import ServerProcess, free_port
from workloads import BenchPlan, SuiteResult, suite_steps

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", required=True, help="the old version: a commit of this repository")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", default="warm TTFT 600,warm TTFT 2000", help="make bench workload names, comma-separated")
    args = parser.parse_args()
    prompts = PromptFactory(load_token_counter(default_gguf())[0])
    known = [name for name, _ in suite_steps(BenchPlan(run_tag="names"), prompts)]
    wanted = [w.strip() for w in args.steps.split(",")]
    if unknown := [w for w in wanted if w not in known]:
        parser.error(f"unknown workloads {unknown}; known: {known}")
    tmp = Path(tempfile.mkdtemp(prefix="ab-"))
    tree = tmp / "old"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.rev], check=True)
    try:
        steps = []
        for _ in range(args.rounds):  # fresh nonces each round: every cold prompt is cold
            by_name = dict(suite_steps(BenchPlan(run_tag=secrets.token_hex(4)), prompts))
            steps += [(name, by_name[name]) for name in wanted]
        servers, suites = {}, {"old": SuiteResult(), "new": SuiteResult()}
        for name, path in (("old", tree), ("new", ROOT)):
            port = free_port()
            # a data directory each: two servers may not share one (its stored-responses file)
            cmd = [sys.executable, "-m", "prefixserve.server", "--no-ledger", "--host", "127.0.0.1",
                   "--port", str(port), "--api-key", API_KEY, "--data-dir", str(tmp / f"{name}-data")]
            # run in the tree itself: `python -m` puts its working directory first on sys.path, so from
            # the repository root both servers were the working tree's (every A/B before 2026-12-04)
            env = {"PYTHONPATH": str(path)}
            where = subprocess.run([sys.executable, "-c", "import prefixserve; print(prefixserve.__file__)"], cwd=path,
                                   env={**os.environ, **env}, capture_output=True, text=True, check=True).stdout.strip()
            if not Path(where).resolve().is_relative_to(Path(path).resolve()):
                raise SystemExit(f"the {name} server would import prefixserve from {where}, not from {path}")
            servers[name] = ServerProcess(name, cmd, port, API_KEY, tmp / f"{name}.log", env=env, cwd=Path(path))
        with servers["old"], servers["new"]:
            asyncio.run(interleave(servers, {n: s.model_id() for n, s in servers.items()}, steps, suites, lambda n: None))
        for name, suite in suites.items():
            for key, records in suite.records.items():
                if key.startswith(("seed_", "unrelated_")):
                    continue
                ms = sorted(r["ttft_s"] * 1e3 for r in records)
                print(f"{name} {key}: TTFT median {statistics.median(ms):.2f} ms, p90 {ms[int(0.9 * len(ms))]:.2f} ms "
                      f"({len(ms)} requests)")
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
