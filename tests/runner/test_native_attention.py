"""The native attention kernel (models/kernels/native.py, attention.c): it computes what attention is, and a
row's bits depend on its own query and keys only -- the exactness contract's attention rule by
construction (docs/exactness.md)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

from prefixserve.models.kernels import native
from prefixserve.models.layers import block_attention

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the native kernels are not built")


def cache(kv_heads: int, keys: int, hd: int, dtype: torch.dtype, capacity: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.zeros(2, kv_heads, capacity, hd, dtype=dtype)
    kv[:, :, :keys] = torch.randn(2, kv_heads, keys, hd, generator=g).to(dtype)
    return kv


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal softmax attention in float64."""
    n, heads, hd = q.shape
    rep = heads // k.shape[0]
    kk = k[:, : start + n].double().repeat_interleave(rep, 0)  # [heads, keys, hd]
    vv = v[:, : start + n].double().repeat_interleave(rep, 0)
    s = torch.einsum("nhd,hkd->hnk", q.double(), kk) * hd**-0.5
    pos = torch.arange(start, start + n).view(1, n, 1)
    s = s.masked_fill(torch.arange(start + n).view(1, 1, -1) > pos, float("-inf"))
    return torch.einsum("hnk,hkd->nhd", torch.softmax(s, -1), vv).reshape(n, heads * hd)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "hd"), [(9, 3, 64), (4, 4, 16), (8, 2, 128), (6, 1, 32), (2, 1, 80)])
def test_attention_is_attention(dtype, heads, kv_heads, hd):
    keys, start = 300, 211
    kv = cache(kv_heads, keys, hd, dtype, capacity=352)
    q = torch.randn(keys - start, heads, hd, generator=torch.Generator().manual_seed(1)).to(dtype) * 2
    got = native.attention(q, kv[0], kv[1], start)
    want = reference(q, kv[0], kv[1], start)
    # bf16: the result is rounded to bf16 (on AMX tiles the queries and weights too: attention.c)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert got.dtype == dtype and got.shape == (keys - start, heads * hd)
    assert (got.double() - want).abs().max().item() < tol
    # and agrees with the torch formulation it replaces: both within tol of the truth, so within 2 tol
    assert (got.double() - block_attention(q, kv[0], kv[1], start).double()).abs().max().item() < 2 * tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_bits_depend_on_its_own_query_and_keys_only(dtype):
    """Alone, in chunks that start anywhere, beside any neighbours, with any capacity and any garbage
    past its last key: the same bits. 1,100 keys span three of the kernel's 512-key stretches, and a
    full call's 3,300 (row, head) pairs per kv head many of its 192-pair passes."""
    heads, kv_heads, hd, keys = 9, 3, 64, 1100
    kv = cache(kv_heads, keys, hd, dtype, capacity=1152)
    q = torch.randn(keys, heads, hd, generator=torch.Generator().manual_seed(2)).to(dtype)
    full = native.attention(q, kv[0], kv[1], 0)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert (full.double() - reference(q, kv[0], kv[1], 0)).abs().max().item() < tol  # across the stretches too
    bigger = torch.full((2, kv_heads, 2048, hd), 1e30).to(dtype)  # huge finite values past the keys
    for row in (0, 1, 15, 16, 17, 255, 300, 511, 512, 513, 560, 1023, 1099):
        assert torch.equal(native.attention(q[row : row + 1], kv[0], kv[1], row)[0], full[row])
        for lo in (max(0, row - 40), max(0, row - 3)):
            hi = min(keys, row + 9)
            assert torch.equal(native.attention(q[lo:hi], kv[0], kv[1], lo)[row - lo], full[row])
        bigger[:, :, : row + 1] = kv[:, :, : row + 1]
        assert torch.equal(native.attention(q[row : row + 1], bigger[0], bigger[1], row)[0], full[row])
    # another query at a neighbouring row does not change this one's result
    q2 = q.clone()
    q2[101] = -q2[101]
    assert torch.equal(native.attention(q2[90:120], kv[0], kv[1], 90)[100 - 90], full[100])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_max_that_grows_stretch_after_stretch_is_rescaled_exactly_enough(dtype):
    """The softmax goes stretch by stretch (512 keys): where a later stretch holds a larger score, the
    weights and sums so far are rescaled. Keys that grow along the context move the max in every
    stretch, by up to ~60 in the exponent; the result is still softmax attention (float64 reference),
    and still a row's own: in chunks, alone, or beside other rows."""
    heads, kv_heads, hd, keys = 4, 2, 32, 1700
    kv = cache(kv_heads, keys, hd, torch.float32, capacity=1728)
    q = torch.randn(keys, heads, hd, generator=torch.Generator().manual_seed(4)).abs()
    kv[0, :, :keys] = kv[0, :, :keys].abs() * torch.linspace(0.2, 3.0, keys).view(1, keys, 1)
    kv, q = kv.to(dtype), q.to(dtype)
    full = native.attention(q, kv[0], kv[1], 0)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    want = reference(q, kv[0], kv[1], 0)
    assert (full.double() - want).abs().max().item() < tol
    for lo, hi in ((0, 700), (500, 1030), (1023, 1025), (1536, 1700)):
        assert torch.equal(native.attention(q[lo:hi], kv[0], kv[1], lo), full[lo:hi])


