"""The native kernels at every instruction-set level this CPU can execute (PREFIXSERVE_NATIVE_ISA,
models/native.py): an AVX2 build (the code an AMD Zen 3 runs) gives the very bits of an AVX-512 one,
kernel by kernel and for the embedded model's prefill and 4-bit decode, and a state resumed at a
split point equals the one-shot run at each level. Each level runs in its own process
(tests/runner/isa_probe.py), since a process loads one build."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from prefixserve.models import native

# x86-64-v2 ("generic", simd.h's plain C) is too slow to run a model in a test; it is built in
# test_plain_c_level_builds
LEVELS = [level for level in ("avx512", "avx2") if level in native.executable_levels()]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _probe(level: str, out: str) -> dict:
    env = {**os.environ, "PREFIXSERVE_NATIVE_ISA": level, "PREFIXSERVE_DENSE_MATMUL": "q4",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "runner", "isa_probe.py"), out], env=env, check=True,
                   timeout=600)
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.skipif(len(LEVELS) < 2, reason="this CPU executes fewer than two of the AVX-512 and AVX2 levels")
def test_avx2_build_gives_the_avx512_bits(tmp_path):
    runs = {level: _probe(level, str(tmp_path / f"{level}.pt")) for level in LEVELS}
    wide, narrow = runs["avx512"], runs["avx2"]
    assert (wide["isa"], narrow["isa"]) == ("avx512", "avx2")
    assert wide["build"] != narrow["build"]  # two builds, two files
    keys = [k for k in wide if isinstance(wide[k], torch.Tensor)]
    assert "logits" in keys and sum(k.startswith("attention-") for k in keys) == 8
    for k in keys:
        assert torch.equal(wide[k], narrow[k]), k
    for run in runs.values():
        assert run["resumed_equal"] is True


def test_plain_c_level_builds(tmp_path):
    """x86-64-v2 (simd.h's plain C, what a CPU without AVX2 + FMA runs) compiles and loads; the
    other levels are built by the probes above."""
    code = ("import prefixserve.models.native as n, sys; lib = n.library(); "
            "sys.exit(0 if lib is not None and n.isa() == 'generic' else 1)")
    env = {**os.environ, "PREFIXSERVE_NATIVE_ISA": "generic", "PREFIXSERVE_NATIVE_DIR": str(tmp_path),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)


def test_levels_refuse_what_this_cpu_lacks(monkeypatch):
    monkeypatch.setattr(native, "_cpu_flags", lambda: "fpu sse sse2 avx avx2 fma")
    assert native.executable_levels() == ["native", "avx2", "generic"]
    monkeypatch.setenv("PREFIXSERVE_NATIVE_ISA", "avx512")
    with pytest.raises(ValueError, match="lacks avx512f"):
        native.isa()
    monkeypatch.setenv("PREFIXSERVE_NATIVE_ISA", "sse9")
    with pytest.raises(ValueError, match="must be one of"):
        native.isa()


def test_effective_flags_drop_what_the_level_leaves_out(monkeypatch):
    monkeypatch.setattr(native, "_cpu_flags", lambda: "avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile avx_vnni")
    monkeypatch.setenv("PREFIXSERVE_NATIVE_ISA", "avx2")
    assert native.effective_flags() == ["avx2", "fma"]
    monkeypatch.setenv("PREFIXSERVE_NATIVE_ISA", "avx512")
    assert native.effective_flags() == ["avx2", "fma", "avx512f", "avx512_bf16", "avx_vnni"]
    monkeypatch.setenv("PREFIXSERVE_NATIVE_ISA", "native")
    assert "amx_tile" in native.effective_flags()
