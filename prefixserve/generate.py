"""`prefixserve generate`: one prompt through the engine, with TTFT and decode speed."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid

from prefixserve.config import CacheConfig, EngineConfig, ModelConfig
from prefixserve.models.arch import ModelLoadError
from prefixserve.types import Namespace, Request, SamplingParams


def run_generate(args: argparse.Namespace) -> int:
    from prefixserve.engine import build_engine

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
            if first is None and d.token_ids:
                first = time.perf_counter()
            print(d.text, end="", flush=True)
            usage = d.usage or usage
        end = time.perf_counter()
        n = usage.completion_tokens if usage else 0
        assert first is not None
        rate = (n - 1) / (end - first) if n > 1 and end > first else 0.0
        print(f"\n\n[{len(ids)} prompt tokens, {n} generated; TTFT {(first - t0) * 1000:.0f} ms; "
              f"decode {rate:.1f} tokens/s]", file=sys.stderr)
        await engine.shutdown()

    asyncio.run(go())
    return 0
