"""Native kernels, built on the machine that runs them and called through ctypes: attention.c (causal
attention of any rows), qmatmul.c (4- and 8-bit GGUF matmuls for decode rows and logits), amx.c
(bf16 matmuls on AMX tiles, where the CPU has them) and decode.c (a whole decode step, or a layer of
prompt rows, on a team of threads), sharing simd.h.

The first process that needs them compiles the C sources (`cc -O3 -march=native -ffp-contract=off`,
a few seconds; `native_build.py`, started early by `native_build.prebuild()`) into `$XDG_CACHE_HOME/prefixserve/native/` (PREFIXSERVE_NATIVE_DIR overrides),
named by a digest of the source, the flags, the compiler's version and the CPU's flags; later starts
load the built file. Where no compiler is found or the build fails, `library()` is None and the
callers use their torch formulation (same contract, slower; logged once). PREFIXSERVE_NATIVE=0
turns the kernels off.

PREFIXSERVE_NATIVE_ISA (isa.py) holds the build to an instruction-set level the CPU can execute, so one
machine tests the code every CPU class runs (docs/exactness.md, "Every CPU class"): `native` (the
default: all the CPU has), `avx512` (no AMX: an AMD Zen 4's set), `avx2` (x86-64-v3: AVX2 + FMA, an
AMD Zen 3's set), `generic` (x86-64-v2: simd.h's plain C). `effective_flags()` is the CPU's flags
less what the level leaves out; the loader reads bf16 arithmetic from it. Torch is held to the same
level by its own variables (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2:
without the last, torch's fp32 matmuls still run MKL's AVX-512 kernels).

-ffp-contract=off: every fused multiply-add in the source is one it writes, never one the compiler
chose per call site, so two inlined copies of a loop cannot round differently (docs/exactness.md).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import subprocess
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from prefixserve.models.kernels import native_build
from prefixserve.models.kernels.isa import cpu_info, effective_flags, executable_levels, isa
from prefixserve.models.kernels.native_build import build_dir, digest

if TYPE_CHECKING:  # torch is imported where a kernel is called: the build starts before torch is imported
    import torch

# the build's identity and target (isa.py, native_build.py) are offered here with the calls
__all__ = ["SPLIT_MIN_WORK", "amx_linear", "amx_pack", "amx_ready", "attention", "attention_supported", "build_dir",
           "build_name", "cpu_info", "digest", "effective_flags", "executable_levels", "expected", "isa", "kernel_name",
           "library", "qgemm", "qmatmul", "qmatmul_int8", "qpanel_pack", "qx4_pack"]

log = logging.getLogger("prefixserve.models")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_path = "none"  # the loaded library's file
_amx: bool | None = None


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built if needed; None where they cannot be (logged once)."""
    global _lib, _tried, _path
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("PREFIXSERVE_NATIVE", "1") == "0":
            log.info("native kernels: off (PREFIXSERVE_NATIVE=0); attention uses its torch formulation")
            return None
        try:
            level = isa()
        except ValueError as e:
            log.warning("native kernels: %s; attention uses its torch formulation", e)
            return None
        cc = native_build.compiler()
        if cc is None:
            log.warning("native kernels: no C compiler (cc, gcc or $CC); attention uses its torch formulation")
            return None
        try:
            path = native_build.built_path(cc)
            lib = ctypes.CDLL(path)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", None) or e
            log.warning("native kernels: build failed (%s); attention uses its torch formulation", str(detail)[-800:])
            return None
        f = lib.attention
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p]
        P, I64 = ctypes.c_void_p, ctypes.c_int64
        lib.qmatmul_team.restype = ctypes.c_int
        lib.qmatmul_team.argtypes = [P, I64, I64, I64, ctypes.c_int, P, I64, P, I64, ctypes.c_int]
        lib.qgemm.restype = ctypes.c_int
        lib.qgemm.argtypes = [P, I64, I64, I64, ctypes.c_int, P, I64, I64, P, I64]
        lib.qpanel_pack.restype = None
        lib.qpanel_pack.argtypes = [P, I64, I64, P]
        lib.qx4_pack.restype = None
        lib.qx4_pack.argtypes = [P, I64, I64, P]
        lib.decode_step.restype = ctypes.c_int
        lib.decode_step.argtypes = [P, ctypes.c_float, ctypes.c_float, P, P, P, P, P, P, P, P, P, ctypes.c_int]
        lib.prefill_scratch.restype = I64
        lib.prefill_scratch.argtypes = [P, ctypes.c_int]
        lib.prefill_layer.restype = ctypes.c_int
        lib.prefill_layer.argtypes = [P, ctypes.c_float, ctypes.c_float, P, I64, P, P, P, P, P, P, I64, P,
                                      ctypes.c_int]
        lib.amx_ready.restype = ctypes.c_int
        lib.amx_ready.argtypes = []
        lib.amx_linear_team.restype = ctypes.c_int
        lib.amx_linear_team.argtypes = [P, I64, I64, I64, P, P, I64, P, I64, ctypes.c_int]
        lib.rows_logits.restype = ctypes.c_int
        lib.rows_logits.argtypes = [P, ctypes.c_float, P, P, P, P, ctypes.c_int]
        lib.amx_ready()  # ask for the AMX tiles now: attention.c's bf16 path runs on them once granted
        log.info("native kernels: %s (ISA level %s)", os.path.basename(path), level)
        _lib, _path = lib, path
        return lib


