"""Which exact kernels a bf16 Llama-family model's prefill runs on this CPU, chosen by timing them.

Every candidate is exact by construction (row-local, fixed call shapes; the start-up self-test then
verifies the one chosen), so the choice is about speed only, and speed depends on the CPU class: on
an Intel Xeon with AMX the bf16 tiles win, on an AMD Zen 3 (AVX2 + FMA only) torch's bf16 matmul is
~4x slower than the 4-bit codes or fp32 copies (docs/exactness.md, "Every CPU class"). So the loader
times each candidate here, on the machine that runs it, and keeps the fastest:

- prefill matmuls (`MATMULS`): "amx" (bf16 on AMX tiles, amx.c, where the CPU has them), "q4" (the GGUF's
  4-bit codes, gemm.c, where every layer has native packs), "fp32" (fp32 copies of the weights through
  torch), "bf16" (torch's bf16 matmul). Not timed: "q4x8", the same codes times the rows rounded to int8 per
  32 inputs (gemm.c X4, llama.cpp's arithmetic; ~1.4x faster prefill on AVX2), which only
  PREFIXSERVE_DENSE_MATMUL=q4x8 selects: it is exact for the cache like the others, but its rounding moves
  the model's outputs ~2.5x further from the fp32-activation prefill than any candidate above (mean KL over
  16 chat prompts: 3.3e-3 against 1.3e-3 for bf16 tiles and 1.4e-3 for fp32 copies on an AMD Zen 4;
  docs/architecture.md, "Prompt rows on int8 activations"), so it is an operator's trade of precision for
  speed, never the default. Each is timed on the first `PROBE_LAYERS` layers of a `PROBE_TOKENS`-token
  forward after `PROBE_START` cached keys, norms, RoPE and attention included, since "amx" and "q4" also run
  a layer in one native call, with the server's team of threads for the big calls (`_time_candidates`).
- attention of the torch-tiled modes ("fp32", "bf16"): the native kernel (attention.c) or torch's fixed
  blocks, timed on one prefill tile over `ATTENTION_KEYS` keys. ("amx" and "q4" attend inside their native
  layer call.)
- the 4-bit decode step's activations (`DECODES`, where the model decodes on its 4-bit weights): "fp32"
  (qmatmul.c's fp32 dot products) or "int8" (rows rounded to int8 per 32 inputs, integer dot products:
  `qmatmul_x`), timed on `DECODE_STEPS` steps of one session at `DECODE_POSITION`. Decoded tokens' KV is
  never cached, so either keeps cached prefixes exact; the two give different logits (int8 is llama.cpp's
  kind of arithmetic), and the kernel fingerprint names the one in force (`decode=int4-i8`).

The prefill candidates are timed with the team of threads a server gives its big calls (every usable
core; the decode step on one thread), and the verdict is remembered in
`$XDG_CACHE_HOME/prefixserve/kernel-choice.json` under a key of what the timings depend on (native
build, torch build and dispatch level, model shapes), with a lock around timing and writing, so every
process on this machine makes the same choice whatever its thread settings (one kernel fingerprint
for the cache tiers) and later starts skip the timing. PREFIXSERVE_DENSE_MATMUL other than auto decides the
prefill matmuls without timing, PREFIXSERVE_DECODE_ACTIVATIONS (auto, fp32, int8) the decode step's.
"""

from __future__ import annotations

import copy
import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from prefixserve.models.kernels import amx_tiles, native
from prefixserve.models.kernels.threads import KERNEL_THREADS, usable_cores
from prefixserve.models.layers import block_attention
from prefixserve.models.llama import native_decode
from prefixserve.models.llama.decoder import Decoder
from prefixserve.models.segment import Segment

log = logging.getLogger("prefixserve.models")

