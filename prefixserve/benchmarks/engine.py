"""Engine speed beside the `transformers` model on the same (dequantised) weights, in one run."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, cast

import torch

from prefixserve.engine import default_num_threads
from prefixserve.models import load_model
from prefixserve.models.kernels import native
from prefixserve.models.kernels.threads import KERNEL_THREADS, usable_cores
from prefixserve.models.loaders.load import embedded_model_path
from prefixserve.runner import ModelRunner, SessionState, StepItem
from prefixserve.runner.selftest import self_test

PREFILL_CHUNK = 256  # the engine's default prefill chunk


def bench_engine(quick: bool = False, num_threads: int | None = None, print_fn: Callable[[str], object] = print) -> None:
    torch.set_num_threads(num_threads or default_num_threads())  # as the server: engine.default_num_threads
    KERNEL_THREADS.configure(usable_cores())  # and its --decode-threads default
    reps = 2 if quick else 3
    rows = []
    tile_notes: list[str] = []
    roofline: list[str] = []
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        ours = _ours(dtype, reps, quick, tile_notes, roofline)
        ref = _transformers(dtype, reps, quick)
        for key, label, better in (("prefill512", "prefill 512 tok (tok/s)", "higher"),
                                   ("prefill2048", "prefill 2048 tok (tok/s)", "higher"),
                                   ("decode1", "decode 1 session (ms/token)", "lower"),
                                   ("decode8", "decode 8 sessions (ms/step)", "lower")):
            o, r = ours[key], ref[key]
            ratio = o / r if better == "higher" else r / o  # > 1 means we are faster
            rows.append((dtype_name, label, o, r, ratio))
        print_fn(f"[{dtype_name}] done", )
    print_fn(f"\nCPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
             f"model {embedded_model_path()}")
    for line in tile_notes:
        print_fn(line)
    print_fn("The cost of exactness is the gap to the plain path: `transformers` runs the same weights with")
    print_fn("plain PyTorch ops (one matmul per layer for the whole prompt, SDPA attention), which are not")
    print_fn("batch- or split-invariant. speed-up > 1: the exact runtime is faster; < 1: what exactness costs.")
    print_fn("| dtype | measure | prefixserve (exact) | transformers (plain) | speed-up |")
    print_fn("|---|---|---:|---:|---:|")
    for dtype_name, label, o, r, ratio in rows:
        print_fn(f"| {dtype_name} | {label} | {o:,.1f} | {r:,.1f} | {ratio:.2f}x |")
    for dtype_name, label, o, _, _ in rows:
        if label.startswith("decode 1"):
            print_fn(f"{dtype_name} single-session decode: {1000 / o:.1f} tokens/s")
    bandwidth = memory_bandwidth(KERNEL_THREADS.threads)
    print_fn(f"\nRoofline: memory read bandwidth {bandwidth / 1e9:.1f} GB/s ({KERNEL_THREADS.threads} threads, "
             "summing a 1 GiB tensor); a decode step must read every weight it multiplies once")
    print_fn("| dtype | weight bytes read per token | roofline tokens/s | measured tokens/s | of roofline |")
    print_fn("|---|---:|---:|---:|---:|")
    for line in roofline:
        dtype_name, weight_bytes, ms = line.split("|")
        limit = bandwidth / float(weight_bytes)
        got = 1000 / float(ms)
        print_fn(f"| {dtype_name} | {float(weight_bytes) / 1e6:,.1f} MB | {limit:,.1f} | {got:,.1f} | {got / limit:.0%} |")


def memory_bandwidth(threads: int, gib: float = 1.0) -> float:
    """Bytes per second read by a sum over a tensor far larger than the caches (median of 5)."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    base = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x.sum()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(base)
    return x.numel() * 4 / statistics.median(times)


def decode_weight_bytes(decoder: Any) -> int:
    """Bytes of weights one decode row multiplies: the 4-bit packs where decode rows run them, else
    the dense matrices (tied embeddings counted once, as the lm_head)."""
    total = 0
    for lw in decoder.layers:
        for dense, q4 in ((lw.qkv, lw.qkv_q4), (lw.o_proj, lw.o_q4), (lw.gate_up, lw.gate_up_q4), (lw.down, lw.down_q4)):
            total += _int4_bytes(q4) if q4 is not None else dense.numel() * dense.element_size()
    head = decoder.lm_head_q4
    total += _int4_bytes(head) if head is not None else decoder.lm_head.numel() * decoder.lm_head.element_size()
    return total