def expected() -> bool:
    """Whether `library()` will give the kernels, without waiting for a build still in flight: its
    answer once known, else True while `prebuild`'s thread compiles (a first start). The model
    loader prepares the model meanwhile, on that expectation, and asks `library()` once it needs the
    kernels; where the build then failed it prepares the model again without them
    (models/loaders/load.py)."""
    if not _tried and native_build.building():
        return True
    return library() is not None


def build_name() -> str:
    """The loaded kernels' file name (a digest of source, flags, compiler and CPU flags), or "none"."""
    lib = library()
    return os.path.basename(_path) if lib is not None else "none"


def qmatmul(x: torch.Tensor, packed: torch.Tensor, kind: int, out: torch.Tensor, ways: int = 1) -> int:
    """out[:, :N] = x @ W.T for a weight in qmatmul.c's layout (packed: uint8 [N / 4, K / 32, bytes],
    kind 0 Q4, 1 Q8); x: [n, K] fp32 with contiguous rows, out: [n, >= N] fp32. The outputs are split
    between `ways` threads (decode.c's team), which cannot change a bit. Returns the threads used."""
    import torch

    lib = library()
    assert lib is not None
    n, k = x.shape
    rows = packed.shape[0] * 4
    if x.dtype != torch.float32 or out.dtype != torch.float32 or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("qmatmul: fp32 rows with unit stride expected")
    if k != packed.shape[1] * 32 or out.shape[0] != n or out.shape[1] < rows or rows % 16:
        raise ValueError(f"qmatmul: shapes x {tuple(x.shape)}, weight {tuple(packed.shape)}, out {tuple(out.shape)}")
    return int(lib.qmatmul_team(x.data_ptr(), n, x.stride(0), k, kind, packed.data_ptr(), rows, out.data_ptr(),
                                out.stride(0), ways))


def qgemm(x: torch.Tensor, packed: torch.Tensor, kind: int, out: torch.Tensor, outputs: tuple[int, int] | None = None) -> None:
    """Prompt rows' form of `qmatmul` (gemm.c, what decode.c's `prefill_layer` runs): out[:, o0:o1] =
    x @ W[o0:o1].T with each output one fused multiply-add chain over K in order, on the calling
    thread; kind 0 (Q4), 1 (Q8), 2 (P4, `qpanel_pack`'s) or 3 (X4, `qx4_pack`'s: x rounded to int8 per 32
    inputs first); `outputs` (o0, o1), multiples of 4 (of 16 for P4 and X4), default all."""
    import torch

    lib = library()
    assert lib is not None
    n, k = x.shape
    step = P4_OUTPUTS if kind in (2, 3) else 4
    rows = packed.shape[0] * step
    o0, o1 = outputs or (0, rows)
    if x.dtype != torch.float32 or out.dtype != torch.float32 or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("qgemm: fp32 rows with unit stride expected")
    if (k != packed.shape[1] * 32 or out.shape[0] != n or out.shape[1] < rows or o0 % step or o1 % step
            or not 0 <= o0 <= o1 <= rows):
        raise ValueError(f"qgemm: shapes x {tuple(x.shape)}, weight {tuple(packed.shape)}, out {tuple(out.shape)}")
    if lib.qgemm(x.data_ptr(), n, x.stride(0), k, kind, packed.data_ptr(), o0, o1, out.data_ptr(), out.stride(0)):
        raise MemoryError("qgemm: out of memory")


