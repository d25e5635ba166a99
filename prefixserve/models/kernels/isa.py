"""The instruction-set level the native kernels are built for, and the CPU's flags it is checked against.

PREFIXSERVE_NATIVE_ISA holds the build to a level the CPU can execute, so one machine tests the code
every CPU class runs (docs/exactness.md, "Every CPU class"): `native` (the default: all the CPU has),
`avx512` (no AMX: an AMD Zen 4's set), `avx2` (x86-64-v3: AVX2 + FMA, an AMD Zen 3's set), `generic`
(x86-64-v2: simd.h's plain C). `effective_flags()` is the CPU's flags less what the level leaves out;
the loader reads bf16 arithmetic from it. Importable without torch.
"""

from __future__ import annotations

import os

# PREFIXSERVE_NATIVE_ISA -> (-march flags, flag prefixes the level leaves out, flags the CPU needs for it)
ISA_LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "native": (("-march=native",), (), ()),
    "avx512": (("-march=native", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"), ("amx",), ("avx512f",)),
    "avx2": (("-march=x86-64-v3",), ("avx512", "amx", "avx_vnni"), ("avx2", "fma")),
    "generic": (("-march=x86-64-v2",), ("avx512", "amx", "avx_vnni", "avx2", "fma", "avx", "f16c"), ()),
}


def cpu_info() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("model name", "flags", ...); {} where unreadable."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def isa() -> str:
    """The instruction-set level of the build (PREFIXSERVE_NATIVE_ISA, default native). Raises
    ValueError for a level this module does not know or this CPU cannot execute."""
    level = os.environ.get("PREFIXSERVE_NATIVE_ISA", "native") or "native"
    if level not in ISA_LEVELS:
        raise ValueError(f"PREFIXSERVE_NATIVE_ISA must be one of {', '.join(ISA_LEVELS)}, not {level!r}")
    missing = [f for f in ISA_LEVELS[level][2] if f not in cpu_flags().split()]
    if missing:
        raise ValueError(f"PREFIXSERVE_NATIVE_ISA={level}: this CPU lacks {', '.join(missing)}")
    return level


def executable_levels() -> list[str]:
    """The ISA levels this CPU can run, widest first (tests run the kernels at each)."""
    flags = cpu_flags().split()
    return [name for name, (_, _, needs) in ISA_LEVELS.items() if all(f in flags for f in needs)]


def effective_flags() -> list[str]:
    """The CPU's flags less those the ISA level leaves out: what the build (and a model's choice of
    bf16 arithmetic) may use."""
    try:
        dropped = ISA_LEVELS[isa()][1]
    except ValueError:
        dropped = ()
    return [f for f in cpu_flags().split() if not f.startswith(dropped)]


def cpu_flags() -> str:
    """The CPU's flags, space-separated ("" where /proc/cpuinfo is unreadable)."""
    return cpu_info().get("flags", "")


def march_flags() -> tuple[str, ...]:
    """The -march flags of the build's ISA level (raises ValueError as `isa` does)."""
    return ISA_LEVELS[isa()][0]
