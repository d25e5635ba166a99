"""`prefixserve generate`: one prompt through the engine, with TTFT and decode speed."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid

from prefixserve.config import CacheConfig, EngineConfig, ModelConfig
from prefixserve.types import Namespace, Request, SamplingParams


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 100.0:  # SamplingParams' range (NaN fails it too)
        raise argparse.ArgumentTypeError(f"must be in [0, 100], not {text}")
    return value


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    """Checked here, so that a bad value is a usage error (exit 2) before the model loads (seconds),
    not a traceback after it: --max-tokens 0 would generate nothing to time."""
    parser.add_argument("prompt")
    parser.add_argument("--max-tokens", type=_at_least_one, default=128, metavar="N")
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded SmolLM2)")
    parser.add_argument("--system", default=None)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    parser.add_argument("--threads", type=_at_least_one, default=None, metavar="N")
    parser.add_argument("--temperature", type=_temperature, default=0.0, help="0 (greedy) to 100")
    parser.add_argument("--seed", type=int, default=None)


def run_generate(args: argparse.Namespace) -> int:
    from prefixserve.engine import build_engine
    from prefixserve.models.arch import (
        ModelLoadError,  # imports torch: not before `serve` listens (cli/__init__.py)
    )

    try:
        engine = build_engine(ModelConfig(path=args.model, dtype=args.dtype, num_threads=args.threads),
                              CacheConfig(), EngineConfig())
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    ids = engine.tokenizer.render_chat(messages)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    req = Request(uuid.uuid4().hex, Namespace(engine.model_id, "cli"), tuple(ids), sp)

    async def go() -> None:
        t0 = time.perf_counter()
        first = None
        usage = None
        async for d in engine.generate(req):
            if first is None and (d.token_ids or d.finish_reason is not None):  # an EOS first: no ids
                first = time.perf_counter()
            print(d.text, end="", flush=True)
            usage = d.usage or usage
        end = time.perf_counter()
        n = usage.completion_tokens if usage else 0
        first = end if first is None else first
        rate = (n - 1) / (end - first) if n > 1 and end > first else 0.0
        print(f"\n\n[{len(ids)} prompt tokens, {n} generated; TTFT {(first - t0) * 1000:.0f} ms; "
              f"decode {rate:.1f} tokens/s]", file=sys.stderr)
        await engine.shutdown()

    asyncio.run(go())
    return 0