P4_OUTPUTS, P4_BYTES = 16, 384  # gemm.c: outputs and bytes of a P4 panel's group of 32 inputs


def qpanel_pack(packed: torch.Tensor) -> torch.Tensor:
    """A Q4 pack (uint8 [N / 4, K / 32, 96], N a multiple of 16) in gemm.c's panel order (P4: uint8
    [N / 16, K / 32, 384]), which prompt rows' matmuls read without transposing: the same values."""
    return _repack(packed, "qpanel_pack")


def qx4_pack(packed: torch.Tensor) -> torch.Tensor:
    """A Q4 pack (as `qpanel_pack` takes) in gemm.c's X4 order (uint8 [N / 16, K / 32, 384]), which
    prompt rows' matmuls on int8 activations read (qgemm kind 3): the same codes, scales and biases."""
    return _repack(packed, "qx4_pack")


def _repack(packed: torch.Tensor, name: str) -> torch.Tensor:
    import torch

    lib = library()
    assert lib is not None
    if packed.dtype != torch.uint8 or packed.dim() != 3 or packed.shape[2] != 96 or (packed.shape[0] * 4) % P4_OUTPUTS:
        raise ValueError(f"{name}: a Q4 pack of whole panels expected, got {tuple(packed.shape)}")
    src = packed.contiguous()
    n, k = src.shape[0] * 4, src.shape[1] * 32
    out = torch.empty(n // P4_OUTPUTS, src.shape[1], P4_BYTES, dtype=torch.uint8)
    getattr(lib, name)(src.data_ptr(), n, k, out.data_ptr())
    return out


def qmatmul_int8(x: torch.Tensor, packed: torch.Tensor, kind: int, out: torch.Tensor) -> None:
    """`qmatmul` on x rounded to int8 per 32 inputs (qmatmul.c `quantize_q8x` + `qmatmul_x`: the
    4-bit decode step's arithmetic on int8 activations), on the calling thread."""
    import torch

    lib = library()
    assert lib is not None
    n, k = x.shape
    rows = packed.shape[0] * 4
    if x.dtype != torch.float32 or out.dtype != torch.float32 or not x.is_contiguous() or out.stride(1) != 1:
        raise ValueError("qmatmul_int8: contiguous fp32 rows expected")
    if k != packed.shape[1] * 32 or out.shape[0] != n or out.shape[1] < rows:
        raise ValueError(f"qmatmul_int8: shapes x {tuple(x.shape)}, weight {tuple(packed.shape)}, out {tuple(out.shape)}")
    xq = torch.empty(n, k, dtype=torch.int8)
    d, sq = torch.empty(n, k // 32), torch.empty(n, k // 32)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.quantize_q8x(p(x.data_ptr()), i64(n), i64(k), i64(k), p(xq.data_ptr()), p(d.data_ptr()), p(sq.data_ptr()))
    lib.qmatmul_x(p(xq.data_ptr()), p(d.data_ptr()), p(sq.data_ptr()), i64(n), i64(k), ctypes.c_int(kind),
                  p(packed.data_ptr()), i64(0), i64(rows), p(out.data_ptr()), i64(out.stride(0)))


def amx_ready() -> bool:
    """Whether amx.c's matmul runs here: built for AMX tiles (the CPU has AMX-BF16) and the kernel
    granted the process their state (Linux >= 5.16)."""
    global _amx
    if _amx is None:
        lib = library()
        _amx = lib is not None and bool(lib.amx_ready())
    return _amx


def amx_pack(w: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] (N a multiple of 16, K of 32) in amx.c's tile layout."""
    import torch

    n, k = w.shape
    if w.dtype != torch.bfloat16 or n % 16 or k % 32:
        raise ValueError(f"amx_pack: a bf16 [16 n, 32 k] weight expected, not {w.dtype} {tuple(w.shape)}")
    return w.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, ways: int = 1) -> torch.Tensor:
    """bf16(x @ W.T + bias) for W packed by `amx_pack`: x [M, K] bf16 with contiguous rows; bias fp32
    [N] or None. Each output's bits depend on its own row and weights only (amx.c); the outputs
    are split between `ways` threads (decode.c's team)."""
    import torch

    lib = library()
    assert lib is not None
    m, k = x.shape
    n = packed.shape[0] * 16
    if x.dtype != torch.bfloat16 or x.stride(1) != 1 or k != packed.shape[1] * 32:
        raise ValueError(f"amx_linear: bf16 rows of {packed.shape[1] * 32} expected, not {x.dtype} {tuple(x.shape)}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError("amx_linear: the bias must be a contiguous fp32 [N]")
    out = torch.empty(m, n, dtype=torch.bfloat16)
    if m and lib.amx_linear_team(x.data_ptr(), m, x.stride(0), k, packed.data_ptr(),
                                 None if bias is None else bias.data_ptr(), n, out.data_ptr(), n, ways) < 0:
        raise MemoryError("amx_linear: out of memory")
    return out


def kernel_name(native: bool) -> str:
    """The attention kernel a decoder runs, for its tier fingerprint: this build (on the AMX tiles or
    not: attention.c's bf16 path), or the torch blocks."""
    return f"native-{digest()}{'-amx' if amx_ready() else ''}" if native else "block32x16"


def attention_supported(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether attention.c takes this model's attention (on a first start, while the kernels still
    build: whether they are expected to, `expected`)."""
    import torch

    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and head_dim % 16 == 0
            and expected())


SPLIT_MIN_WORK = 16384  # rows x keys below which a call is not split between threads


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, ways: int = 1,
              parallel: Callable[[list[Callable[[], None]]], None] | None = None) -> torch.Tensor:
    """Causal attention of q: [n, heads, head_dim] at positions [start, start + n) over
    k_cache, v_cache: [kv_heads, capacity, head_dim] (keys [0, start + n) valid). Returns
    [n, heads * head_dim] in q's dtype; each row's bits depend on its own query and keys only
    (attention.c). The caller checks `attention_supported`.

    ways > 1: the rows are cut into that many parts of about equal work (a row's work grows with
    its position) and `parallel` runs them at once (models/kernels/threads.py); the same bits."""
    import torch

    lib = library()
    assert lib is not None
    n, heads, hd = q.shape
    kv_heads, capacity = k_cache.shape[0], k_cache.shape[1]
    if capacity < start + n:
        raise ValueError(f"KV capacity {capacity} < {start + n} keys")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(2) != 1 or k_cache.stride(1) != hd:
        raise ValueError("K/V caches must be [kv_heads, capacity, head_dim] with contiguous rows")
    qf = q.float().contiguous()
    out = torch.empty(n, heads * hd, dtype=torch.float32)
    failed: list[int] = []
    row_floats = heads * hd

    def part(r0: int, r1: int) -> Callable[[], None]:
        def call() -> None:
            rc = lib.attention(qf.data_ptr() + 4 * r0 * row_floats, r1 - r0, start + r0, heads, kv_heads, hd,
                               k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                               int(k_cache.dtype == torch.bfloat16), hd**-0.5, out.data_ptr() + 4 * r0 * row_floats)
            if rc != 0:
                failed.append(rc)
        return call

    bounds = _split(n, start, ways) if ways > 1 and parallel is not None and n * (start + n) >= SPLIT_MIN_WORK else [0, n]
    calls = [part(a, b) for a, b in itertools.pairwise(bounds) if b > a]
    if len(calls) > 1 and parallel is not None:
        parallel(calls)
    else:
        for c in calls:
            c()
    if failed:
        raise MemoryError("native attention: out of memory")
    return out.to(q.dtype)


def _split(n: int, start: int, ways: int) -> list[int]:
    """Row boundaries [0, ..., n] cutting rows of work ~ (start + i + 1) keys into `ways` equal parts."""
    total = n * start + n * (n + 1) / 2
    bounds, done, i = [0], 0.0, 0
    for w in range(1, ways):
        while i < n and done + start + i + 1 <= total * w / ways:
            done += start + i + 1
            i += 1
        bounds.append(i)
    bounds.append(n)
    return bounds
