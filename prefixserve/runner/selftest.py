"""Start-up self-test: verify, on THIS machine, the exact kernel calls the runtime makes.

A kernel's bits can depend on its call shape in ways that change with the CPU, the BLAS build and
the thread count (docs/exactness.md). The runtime therefore calls every dense matmul with one row
count only (a `TilePlan`); this test checks, for each weight shape in use, that a row's bits do not
depend on its position in the tile or on its neighbours, that the 4-bit decode kernel's rows do not
depend on the row count, and then the end-to-end split, batch and decode checks. It takes the first
candidate plan that passes; where none does, the caller must refuse cross-request reuse.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from prefixserve.models.kernels import native
from prefixserve.models.kernels.int4 import Int4Weight, int4_linear
from prefixserve.models.kernels.threads import KERNEL_THREADS
from prefixserve.models.layers import TilePlan, linear
from prefixserve.models.llama import native_decode
from prefixserve.models.llama.decoder import Decoder
from prefixserve.models.segment import Segment
from prefixserve.runner.runner import ModelRunner, StepItem
from prefixserve.runner.state import SessionState

# In order of preference (docs/exactness.md): 64 rows keeps a short suffix (a partial hit) cheap
# while long prompts still run efficient matmuls; the others are fallbacks should 64 fail somewhere.
CANDIDATE_PLANS = (TilePlan(64, 16), TilePlan(128, 16), TilePlan(32, 32), TilePlan(16, 16))
# where prefill multiplies the 4-bit codes but cannot run natively a layer per call (models/llama/decoder.py
# `prefill_q4`), tiles hold only the torch ops around the matmuls: 32 rows took a 22-token suffix over
# 600 cached tokens 113 -> 100 ms, over 2,000 190 -> 160 ms, a cold 2,000-token prefill no slower
# (Ice Lake, in process); 16 rows were slower
Q4_PLANS = (TilePlan(32, 16), *CANDIDATE_PLANS)
MAX_DECODE_ROWS = 16  # 4-bit decode rows are checked for every row count 1..this


@dataclass(frozen=True, slots=True)
class SelfTestResult:
    ok: bool
    tiles: str  # rows of the chosen TilePlan, e.g. "64"
    decode_kernel: str  # "int4" or "dense"
    detail: str  # what was chosen and why, for logs and /health
    seconds: float
    # where the verdict is a recorded one (runner/selftest_memo.py): when and how long the test that
    # gave it ran; not part of `detail`, which (with responses' system_fingerprint) stays the same
    remembered: str = ""


def self_test(runner: ModelRunner) -> SelfTestResult:
    """Pick the fastest candidate plan (and decode kernel) that passes; sets them on the decoder.

    Tries 4-bit decode rows first where the model has them; if they fail, falls back to dense decode
    (the prefill path) and says so. Mutates runner.decoder (tiles, possibly its 4-bit weights)."""
    t0 = time.perf_counter()
    dec = runner.decoder
    notes: list[str] = []
    KERNEL_THREADS.allow(set())
    threads_why: list[str] = []
    # thread counts first, so the row and end-to-end checks below run on the counts the runtime will
    # use (and run faster): the 4-bit kernel's calls now, the dense tiles once a plan is picked
    int4_kinds: set[str] = set()
    if dec.int4_decode:
        int4_kinds, why = check_threads(dec, {"int4"})
        if why:
            threads_why.append(why)
        KERNEL_THREADS.allow(int4_kinds)
        why = check_int4_rows(dec)
        if why:
            notes.append(f"4-bit decode refused ({why}); decode rows run the dense prefill path")
            dec.drop_int4()
    plans = Q4_PLANS if getattr(dec, "prefill_q4", False) else CANDIDATE_PLANS
    candidates = plans if dec.tiles in plans else (dec.tiles, *plans)
    for plan in candidates:
        dec.tiles = plan
        why = check_tile_rows(dec, plan)
        if not why:
            dense_kinds, dense_why = check_threads(dec, {"dense", "attention"})
            KERNEL_THREADS.allow(int4_kinds | dense_kinds)
            why = check_invariance(runner)
            if why and dec.int4_decode and why.startswith("decode"):
                notes.append(f"4-bit decode refused ({why}); decode rows run the dense prefill path")
                q4 = getattr(dec, "prefill_q4", False)
                dec.drop_int4()
                if q4:  # prefill now runs dense tiles (fp32 copies): check them as above
                    why = check_tile_rows(dec, plan)
                    dense_kinds, dense_why = check_threads(dec, {"dense", "attention"})
                    KERNEL_THREADS.allow(dense_kinds)
                why = why or check_invariance(runner)
        if not why:
            if dense_why:
                threads_why.append(dense_why)
            if threads_why:
                notes.append(f"calls stay on {torch.get_num_threads()} threads where ({'; '.join(threads_why)})")
            attention = "native" if dec.native_attention else "torch blocks"
            matmuls = getattr(dec, "matmuls", f"{dec.dtype} matmuls")  # models/llama/decoder.py `use_fp32_matmuls`
            x8 = " on int8 activations" if getattr(dec, "decode_int8", False) and dec.decode_kernel == "int4" else ""
            notes.insert(0, f"exact: {matmuls} in row tiles {plan}, decode kernel {dec.decode_kernel}{x8}, "
                            f"attention {attention}, {KERNEL_THREADS.describe()}")
            if getattr(dec, "kernel_choice", ""):
                notes.insert(1, dec.kernel_choice)
            return SelfTestResult(True, str(plan), dec.decode_kernel, "; ".join(notes), time.perf_counter() - t0)
        KERNEL_THREADS.allow(int4_kinds)
        notes.append(f"tiles {plan} refused: {why}")
    dec.tiles = candidates[-1]
    notes.insert(0, "NOT exact on this machine; cross-request reuse is disabled")
    return SelfTestResult(False, str(dec.tiles), dec.decode_kernel, "; ".join(notes), time.perf_counter() - t0)


def _dense_tiles(dec: Decoder, plan: TilePlan) -> list[tuple[str, torch.Tensor, torch.Tensor | None, int]]:
    """(name, weight, bias, tile rows) of every dense matmul call site the runtime makes."""
    lw = dec.layers[0]
    hybrid_weights = getattr(dec, "tile_weights", None)  # models/hybrid/decoder.py: its own weight shapes
    weights: list[tuple[str, torch.Tensor, torch.Tensor | None, int]] = [
        ("qkv", lw.qkv, lw.qkv_bias, plan.rows), ("o_proj", lw.o_proj, None, plan.rows),
        ("gate_up", lw.gate_up, None, plan.rows), ("down", lw.down, None, plan.rows),
    ] if hybrid_weights is None else [(name, w, None, plan.rows) for name, w in hybrid_weights()]
    if getattr(dec, "prefill_q4", False):  # prefill multiplies the 4-bit packs (`_int4_weights`)
        weights = []
    if dec.lm_head_q4 is None:
        weights.append(("lm_head", dec.lm_head, None, plan.head_rows))
    return weights


def _int4_weights(dec: Decoder) -> list[tuple[str, Int4Weight]]:
    """(name, weight) of every 4-bit weight decode rows (and the logits) multiply."""
    lw = dec.layers[0]
    named = [("qkv", lw.qkv_q4), ("o_proj", lw.o_q4), ("gate_up", lw.gate_up_q4), ("down", lw.down_q4),
             ("lm_head", dec.lm_head_q4)]
    return [(name, w) for name, w in named if w is not None]


def check_tile_rows(dec: Decoder, plan: TilePlan, seed: int = 7) -> str:
    """'' when, for every dense weight shape the runtime multiplies, a row's bits are the same at every
    position of its tile (`plan.rows` rows; the lm_head's `plan.head_rows`) with any neighbours; else what failed. A random tile, then
    permutations of it (every row visits other positions beside other neighbours), and one row
    beside all-zero neighbours (the padding of a last tile)."""
    g = torch.Generator().manual_seed(seed)
    for name, w, bias, size in _dense_tiles(dec, plan):
        x = torch.randn(size, w.shape[1], generator=g).to(dec.dtype).to(dec.device)
        y = linear(x, w, bias)
        for perm in _perms(size, g):
            if not torch.equal(linear(x[perm], w, bias), y[perm]):
                return f"{name}: a row's bits depend on its position in a {size}-row tile"
        lone = torch.zeros_like(x)
        lone[size // 3] = x[0]
        if not torch.equal(linear(lone, w, bias)[size // 3], y[0]):
            return f"{name}: a row's bits depend on its neighbours in a {size}-row tile"
    return ""


def check_threads(dec: Decoder, kinds: set[str], seed: int = 13) -> tuple[set[str], str]:
    """Which of `kinds` of matmul (models/kernels/threads.py) give the same bits on KERNEL_THREADS.threads as
    on torch's count, for every call shape the runtime makes: "dense", the plan's tiles of each
    weight (and the dense lm_head's); "int4", the 4-bit weights at 1, 4 and MAX_DECODE_ROWS rows;
    "attention", a native attention call split between threads against the whole call.
    Returns (the kinds that passed, why the others did not)."""
    base, many = torch.get_num_threads(), KERNEL_THREADS.threads
    if many <= base or dec.device.type != "cpu" or getattr(dec, "tile_weights", None) is not None:
        # (a hybrid model's forward, models/hybrid/decoder.py, makes no threaded calls)
        return set(), ""
    allowed = KERNEL_THREADS.allowed
    KERNEL_THREADS.allow(set())  # every call below on exactly the count asked for
    try:
        return _check_threads(dec, kinds, base, many, seed)
    finally:
        KERNEL_THREADS.allow(allowed)


def _check_threads(dec: Decoder, kinds: set[str], base: int, many: int, seed: int) -> tuple[set[str], str]:
    g = torch.Generator().manual_seed(seed)
    passed, why = set(), []
    if "dense" in kinds:
        failed = ""
        for name, w, bias, rows in _dense_tiles(dec, dec.tiles):
            x = torch.randn(rows, w.shape[1], generator=g).to(dec.dtype)
            if w.dtype != x.dtype:  # widened weights: their two halves one after the other, or at once
                same = torch.equal(linear(x, w, bias, 1), linear(x, w, bias, many))
            else:
                same = torch.equal(KERNEL_THREADS.on(base, linear, x, w, bias), KERNEL_THREADS.on(many, linear, x, w, bias))
            if not same:
                failed = f"dense {name} tile differs between {base} and {many} threads"
                break
        if failed:
            why.append(failed)
        else:
            passed.add("dense")
    int4 = _int4_weights(dec)
    if "int4" in kinds and int4:
        failed = ""
        for name, w4 in int4:
            for rows in (1, 4, MAX_DECODE_ROWS, *([dec.tiles.rows] if getattr(dec, "prefill_q4", False) else [])):
                x = torch.randn(rows, w4.in_features, generator=g).to(torch.bfloat16)
                if w4.native is not None:  # qmatmul.c on decode.c's team
                    same = torch.equal(int4_linear(x, w4, ways=base), int4_linear(x, w4, ways=many))
                else:
                    same = torch.equal(KERNEL_THREADS.on(base, int4_linear, x, w4), KERNEL_THREADS.on(many, int4_linear, x, w4))
                if not same:
                    failed = f"4-bit {name} differs between {base} and {many} threads at {rows} rows"
                    break
            if failed:
                break
        plan = dec.native_decode_plan() if isinstance(dec, Decoder) else None
        if not failed and plan is not None:
            failed = _check_decode_threads(dec, plan, base, many, g)
        if not failed and plan is not None and (getattr(dec, "prefill_q4", False) or plan.prefill_weights is not None):
            failed = _check_prefill_threads(dec, plan, base, many, g)
        if failed:
            why.append(failed)
        else:
            passed.add("int4")
    if "attention" in kinds and dec.native_attention:
        a = dec.arch
        start, rows = 600, 40  # past native.SPLIT_MIN_WORK, so the call is split
        kv = torch.randn(2, a.num_kv_heads, start + rows, a.head_dim, generator=g).to(dec.dtype)
        q = torch.randn(rows, a.num_heads, a.head_dim, generator=g).to(dec.dtype)
        whole = native.attention(q, kv[0], kv[1], start)
        if torch.equal(native.attention(q, kv[0], kv[1], start, many, KERNEL_THREADS.parallel), whole):
            passed.add("attention")
        else:
            why.append(f"native attention split {many} ways differs")
    return passed, "; ".join(why)


def _random_kv(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Normal values / 2 in `dtype`, drawn in it: no fp32 tensor of the whole (two of these made ~150 MB
    of fp32 temporaries in a first start's self-test; drawn in bf16 the decode and prefill thread checks
    took 0.13 and 0.72-0.81 s on the Zen 3, against 0.18 and 0.82-0.87)."""
    return torch.randn(shape, generator=g, dtype=dtype).div_(2)


def _check_decode_threads(dec: Decoder, plan: native_decode.DecodePlan, base: int, many: int,
                          g: torch.Generator) -> str:
    """'' when the native decode step (decode.c) gives the same logits and K/V on both counts, for
    three sessions at once (keys past a 16-key block's end, and not)."""
    a = dec.arch
    starts = [5, 40, 301]
    kv = _random_kv((len(starts), a.num_layers, 2, a.num_kv_heads, 320, a.head_dim), dec.dtype, g)
    tokens = torch.randint(0, a.vocab_size, (len(starts),), generator=g)
    runs = []
    for ways in (base, many):
        mine = kv.clone() if ways == base else kv  # the second run may write the original
        segments = [Segment(s, 1, mine[i], decode=True) for i, s in enumerate(starts)]
        runs.append((native_decode.decode_rows(dec, plan, tokens, segments, ways), mine))
    (la, ka), (lb, kb) = runs
    if la is None or lb is None or not torch.equal(la, lb) or not torch.equal(ka, kb):
        return f"native decode step differs between {base} and {many} threads"
    return ""


def _check_prefill_threads(dec: Decoder, plan: native_decode.DecodePlan, base: int, many: int,
                           g: torch.Generator) -> str:
    """'' when native prefill (decode.c `prefill_layer`) gives the same logits and K/V on both counts,
    for two sessions' prompt rows at once (one long enough that its attention is split by rows)."""
    a = dec.arch
    parts = [(0, 37), (600, 40)]  # (start, rows)
    kv = _random_kv((len(parts), a.num_layers, 2, a.num_kv_heads, 640, a.head_dim), dec.dtype, g)
    tokens = torch.randint(0, a.vocab_size, (sum(n for _, n in parts),), generator=g)
    runs = []
    for ways in (base, many):
        mine = kv.clone() if ways == base else kv  # the second run may write the original
        segments = [Segment(start, n, mine[i]) for i, (start, n) in enumerate(parts)]
        rows = native_decode.prefill_start(dec, plan, tokens, segments)
        if rows is None:
            return "native prefill cannot run"
        for layer in range(a.num_layers):
            native_decode.prefill_layer(plan, rows, layer, ways)
        runs.append((native_decode.rows_logits(plan, rows.h, ways), mine))
    (la, ka), (lb, kb) = runs
    if not torch.equal(la, lb) or not torch.equal(ka, kb):
        return f"native prefill differs between {base} and {many} threads"
    return ""


def check_int4_rows(dec: Decoder, seed: int = 11) -> str:
    """'' when every 4-bit weight's rows have the same bits for 1..MAX_DECODE_ROWS rows at any offset."""
    g = torch.Generator().manual_seed(seed)
    for name, w in _int4_weights(dec):
        x = torch.randn(MAX_DECODE_ROWS + 3, w.in_features, generator=g).to(torch.bfloat16)
        full = int4_linear(x, w)
        for rows in range(1, MAX_DECODE_ROWS + 1):
            for offset in {0, 3 - rows % 4, x.shape[0] - rows}:
                if not torch.equal(int4_linear(x[offset : offset + rows], w), full[offset : offset + rows]):
                    return f"{name}: 4-bit rows differ with {rows} rows in the call"
    return ""


def check_invariance(runner: ModelRunner, num_tokens: int = 80, seed: int = 1234) -> str:
    """'' when last logits agree bitwise for one-shot, split, token-wise and batched runs, and decode
    rows agree alone and batched (and equal prefill where decode runs the prefill path); else what failed."""
    g = torch.Generator().manual_seed(seed)
    vocab = runner.decoder.arch.vocab_size
    ids = torch.randint(0, vocab, (num_tokens,), generator=g).tolist()
    other = torch.randint(0, vocab, (num_tokens // 2 + 3,), generator=g).tolist()

    def run(splits: list[int]) -> SessionState:
        st = runner.new_state()
        prev = 0
        for sp in [*splits, num_tokens]:
            runner.step([StepItem(st, ids[prev:sp])])
            prev = sp
        assert st.logits is not None
        return st

    alone = run([])
    ref = alone.logits
    assert ref is not None
    for splits in ([1], [29], [num_tokens - 1], [5, 6, 33], [65]):
        if not torch.equal(run(splits).logits, ref):  # type: ignore[arg-type]
            return f"split at {splits}: logits differ"
    st = runner.new_state()
    runner.step([StepItem(st, ids[:-1])])
    o1 = runner.new_state()
    runner.step([StepItem(o1, other[:-2])])
    o2 = runner.new_state()
    runner.step([StepItem(o1, other[-2:-1]), StepItem(st, ids[-1:]), StepItem(o2, other, want_logits=False)])
    if not torch.equal(st.logits, ref):  # type: ignore[arg-type]
        return "batched with other sessions: logits differ"
    # decode rows: alone vs among other decode rows and a prefill chunk
    token = int(torch.argmax(ref))
    runner.step([StepItem(alone, [token], decode=True)])
    o3 = runner.new_state()
    runner.step([StepItem(o3, other[:-4])])
    o4 = runner.new_state()
    runner.step([
        StepItem(o4, other[:9]), StepItem(o3, [other[-4]], decode=True), StepItem(st, [token], decode=True),
        StepItem(o1, [other[-1]], decode=True),
    ])
    if not torch.equal(st.logits, alone.logits):  # type: ignore[arg-type]
        return "decode rows: logits differ alone and batched"
    if runner.decoder.decode_matches_prefill:
        pre = runner.new_state()
        runner.step([StepItem(pre, [*ids, token])])
        if not (torch.equal(pre.logits, alone.logits)  # type: ignore[arg-type]
                and torch.equal(pre.kv[:, :, :, : num_tokens + 1], alone.kv[:, :, :, : num_tokens + 1])):
            return "decode state differs from the prefill state"
    return ""


def _perms(size: int, g: torch.Generator) -> list[torch.Tensor]:
    """A cyclic shift, the reversal and a random permutation of range(size)."""
    idx = torch.arange(size)
    return [torch.roll(idx, 1), idx.flip(0), torch.randperm(size, generator=g)]
