"""Cold and warm TTFT of one server, quiet and then with one core busy with another process.

    .venv/bin/python bench/contention.py ours 18961 .venv/bin/prefixserve serve --port 18961 --no-ledger
    .venv/bin/python bench/contention.py peer 18962 .peer/bin/llama-server -m MODEL.gguf --port 18962 \\
        -c 32768 -np 8 --kv-unified --cache-ram 2048 -t 2 -tb 2

Starts the command (it must listen on PORT, no API key), sends 5 fresh 600-token id prompts
(/v1/completions, streaming, 2 tokens) each followed by 3 identical repeats (warm: the fastest of
the three), then the same while `python -c "while True: pass"` runs; prints the medians and the
busy/quiet ratios (docs/architecture.md, "Threads"). `make bench` measures the same with chat
prompts for both servers.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time

import httpx

NUM_PROMPTS = 5
PROMPT_IDS = 600


def main(label: str, port: int, cmd: list[str]) -> None:
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.perf_counter() - t0 > 300:
                raise SystemExit(f"{label}: the server did not start")
            time.sleep(0.2)
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        print(f"{label}: ready in {time.perf_counter() - t0:.1f} s", flush=True)
        rng = random.Random(0)

        def ttft(ids: list[int]) -> float:
            body = {"model": model, "prompt": ids, "max_tokens": 2, "stream": True, "temperature": 0}
            start = time.perf_counter()
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=900) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        choices = json.loads(line[6:]).get("choices") or []
                        if choices and choices[0].get("text"):
                            break
            return time.perf_counter() - start

        def measure(tag: str) -> tuple[float, float]:
            cold, warm = [], []
            for _ in range(NUM_PROMPTS):
                ids = [rng.randrange(1000, 40000) for _ in range(PROMPT_IDS)]
                cold.append(ttft(ids))
                warm.append(min(ttft(ids) for _ in range(3)))
            c, w = statistics.median(cold), statistics.median(warm)
            print(f"{label} {tag}: cold {c * 1e3:.0f} ms, warm {w * 1e3:.1f} ms", flush=True)
            return c, w

        ttft([rng.randrange(1000, 40000) for _ in range(PROMPT_IDS)])  # first-request overheads
        quiet = measure("quiet")
        busy_proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.5)
            busy = measure("busy ")
        finally:
            busy_proc.kill()
        print(f"{label} busy/quiet: cold {busy[0] / quiet[0]:.2f}x, warm {busy[1] / quiet[1]:.2f}x")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