MATMULS = ("amx", "q4", "q4x8", "fp32", "bf16")  # q4x8: `apply` only, never timed (above)
PROBE_TOKENS = 64
PROBE_START = 448  # the probe's rows follow this many cached keys (`_time_prefill`)
PROBE_LAYERS = 4
ATTENTION_KEYS = 512
DECODES = ("fp32", "int8")
DECODE_STEPS = 8
DECODE_POSITION = 256
FORMAT = 4  # 3: prefill probes after PROBE_START keys, on the serving thread count; 4: close calls timed again
# a prefill candidate within this factor of the fastest is timed again (`close_calls`), RETIMES rounds at
# most: on the 2-core Zen 3, whose speed drifts by +-30% within minutes, one pass in a slow moment chose
# fp32 copies (26.1 ms) over the 4-bit codes (27.5 ms), which quietly take 1.5x less on the probe and served
# a 2,000-token prompt 1.9x faster (bench/results/avx2/kernels.md, "decode fp32")
CLOSE = 1.25
RETIMES = 2
MAX_RECORDS = 32


@dataclass(frozen=True, slots=True)
class KernelChoice:
    matmul: str  # one of MATMULS
    attention: str  # "native" or "torch"
    # seconds of each candidate's timed call: "matmul:q4", "attention:native", ...; {} where a flag decided
    seconds: dict[str, float] = field(default_factory=dict)
    decode: str = "fp32"  # one of DECODES: the 4-bit decode step's activations
    remembered: bool = False  # read from the memo file, not timed by this process

    def describe(self) -> str:
        """One line for the start-up log and /health: what was chosen and what it beat, by how much."""
        if not self.seconds:
            return (f"prefill matmuls {self.matmul}, attention {self.attention}, decode activations {self.decode} "
                    "(set, not timed)")
        parts = []
        for group, won in (("matmul", self.matmul), ("attention", self.attention), ("decode", self.decode)):
            times = {k.split(":", 1)[1]: v for k, v in self.seconds.items() if k.startswith(group + ":")}
            if won not in times:
                continue
            best = times[won]
            beaten = ", ".join(f"{name} {v / best:.2f}x" for name, v in sorted(times.items(), key=lambda kv: kv[1])
                               if name != won)
            unit = {"matmul": f"{PROBE_LAYERS} layers of {PROBE_TOKENS} prompt tokens after {PROBE_START}",
                    "attention": f"tile over {ATTENTION_KEYS} keys",
                    "decode": f"step at position {DECODE_POSITION}"}[group]
            parts.append(f"{group} {won} {best * 1e3:.1f} ms a {unit}" + (f" (beat {beaten})" if beaten else ""))
        how = "remembered" if self.remembered else "timed here"
        return f"kernels chosen by timing ({how}): " + "; ".join(parts)


def fastest(seconds: Mapping[str, float], group: str) -> str:
    """The candidate of `group` ("matmul", "attention" or "decode") with the least time; ties go to the earlier
    key. Pure: the choosing logic, tested with given timings."""
    times = _ranked(seconds, group)
    if not times:
        raise ValueError(f"no {group} timings")
    return times[0][1]


def _ranked(seconds: Mapping[str, float], group: str) -> list[tuple[float, str]]:
    """(seconds, candidate) of `group`, least time first; ties in the order of `seconds`."""
    times = sorted((v, i, k.split(":", 1)[1]) for i, (k, v) in enumerate(seconds.items()) if k.startswith(group + ":"))
    return [(v, name) for v, _, name in times]


def close_calls(seconds: Mapping[str, float], group: str, margin: float = CLOSE) -> list[str]:
    """The candidates of `group` whose time is within `margin` x the fastest's, fastest first, where
    there are two or more (else []): the ones one timing pass cannot tell apart. Pure, like `fastest`."""
    times = _ranked(seconds, group)
    near = [name for v, name in times if v <= margin * times[0][0]] if times else []
    return near if len(near) > 1 else []


