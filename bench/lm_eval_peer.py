"""lm-eval's accuracy on prefixserve and on llama.cpp's llama-server, same GGUF, same local task.

    .venv/bin/python bench/lm_eval_peer.py [--peer-bin .peer/bin/llama-server]
        [--model GGUF] [--out bench/results/lm_eval_peer.md] [--work DIR]

Writes the 20-question task of tests/server/test_lm_eval_real.py (tests/helpers/lm_eval_task.py) in
two forms and runs `lm_eval run --model local-completions` against each server, offline:
- log-likelihood multiple choice (`acc`): prefixserve only. lm-eval scores each choice through
  /v1/completions with `echo` + `logprobs`, and llama-server refuses `echo` ("Only no echo is
  supported"), so it cannot run a log-likelihood task at all;
- generative (`exact_match` on the letter A-D the greedy reply starts with): both servers, the same
  string prompts (`tokenized_requests=False,tokenizer_backend=None`), so the two accuracies should
  agree up to the numerics of two runtimes on the same weights.

Prints a table (server, form, metric, accuracy, n) and writes it to `--out` when given. Each server
is started here on a free port and stopped (SIGTERM, then SIGKILL, to its process group) after its
runs. A benchmark, not a test: it asserts nothing about the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers.lm_eval_task: the task the test runs
sys.path.append(str(ROOT / "bench"))  # servers.py (appended, so bench/ shadows nothing)

from servers import ServerProcess, free_port

from tests.helpers.lm_eval_task import FACTS, GEN_TASK, MC_TASK, write_gen_task, write_mc_task

KEY = "sk-lm-eval-peer-0123456789"
PEER_BIN = ".peer/bin/llama-server"  # bench/peer.sh .peer


def embedded_gguf() -> str:
    from prefixserve.models.loaders.load import embedded_model_path

    return str(embedded_model_path())


def run_lm_eval(server: ServerProcess, task: str, model_args: str, tasks_dir: Path, out: Path) -> dict:
    """One `lm_eval run` of `task` against `server`; returns its results JSON."""
    hf = out / "hf"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(hf),
           "HF_DATASETS_CACHE": str(hf / "datasets"), "OPENAI_API_KEY": KEY, "TOKENIZERS_PARALLELISM": "false"}
    args = f"model={server.model_id()},base_url={server.base_url}/v1/completions,num_concurrent=1,{model_args}"
    cmd = [str(Path(sys.executable).with_name("lm_eval")), "run", "--model", "local-completions",
           "--model_args", args, "--tasks", task, "--include_path", str(tasks_dir),
           "--output_path", str(out / "results"), "--log_samples"]
    started = time.perf_counter()
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    (out / "lm_eval.log").write_text(run.stdout + "\n" + run.stderr)
    if run.returncode != 0:
        raise RuntimeError(f"lm_eval against {server.name} ({task}) exited {run.returncode}:\n"
                           f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
    [results_file] = (out / "results").rglob("results*.json")
    results = json.loads(results_file.read_text())
    results["_wall_s"] = time.perf_counter() - started
    samples = sorted((out / "results").rglob(f"samples_{task}*.jsonl"))
    docs = sorted((json.loads(line) for f in samples for line in f.open()), key=lambda d: d["doc_id"])
    results["_replies"] = [d["filtered_resps"] for d in docs]
    results["_raw"] = [d["resps"] for d in docs]  # the text each reply was, before the letter filter
    return results


def row(server: str, form: str, task: str, metric: str, results: dict) -> dict:
    return {"server": server, "form": form, "metric": metric.split(",")[0],
            "accuracy": results["results"][task][metric], "n": results["n-samples"][task]["effective"],
            "wall_s": results["_wall_s"], "replies": results["_replies"], "raw": results["_raw"]}


def table(rows: list[dict]) -> str:
    lines = ["| server | task form | metric | accuracy | n |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['server']} | {r['form']} | {r['metric']} | {r['accuracy']:.2f} | {r['n']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer-bin", default=PEER_BIN, help="llama.cpp's llama-server")
    parser.add_argument("--model", default=None, help="the GGUF both serve (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t")
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    parser.add_argument("--work", type=Path, default=None, help="task files, logs, lm-eval output (default: a temp dir)")
    args = parser.parse_args()
    gguf = args.model or embedded_gguf()
    work = args.work or Path(tempfile.mkdtemp(prefix="lm_eval_peer-"))
    tasks_dir = work / "tasks"
    tasks_dir.mkdir(parents=True, exist_ok=True)
    write_mc_task(tasks_dir)
    write_gen_task(tasks_dir)
    print(f"work dir {work}; model {gguf}", flush=True)

    ours_port, peer_port = free_port(), free_port()
    ours_cmd = [str(Path(sys.executable).with_name("prefixserve")), "serve", "--host", "127.0.0.1",
                "--port", str(ours_port), "--model", gguf, "--api-key", KEY, "--no-ledger",
                "--no-responses-persist", "--data-dir", str(work / "data")]
    peer_cmd = [args.peer_bin, "-m", gguf, "--host", "127.0.0.1", "--port", str(peer_port), "--api-key", KEY,
                "-c", "4096", "-t", str(args.threads)]
    remote = f"tokenizer_backend=remote,auth_token={KEY}"  # token-id prompts, the log-likelihood path
    plain = "tokenized_requests=False,tokenizer_backend=None"  # string prompts, what llama-server is sent too
    rows: list[dict] = []
    with ServerProcess("prefixserve", ours_cmd, ours_port, KEY, work / "prefixserve.log") as ours:
        print(f"prefixserve up (pid {ours.pid}, {ours.startup_s:.1f} s)", flush=True)
        res = run_lm_eval(ours, MC_TASK, remote, tasks_dir, work / "prefixserve-mc")
        rows.append(row("prefixserve", "log-likelihood MC", MC_TASK, "acc,none", res))
        res = run_lm_eval(ours, GEN_TASK, plain, tasks_dir, work / "prefixserve-gen")
        rows.append(row("prefixserve", "generative (letter)", GEN_TASK, "exact_match,letter", res))
    with ServerProcess("llama-server", peer_cmd, peer_port, KEY, work / "llama-server.log") as peer:
        print(f"llama-server up (pid {peer.pid}, {peer.startup_s:.1f} s)", flush=True)
        rows.append({"server": "llama-server", "form": "log-likelihood MC", "metric": "acc",
                     "accuracy": float("nan"), "n": 0, "wall_s": 0.0, "replies": [], "raw": []})
        res = run_lm_eval(peer, GEN_TASK, plain, tasks_dir, work / "llama-server-gen")
        rows.append(row("llama-server", "generative (letter)", GEN_TASK, "exact_match,letter", res))

    gen = [r["raw"] for r in rows if r["metric"] == "exact_match"]
    same = sum(a == b for a, b in zip(*gen, strict=True))
    text = table([r for r in rows if r["n"]]) + (
        f"\n\nllama-server, log-likelihood MC: not run (/v1/completions refuses `echo`). {len(FACTS)} questions;"
        f" model {Path(gguf).name}. Generative replies identical text on both servers: {same}/{len(gen[0])}.")
    print("\n" + text)
    for r in rows:
        if r["replies"] and r["metric"] == "exact_match":  # the letter each reply gave, question by question
            print(f"{r['server']} {r['form']}: {r['wall_s']:.0f} s; filtered replies "
                  f"{' '.join(str(x[0]) if isinstance(x, list) and x else str(x) for x in r['replies'])}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
