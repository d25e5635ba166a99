"""amx.c, the bf16 matmul on AMX tiles (models/kernels/amx_tiles.py): it computes the product of the bf16
rows and weights, a row's bits are its own whatever the call's other rows, their count or the
threads, and the loader takes it where the CPU has AMX unless PREFIXSERVE_DENSE_MATMUL says otherwise.
The prompt rows' native layers on its packs: tests/runner/test_native_decode.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from prefixserve.models.arch import ModelLoadError
from prefixserve.models.kernels import amx_tiles, native
from prefixserve.models.layers import TilePlan, linear
from prefixserve.models.loaders import load
from prefixserve.models.loaders.hf_folder import HFModel
from prefixserve.models.loaders.llama_weights import build_decoder
from tests.runner.test_reference import make_tiny

amx = pytest.mark.skipif(not native.amx_ready(), reason="no AMX tiles on this CPU (or no native build)")


@amx
@pytest.mark.parametrize(("n", "k"), [(48, 96), (1008, 576), (16, 32)])
def test_rows_are_their_own_and_the_product_is_the_bf16_one(n, k):
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    bias = torch.randn(n, generator=g)
    x = torch.randn(150, k, generator=g).bfloat16()
    packed = native.amx_pack(w)
    full = native.amx_linear(x, packed, bias)
    # fp32 sums of exact bf16 products, then one rounding to bf16: within a bf16 ulp of the exact value
    exact = x.double() @ w.double().T + bias.double()
    assert full.dtype == torch.bfloat16
    assert ((full.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5 * k).all()
    for rows in [*range(1, 35), 63, 64, 65, 149]:
        for offset in (0, 5, 150 - rows):
            part = native.amx_linear(x[offset : offset + rows].contiguous(), packed, bias)
            assert torch.equal(part, full[offset : offset + rows]), (rows, offset)
    for ways in (2, 3, 5):  # outputs split between threads: the same bits
        assert torch.equal(native.amx_linear(x, packed, bias, ways), full)
    strided = torch.zeros(150, k + 32, dtype=torch.bfloat16)
    strided[:, :k] = x
    assert torch.equal(native.amx_linear(strided[:, :k], packed, bias), full)  # rows with a stride


@amx
def test_the_tiles_take_a_packed_weight_and_leave_the_others_to_torch():
    g = torch.Generator().manual_seed(5)
    w, odd = torch.randn(64, 64, generator=g).bfloat16(), torch.randn(40, 48, generator=g).bfloat16()
    x = torch.randn(3, 5, 64, generator=g).bfloat16()  # any leading dims
    plain = linear(x, w)
    assert amx_tiles.pack(w) and not amx_tiles.pack(odd)  # 48 inputs: not a whole 32-input step
    y = linear(x, w)
    assert y.shape == (3, 5, 64) and torch.allclose(y.float(), plain.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(y.reshape(15, 64), native.amx_linear(x.reshape(15, 64), amx_tiles.packed(w), None))
    with pytest.raises(ValueError):
        native.amx_pack(torch.randn(40, 64).bfloat16())


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("llama"))
    make_tiny("llama", folder, intermediate_size=128, head_dim=16)
    return folder


def _loaded(folder: str, dtype: torch.dtype):
    """What load_model makes of a Llama-family model's decoder after building it (`load._widened`)."""
    hf = HFModel(folder)
    dec = build_decoder(hf.arch, hf.tensor, dtype, "cpu", TilePlan())
    load._widened(SimpleNamespace(decoder=dec))  # type: ignore[arg-type]
    return dec


def test_the_loader_takes_the_tiles_where_they_run(tiny_folder, monkeypatch):
    monkeypatch.delenv("PREFIXSERVE_DENSE_MATMUL", raising=False)
    dec = _loaded(tiny_folder, torch.bfloat16)
    # auto times the candidates (models/llama/kernel_choice.py): the tiles are one where they run, and taken
    # exactly when they won (on a tiny model under load another candidate may win)
    assert ("amx " in dec.kernel_choice) == (native.amx_ready() and load.cpu_has_native_bf16())
    assert dec.amx == ("matmul amx " in dec.kernel_choice)
    assert ("mm=amx" in dec.kernel_fingerprint()) == dec.amx  # the tiers keep its states apart
    assert not _loaded(tiny_folder, torch.float32).amx
    monkeypatch.setenv("PREFIXSERVE_DENSE_MATMUL", "bf16")  # torch's matmul
    assert not _loaded(tiny_folder, torch.bfloat16).amx
    monkeypatch.setenv("PREFIXSERVE_DENSE_MATMUL", "amx")
    if native.amx_ready():
        assert _loaded(tiny_folder, torch.bfloat16).amx
    monkeypatch.setattr(native, "amx_ready", lambda: False)
    with pytest.raises(ModelLoadError, match="AMX"):
        _loaded(tiny_folder, torch.bfloat16)
    monkeypatch.setenv("PREFIXSERVE_DENSE_MATMUL", "auto")
    assert not _loaded(tiny_folder, torch.bfloat16).amx