def choose(dec: Decoder, memo_dir: str | None = None) -> KernelChoice:
    """Time the candidates on `dec` (a bf16 CPU Llama-family decoder as built, nothing attached), or
    read the remembered verdict, and leave `dec` configured with the fastest. Mutates `dec`."""
    candidates = _candidates(dec)
    wanted = decode_wanted(dec)  # before any candidate attaches its packs
    path = os.path.join(memo_dir or _default_memo_dir(), "kernel-choice.json")
    key = _key(dec, candidates)
    with _locked(path):  # one process times, the others wait and read its verdict
        records = _read(path)
        if (hit := records.get(key)) is not None:
            choice = KernelChoice(hit["matmul"], hit["attention"], dict(hit["seconds"]), hit["decode"],
                                  remembered=True)
        else:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # one verdict per machine, whatever a process's thread settings
            try:
                seconds = _time_candidates(dec, candidates)
                if wanted == "auto":
                    seconds.update(_time_decodes(dec))
            finally:
                torch.set_num_threads(threads)

            def pick(group: str, default: str) -> str:
                return fastest(seconds, group) if any(k.startswith(group + ":") for k in seconds) else default

            choice = KernelChoice(fastest(seconds, "matmul"), pick("attention", "native"), seconds,
                                  pick("decode", "fp32"))
            records[key] = {"matmul": choice.matmul, "attention": choice.attention, "decode": choice.decode,
                            "seconds": seconds, "at": time.time()}
            _write(path, records)
    apply(dec, choice.matmul, choice.attention)
    apply_decode(dec, choice.decode if wanted == "auto" else wanted)
    return choice


def decode_wanted(dec: Decoder) -> str:
    """PREFIXSERVE_DECODE_ACTIVATIONS (auto, fp32 or int8); "fp32" where the model has no native 4-bit
    decode step to run either on."""
    wanted = os.environ.get("PREFIXSERVE_DECODE_ACTIVATIONS", "auto")
    if wanted not in ("auto", *DECODES):
        raise ValueError(f"PREFIXSERVE_DECODE_ACTIVATIONS must be auto, fp32 or int8, not {wanted!r}")
    return wanted if dec.int4_decode and native_decode.plan_for(dec, prompt_rows=False) is not None else "fp32"


def apply_decode(dec: Decoder, activations: str) -> None:
    """The 4-bit decode step on fp32 or int8 activations (DECODES)."""
    if activations not in DECODES:
        raise ValueError(f"unknown decode activations {activations!r}")
    dec.decode_int8 = activations == "int8" and dec.int4_decode
    dec.reset_native_plan()  # made again with the flag


@contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock on `path`.lock for the block (none where it cannot be made: then two first
    processes may both time, and the later verdict is remembered)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def apply(dec: Decoder, matmul: str, attention: str = "native") -> None:
    """Configure a decoder as built (bf16 weights, nothing attached) for one candidate."""
    if matmul == "amx":
        if dec.use_amx_tiles() == 0:
            raise ValueError("amx: no AMX tiles here")
    elif matmul in ("q4", "q4x8", "fp32"):
        dec.use_fp32_matmuls(q4=matmul != "fp32")
        if matmul == "q4x8" and not dec.use_int8_prefill():
            raise ValueError("q4x8: no native 4-bit prefill here")
    elif matmul != "bf16":
        raise ValueError(f"unknown matmul kernel {matmul!r}")
    dec.native_attention = dec.native_attention and attention == "native"


def _candidates(dec: Decoder) -> list[str]:
    out = []
    if native.amx_ready():
        out.append("amx")
    if dec.layers and all(w is not None and w.native is not None for lw in dec.layers for w in lw.int4):
        out.append("q4")
    return [*out, "fp32", "bf16"]


