"""Warm TTFT with the usage ledger on vs off (the same prompt repeated, max_tokens 1), each server alone.

Run: .venv/bin/python bench/ledger_overhead.py   (on then off then on again, so drift shows)."""
import statistics, sys, time, json
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
import httpx
from tests.helpers.server_proc import ServerProcess

SYSTEM = "You are a support assistant. " + " ".join(f"Rule {i}: be precise about topic {i}." for i in range(60))

def ttft(base, key):
    body = {"model": "SmolLM2-135M-Instruct", "stream": True, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]}
    t0 = time.perf_counter()
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line and '"content":""' not in line:
                return time.perf_counter() - t0
    return time.perf_counter() - t0

res = {}
for label, extra in (("ledger on", []), ("ledger off", ["--no-ledger"]), ("ledger on (again)", [])):
    with ServerProcess(["--api-key", "k1", *extra]) as srv:
        for _ in range(3): ttft(srv.base_url, "k1")
        xs = [ttft(srv.base_url, "k1") * 1000 for _ in range(40)]
    res[label] = xs
    print(f"{label}: median {statistics.median(xs):.1f} ms, p90 {sorted(xs)[int(0.9*len(xs))]:.1f} ms", flush=True)