def test_bad_caches_are_refused():
    kv = cache(3, 40, 64, torch.float32, capacity=64)
    q = torch.randn(8, 9, 64)
    with pytest.raises(ValueError, match="capacity"):
        native.attention(q, kv[0], kv[1], 60)
    with pytest.raises(ValueError, match="contiguous"):
        native.attention(q, kv[0].transpose(1, 2), kv[1].transpose(1, 2), 0)


def test_unsupported_shapes_and_devices_use_the_torch_formulation():
    assert native.attention_supported(64, torch.bfloat16, torch.device("cpu"))
    assert not native.attention_supported(8, torch.float32, torch.device("cpu"))  # head_dim not a multiple of 16
    assert not native.attention_supported(64, torch.float16, torch.device("cpu"))
    assert not native.attention_supported(64, torch.float32, torch.device("meta"))


def _library_in_fresh_process(tmp_path, **env: str) -> str:
    code = "from prefixserve.models.kernels import native; print(native.library() is not None)"
    run_env = {**os.environ, "PREFIXSERVE_NATIVE_DIR": str(tmp_path / "build"), **env}
    out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, timeout=300,
                         check=True)
    return out.stdout.strip() + "\n" + out.stderr


def test_no_compiler_or_a_failed_build_falls_back_with_a_warning(tmp_path):
    out = _library_in_fresh_process(tmp_path, CC="/bin/false")
    assert out.startswith("False") and "build failed" in out
    out = _library_in_fresh_process(tmp_path, PREFIXSERVE_NATIVE="0")
    assert out.startswith("False")
    out = _library_in_fresh_process(tmp_path)
    assert out.startswith("True")
    built = os.listdir(tmp_path / "build")
    assert len([f for f in built if f.endswith(".so")]) == 1 and not [f for f in built if f.startswith(".build-")]
    assert _library_in_fresh_process(tmp_path).startswith("True")  # the second process loads the built file


def test_a_call_split_between_threads_gives_the_same_bits():
    from prefixserve.models.kernels.threads import KernelThreads

    kt = KernelThreads()
    kv = cache(3, 900, 64, torch.bfloat16, capacity=960)
    q = torch.randn(300, 9, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    whole = native.attention(q, kv[0], kv[1], 600)
    for ways in (2, 3, 5):
        assert torch.equal(native.attention(q, kv[0], kv[1], 600, ways, kt.parallel), whole)
    bounds = native._split(300, 600, 2)
    work = [sum(600 + i + 1 for i in range(a, b)) for a, b in itertools.pairwise(bounds)]
    assert bounds[0] == 0 and bounds[-1] == 300 and abs(work[0] - work[1]) <= 2 * 900  # equal halves, to within a row or two
    assert native._split(1, 5000, 2) == [0, 0, 1]  # one row: one part runs it, the empty one is skipped