def _time_candidates(dec: Decoder, candidates: list[str]) -> dict[str, float]:
    """Each candidate's prefill probe on the thread count a server runs its big calls on (every usable core:
    models/kernels/threads.py), torch itself on one thread as a server runs it. On one thread for all, an
    AMD Zen 4 chose torch's bf16 tiles over the 4-bit codes (1.38x at 64 fresh rows), yet served a
    2,000-token prompt 1.23x slower with them than with the codes (bench/kernel_configs.py, 2026-12-06): a
    native layer call runs all of itself on the team, a torch-tiled layer only its matmuls and attention.
    The verdict stays one per machine: the count is the machine's, not the process's settings."""
    seconds: dict[str, float] = {}
    probe = _probe(dec)
    base = _Saved(probe)
    threads, allowed = KERNEL_THREADS.threads, set(KERNEL_THREADS.allowed)
    KERNEL_THREADS.configure(usable_cores())
    KERNEL_THREADS.allow({"int4", "dense", "attention"})
    try:
        for name in candidates:
            apply(probe, name)
            best = min(seconds.values(), default=math.inf)
            seconds[f"matmul:{name}"] = _time_prefill(probe, give_up_after=1.5 * best)
            if name in ("fp32", "bf16") and probe.native_attention:
                for how in ("native", "torch"):
                    seconds.setdefault(f"attention:{how}", _time_attention(probe, how))
            base.restore(probe)
        for r in range(RETIMES):  # close calls again, the order turned each round; each keeps its best
            near = close_calls(seconds, "matmul")
            for name in (near if r % 2 else near[::-1]):
                apply(probe, name)
                seconds[f"matmul:{name}"] = min(seconds[f"matmul:{name}"], _time_prefill(probe, give_up_after=math.inf))
                base.restore(probe)
    finally:
        KERNEL_THREADS.configure(threads)
        KERNEL_THREADS.allow(allowed)
    return seconds


def _probe(dec: Decoder) -> Decoder:
    """The first PROBE_LAYERS layers (the same objects) as a decoder of their own: all `_time_prefill`
    runs, so a candidate's copies of weights are made for them only (the embedded model's fp32 copies:
    57 MB, not 425 of new memory, which is slow on these VMs: docs/architecture.md, "Start-up")."""
    probe = copy.copy(dec)
    n = min(PROBE_LAYERS, dec.arch.num_layers)
    probe.arch, probe.layers = dataclasses.replace(dec.arch, num_layers=n), dec.layers[:n]
    probe.reset_native_plan()  # its own plan, for its own layers
    return probe


def _time_decodes(dec: Decoder) -> dict[str, float]:
    """Seconds of one native decode step of one session at DECODE_POSITION on one thread, per DECODES
    candidate: the best of DECODE_STEPS after a warm-up step."""
    a = dec.arch
    kv = torch.zeros(a.num_layers, 2, a.num_kv_heads, DECODE_POSITION + 16, a.head_dim, dtype=dec.dtype)
    token = torch.tensor([7919 % a.vocab_size], dtype=torch.long)
    seconds: dict[str, float] = {}
    was = dec.decode_int8
    try:
        for name in DECODES:
            apply_decode(dec, name)
            plan = native_decode.plan_for(dec, prompt_rows=False)
            if plan is None:
                return {}
            best = math.inf
            for i in range(DECODE_STEPS + 1):
                t0 = time.perf_counter()
                if native_decode.decode_rows(dec, plan, token, [Segment(DECODE_POSITION, 1, kv, decode=True)], 1) is None:
                    return {}
                if i:
                    best = min(best, time.perf_counter() - t0)
            seconds[f"decode:{name}"] = best
    finally:
        dec.decode_int8 = was
        dec.reset_native_plan()
    return seconds