def _int4_bytes(w: Any) -> int:
    if w.native is not None:  # qmatmul.c's layout: codes, scales (and biases) in one tensor
        return int(w.native.numel() * w.native.element_size())
    return sum(p.numel() * p.element_size() + sz.numel() * sz.element_size() for p, sz in w.parts)


def _median(fn: Callable[[], float], reps: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(reps))


def _logits(st: SessionState) -> torch.Tensor:
    assert st.logits is not None
    return st.logits


def cpu_name() -> str:
    """The CPU's model name and the matrix extensions that decide its kernels' bits and speed."""
    info = native.cpu_info()
    flags = info.get("flags", "").split()
    ext = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return f"{info.get('model name', 'unknown CPU')} ({', '.join(ext) or 'no AVX'})"


def _ours(dtype: torch.dtype, reps: int, quick: bool, notes: list[str], roofline: list[str]) -> dict[str, float]:
    m = load_model(None, dtype)
    runner = ModelRunner(m.decoder)
    result = self_test(runner)  # the tile plan, decode kernel and thread counts the server would use here
    notes.append(f"{dtype}: self-test {'passed' if result.ok else 'FAILED'} in {result.seconds:.1f}s: {result.detail}")
    g = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    for n in (512, 2048):
        ids = torch.randint(3, m.arch.vocab_size, (n,), generator=g).tolist()

        def prefill(n: int = n, ids: list[int] = ids) -> float:
            st = runner.new_state(n)
            t0 = time.perf_counter()
            runner.prefill(st, ids, PREFILL_CHUNK)
            return time.perf_counter() - t0

        out[f"prefill{n}"] = n / _median(prefill, 1 if (quick or n > 512) else reps)
    steps = 8 if quick else 24
    for batch in (1, 8):
        states = []
        for b in range(batch):
            st = runner.new_state(600)
            runner.prefill(st, torch.randint(3, m.arch.vocab_size, (500,), generator=g).tolist(), PREFILL_CHUNK)
            states.append(st)

        def decode(states: list[SessionState] = states) -> float:
            t0 = time.perf_counter()
            for _ in range(steps):
                runner.step([StepItem(st, [int(torch.argmax(_logits(st)))], decode=True) for st in states])
            return (time.perf_counter() - t0) / steps

        out[f"decode{batch}"] = 1000 * _median(decode, 1)
    roofline.append(f"{str(dtype).removeprefix('torch.')}|{decode_weight_bytes(m.decoder)}|{out['decode1']}")
    return out


def _transformers(dtype: torch.dtype, reps: int, quick: bool) -> dict[str, float]:
    model = reference_model(dtype)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    for n in (512, 2048):
        ids = torch.randint(3, vocab, (1, n), generator=g)

        def prefill(ids: torch.Tensor = ids) -> float:
            t0 = time.perf_counter()
            with torch.inference_mode():
                model(ids, use_cache=True, logits_to_keep=1)
            return time.perf_counter() - t0

        out[f"prefill{n}"] = n / _median(prefill, 1 if (quick or n > 512) else reps)
    steps = 8 if quick else 24
    from transformers import DynamicCache

    for batch in (1, 8):
        ids = torch.randint(3, vocab, (batch, 500), generator=g)
        with torch.inference_mode():
            o = model(ids, use_cache=True, past_key_values=DynamicCache(), logits_to_keep=1)
        state = {"cache": o.past_key_values, "next": o.logits[:, -1].argmax(-1, keepdim=True)}

        def decode(state: dict[str, Any] = state) -> float:
            t0 = time.perf_counter()
            with torch.inference_mode():
                for _ in range(steps):
                    r = model(state["next"], past_key_values=state["cache"], use_cache=True)
                    state["cache"], state["next"] = r.past_key_values, r.logits[:, -1].argmax(-1, keepdim=True)
            return (time.perf_counter() - t0) / steps

        out[f"decode{batch}"] = 1000 * _median(decode, 1)
    return out


