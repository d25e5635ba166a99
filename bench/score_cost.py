"""What scoring a prompt costs (completions' echo + logprobs + max_tokens 0) against a plain cold
request for the same prompt: the "Cost" figures for scoring in docs/api.md.

    .venv/bin/python bench/score_cost.py [--url http://127.0.0.1:8000] [--key KEY] [--repeats 3]

Against a running server (`prefixserve serve --no-ledger`). For 600- and 2,000-token prompts of random
token ids (new ones each repeat, so every request is cold), prints the wall time of a plain request
(max_tokens 1) and of the same prompt scored with logprobs 1 and 5.
"""

from __future__ import annotations

import argparse
import random
import time

import httpx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--key", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=600) as client:

        def timed(body: dict) -> float:
            t = time.perf_counter()
            client.post("/v1/completions", json=body).raise_for_status()
            return time.perf_counter() - t

        for n in (600, 2000):
            for rep in range(args.repeats):
                rng = random.Random(rep * 7 + n)
                prompt = [rng.randrange(100, 40000) for _ in range(n)]
                plain = timed({"prompt": prompt, "max_tokens": 1})
                scored = [timed({"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": k}) for k in (1, 5)]
                print(f"{n} tokens: cold plain {plain:.2f} s, scored (logprobs 1) {scored[0]:.2f} s, "
                      f"(logprobs 5) {scored[1]:.2f} s")


if __name__ == "__main__":
    main()