def _time_prefill(dec: Decoder, give_up_after: float) -> float:
    """Seconds of the first PROBE_LAYERS layers of a PROBE_TOKENS-token forward after PROBE_START cached
    keys (the forward pauses after each layer, `Decoder.forward_layers`): rows that attend to a prefix,
    as every chunk after a long prompt's first and every partial hit does (on fresh KV the Zen 4's
    probe favoured the torch tiles that served both slower). A first, untimed run warms the
    candidate up (it makes the native plan and its packs: ~60 ms, which once counted against the
    candidates timed after the fastest so far), then the best of two, one where the first took longer
    than `give_up_after` (it will not be chosen)."""
    a = dec.arch
    ids = torch.arange(PROBE_TOKENS, dtype=torch.long) * 7919 % a.vocab_size
    kv = torch.zeros(a.num_layers, 2, a.num_kv_heads, PROBE_START + PROBE_TOKENS, a.head_dim, dtype=dec.dtype)
    best = math.inf
    for i in range(3):
        kv.zero_()
        t0 = time.perf_counter()
        steps = dec.forward_layers(ids, [Segment(PROBE_START, PROBE_TOKENS, kv)])
        try:
            for _ in range(min(PROBE_LAYERS, a.num_layers)):
                next(steps)
        finally:
            steps.close()
        if i:
            best = min(best, time.perf_counter() - t0)
            if best > give_up_after:
                break
    return best


def _time_attention(dec: Decoder, how: str) -> float:
    a = dec.arch
    rows, start = 64, ATTENTION_KEYS - 64
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, a.num_kv_heads, ATTENTION_KEYS, a.head_dim, generator=g).to(dec.dtype)
    q = torch.randn(rows, a.num_heads, a.head_dim, generator=g).to(dec.dtype)
    call: Callable[[], object] = ((lambda: native.attention(q, kv[0], kv[1], start)) if how == "native"
                                  else (lambda: block_attention(q, kv[0], kv[1], start)))
    call()
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best


class _Saved:
    """A decoder's state as built, to return to after timing a candidate."""

    def __init__(self, dec: Decoder) -> None:
        names = ("prefill_q4", "prefill_int8", "matmul_dtype", "amx", "native_attention", "int4_rows", "lm_head")
        self.fields = {name: getattr(dec, name) for name in names}
        self.layers = [(lw.qkv, lw.qkv_bias, lw.o_proj, lw.gate_up, lw.down) for lw in dec.layers]

    def restore(self, dec: Decoder) -> None:
        for lw, saved in zip(dec.layers, self.layers, strict=True):
            for w in lw.dense:
                amx_tiles.unpack(w)
            lw.qkv, lw.qkv_bias, lw.o_proj, lw.gate_up, lw.down = saved
        amx_tiles.unpack(dec.lm_head)
        for name, value in self.fields.items():
            setattr(dec, name, value)
        dec.reset_native_plan()  # made again for the configuration in force


def _key(dec: Decoder, candidates: list[str]) -> str:
    a = dec.arch
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("ATEN_", "ONEDNN_", "DNNL_", "MKL_", "OMP_",
                                                                         "PREFIXSERVE_NATIVE", "PREFIXSERVE_DECODE"))}
    parts = [FORMAT, native.digest() if native.library() is not None else "no-native", torch.__version__,
             hashlib.blake2b(torch.__config__.show().encode(), digest_size=8).hexdigest(),
             torch.backends.cpu.get_cpu_capability(), os.cpu_count(), env, candidates,
             [a.hidden_size, a.intermediate_size, a.num_heads, a.num_kv_heads, a.head_dim, a.num_layers, a.vocab_size],
             str(dec.dtype), str(dec.tiles)]
    return hashlib.blake2b(json.dumps(parts, default=str).encode(), digest_size=16).hexdigest()


def _default_memo_dir() -> str:
    return os.path.dirname(native.build_dir().rstrip(os.sep))


def _read(path: str) -> dict[str, dict]:
    try:
        with open(path) as f:
            data = json.load(f)
        return dict(data["records"]) if data.get("format") == FORMAT else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _write(path: str, records: dict[str, dict]) -> None:
    """Atomically; the newest MAX_RECORDS records; a memo that cannot be written only costs a timing."""
    newest = dict(sorted(records.items(), key=lambda kv: kv[1].get("at", 0))[-MAX_RECORDS:])
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".kernel-choice-", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "records": newest}, f)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("kernel choice: cannot remember it in %s (%s)", path, e)