def reference_model(dtype: torch.dtype):  # -> transformers.LlamaForCausalLM
    """The generic `transformers` Llama model holding the same dequantised weights as ours."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from prefixserve.models.loaders.gguf import GGUFModel

    gm = GGUFModel(embedded_model_path())
    a = gm.arch
    kw: dict[str, Any] = {
        "vocab_size": a.vocab_size, "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
        "num_hidden_layers": a.num_layers, "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads,
        "max_position_embeddings": a.max_position, "rms_norm_eps": a.rms_eps, "tie_word_embeddings": a.tie_embeddings,
        "rope_theta": a.rope_theta,
    }
    config = LlamaConfig(**kw)
    model = LlamaForCausalLM(config)
    state = {}
    for name in model.state_dict():
        t = gm.tensor(name)
        if t is not None:
            state[name] = t
    model.load_state_dict(state, strict=False)
    return cast(Any, model).to(dtype).eval()


def bench_constrained(quick: bool = False, print_fn: Callable[[str], object] = print) -> None:
    """Decode tokens/s of one session through the engine (bf16, the default decode kernel), free
    and under a JSON schema (llguidance masks, engine/grammar.py); the prompt's prefill is excluded."""
    import json

    from prefixserve.cache import PrefixCache
    from prefixserve.config import CacheConfig, EngineConfig
    from prefixserve.engine import EngineCore
    from prefixserve.types import Constraint, Delta, Namespace, Request, SamplingParams

    m = load_model(None, torch.bfloat16)
    stamps: list[tuple[float, int]] = []

    def emit(request_id: str, delta: Delta) -> None:
        if delta.token_ids:
            stamps.append((time.perf_counter(), len(delta.token_ids)))

    core = EngineCore(ModelRunner(m.decoder), m.tokenizer, PrefixCache(CacheConfig(max_bytes=0)), EngineConfig(),
                      2048, emit)
    schema: dict[str, object] = {"type": "object", "properties": {"names": {"type": "array", "items": {"type": "string"}},
                                               "count": {"type": "integer"}}, "required": ["names", "count"]}
    ids = tuple(m.tokenizer.render_chat([{"role": "user", "content": "List ten first names as JSON."}]))
    max_tokens = 32 if quick else 96
    for label, constraint in (("free", None), ("json_schema", Constraint("json_schema", json.dumps(schema)))):
        rates = []
        for rep in range(-1, 2 if quick else 3):  # rep -1 warms up (first calls, the grammar's tokenizer)
            stamps.clear()
            sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=rep, ignore_eos=constraint is None,
                                constraint=constraint)
            core.add(Request(f"{label}-{rep}", Namespace("bench", "bench"), ids, sp))
            while core.has_work():
                core.step()
            num_tokens = sum(n for _, n in stamps) - 1  # tokens after the first (which follows the prefill)
            if num_tokens > 0 and rep >= 0:
                rates.append(num_tokens / (stamps[-1][0] - stamps[0][0]))
        print_fn(f"decode with {label:>11}: {statistics.median(rates):6.1f} tokens/s "
                 f"(median of {len(rates)} runs of up to {max_tokens} tokens)")
    _bench_mask(core, schema, print_fn)


def _bench_mask(core: Any, schema: dict[str, object], print_fn: Callable[[str], object]) -> None:
    """The grammar's own cost per token (mask, apply, advance), replaying one valid output: robust
    to a loaded machine, unlike the decode rates above."""
    import json

    from prefixserve.runner import adjust_logits
    from prefixserve.types import Constraint, SamplingParams

    text = json.dumps({"names": ["Alice", "Bob", "Carol", "Dave", "Eve"], "count": 5}, separators=(",", ":"))
    ids = core.tokenizer.hf.encode(text, add_special_tokens=False)
    logits = torch.zeros(core.runner.decoder.arch.vocab_size)
    times = []
    for _ in range(5):
        matcher = core.grammars().matcher(Constraint("json_schema", json.dumps(schema)))
        for t in ids:
            t0 = time.perf_counter()
            adjust_logits(logits, SamplingParams(), (), matcher.allowed())
            matcher.consume(t)
            times.append(time.perf_counter() - t0)
    print_fn(f"grammar mask + apply + advance: {1e6 * statistics.median(times):.0f} us per token (median)")
