"""The native kernels at every instruction-set level this CPU can execute (PREFIXSERVE_NATIVE_ISA,
models/kernels/isa.py): an AVX2 build (the code an AMD Zen 3 runs) gives the very bits of an AVX-512 one,
kernel by kernel and for the embedded model's prefill and 4-bit decode, and a state resumed at a
split point equals the one-shot run at each level. Each level runs in its own process
(tests/runner/isa_probe.py), since a process loads one build."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from prefixserve.models.kernels import isa, native

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
    assert {"logits", "logits_int8", "logits_x8"} <= set(keys) and sum(k.startswith("attention-") for k in keys) == 8
    for k in keys:
        assert torch.equal(wide[k], narrow[k]), k
    for run in runs.values():
        assert run["resumed_equal"] is True and run["resumed_equal_x8"] is True
        assert not torch.equal(run["logits_x8"], run["logits"][0])  # int8 rows: other bits than fp32 rows'
        assert int(torch.argmax(run["logits_x8"])) == int(torch.argmax(run["logits"][0]))


def test_plain_c_level_builds(tmp_path):
    """x86-64-v2 (simd.h's plain C, what a CPU without AVX2 + FMA runs) compiles and loads; the
    other levels are built by the probes above."""
    code = ("import prefixserve.models.kernels.native as n, sys; lib = n.library(); "
            "sys.exit(0 if lib is not None and n.isa() == 'generic' else 1)")
    env = {**os.environ, "PREFIXSERVE_NATIVE_ISA": "generic", "PREFIXSERVE_NATIVE_DIR": str(tmp_path),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)


def test_levels_refuse_what_this_cpu_lacks(monkeypatch):
    monkeypatch.setattr(isa, "cpu_flags", lambda: "fpu sse sse2 avx avx2 fma")
    assert isa.executable_levels() == ["native", "avx2", "generic"]
    monkeypatch.setenv("PREFIXSERVE_NATIVE_ISA", "avx512")
    with pytest.raises(ValueError, match="lacks avx512f"):
        isa.isa()
    monkeypatch.setenv("PREFIXSERVE_NATIVE_ISA", "sse9")
    with pytest.raises(ValueError, match="must be one of"):
        isa.isa()


def test_effective_flags_drop_what_the_level_leaves_out(monkeypatch):
    monkeypatch.setattr(isa, "cpu_flags", lambda: "avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile avx_vnni")
    monkeypatch.setenv("PREFIXSERVE_NATIVE_ISA", "avx2")
    assert isa.effective_flags() == ["avx2", "fma"]
    monkeypatch.setenv("PREFIXSERVE_NATIVE_ISA", "avx512")
    assert isa.effective_flags() == ["avx2", "fma", "avx512f", "avx512_bf16", "avx_vnni"]
    monkeypatch.setenv("PREFIXSERVE_NATIVE_ISA", "native")
    assert "amx_tile" in isa.effective_flags()


def _at_every_level(code: str, tmp_path) -> dict[str, dict]:
    """`code` (saving its outputs to the path it is given) run once per level this CPU executes, each
    in its own process; its saved outputs by level."""
    runs = {}
    for level in native.executable_levels():
        env = {**os.environ, "PREFIXSERVE_NATIVE_ISA": level,
               "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        path = str(tmp_path / f"{level}.pt")
        subprocess.run([sys.executable, "-c", code, path], env=env, check=True, timeout=600)
        runs[level] = torch.load(path)
    assert "generic" in runs and len(runs) >= 2
    return runs


_INT8_CODE = """
import sys, torch
from prefixserve.models.kernels import native
g = torch.Generator().manual_seed(11)
out = {"isa": native.isa()}
for kind, (n, k, rows) in ((0, (3, 576, 64)), (0, (1, 1536, 32)), (1, (5, 576, 48))):
    packed = torch.randint(0, 256, (rows // 4, k // 32, 96 if kind == 0 else 144), dtype=torch.uint8, generator=g)
    scales = torch.rand(rows // 4, k // 32, 8 if kind == 0 else 4, generator=g) * 0.02
    if kind == 0:
        scales[:, :, 4:] -= 0.16  # bias about -8 codes' worth, as GGUF Q4_1 has
    at = 64 if kind == 0 else 128
    packed[:, :, at:at + scales.shape[2] * 4] = scales.contiguous().view(torch.uint8).view(rows // 4, k // 32, -1)
    x = torch.randn(n, k, generator=g)
    x[0, :32] = 0.0  # a group of zeros: scale 0, codes 0
    y, ref = torch.empty(n, rows), torch.empty(n, rows)
    native.qmatmul_int8(x, packed, kind, y)
    native.qmatmul(x, packed, kind, ref)
    out[f"{kind}-{n}-{k}"] = (y, ref)
torch.save(out, sys.argv[1])
"""


def test_int8_dot_products_give_one_set_of_bits_at_every_level(tmp_path):
    """The decode step's int8-activation matmuls (qmatmul.c `qmatmul_x`): AVX2's maddubs, AVX-512
    VNNI's dpbusd and the plain C loop give the same bits (exact integer sums, the same float steps),
    and stay within int8 rounding of the fp32 dot products."""
    runs = _at_every_level(_INT8_CODE, tmp_path)
    first = runs[native.executable_levels()[0]]
    for level, run in runs.items():
        assert run["isa"] == level
        for key, (y, ref) in ((k, v) for k, v in run.items() if k != "isa"):
            assert torch.equal(y, first[key][0]), (level, key)
            assert torch.equal(ref, first[key][1]), (level, key)
            err = ((y - ref).norm() / ref.norm()).item()
            assert 0 < err < 2e-2, (level, key, err)


_GEMM_CODE = """
import sys, torch
from prefixserve.models.kernels import native
g = torch.Generator().manual_seed(12)
out = {"isa": native.isa()}
for kind, (n, k, rows) in ((0, (23, 576, 48)), (0, (7, 416, 32)), (1, (13, 576, 48))):
    packed = torch.randint(0, 256, (rows // 4, k // 32, 96 if kind == 0 else 144), dtype=torch.uint8, generator=g)
    scales = torch.rand(rows // 4, k // 32, 8 if kind == 0 else 4, generator=g) * 0.02
    if kind == 0:
        scales[:, :, 4:] -= 0.16
    at = 64 if kind == 0 else 128
    packed[:, :, at:at + scales.shape[2] * 4] = scales.contiguous().view(torch.uint8).view(rows // 4, k // 32, -1)
    x = torch.randn(n, k, generator=g)
    x[0, :32] = 0.0  # a group of zeros (on int8 rows: scale 0, codes 0)
    y = torch.empty(n, rows)
    native.qgemm(x, packed, kind, y)
    out[f"{kind}-{n}-{k}"] = y
    if kind == 0:  # the panel-ordered copy prompt rows read (gemm.c P4): the same weights, the same bits
        p4 = torch.full((n, rows), float("nan"))
        native.qgemm(x, native.qpanel_pack(packed), 2, p4, (0, 16))
        native.qgemm(x, native.qpanel_pack(packed), 2, p4, (16, rows))
        out[f"2-{n}-{k}"] = p4
        x4 = torch.full((n, rows), float("nan"))
        native.qgemm(x, native.qx4_pack(packed), 3, x4, (0, 16))
        native.qgemm(x, native.qx4_pack(packed), 3, x4, (16, rows))
        out[f"3-{n}-{k}"] = x4
torch.save(out, sys.argv[1])
"""


def test_prompt_matmuls_give_one_set_of_bits_at_every_level(tmp_path):
    """Prompt rows' matmuls (gemm.c `qgemm`) on Q4, on Q4's panel-ordered copy (P4), on Q8, and on Q4's
    X4 copy with the rows rounded to int8: the AVX-512 (VNNI), AVX2 and plain C bodies give the same
    bits (each output one fused chain over K in order; X4's exact integer sums, then one chain over the
    groups), and P4 gives Q4's bits, whatever the output range a thread takes."""
    runs = _at_every_level(_GEMM_CODE, tmp_path)
    first = runs[native.executable_levels()[0]]
    for level, run in runs.items():
        assert run["isa"] == level
        for key, y in ((k, v) for k, v in run.items() if k != "isa"):
            assert torch.equal(y.view(torch.int32), first[key].view(torch.int32)), (level, key)
        for key in (k for k in run if k.startswith("0-")):
            assert torch.equal(run[key].view(torch.int32), run["2" + key[1:]].view(torch.int32)), (level, key)
            x8 = run["3" + key[1:]]
            err = ((x8 - run[key]).norm() / run[key].norm()).item()
            assert 0 < err < 2e-2, (level, key, err)
