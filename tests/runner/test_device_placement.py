"""Every tensor of a forward pass lives on the model's device (CI has no GPU; `make test-cuda` runs the
exactness tests on one). The decoders run here on PyTorch's `meta` device, which has shapes but no
values and refuses to mix with a CPU tensor, so a mask or index built on the CPU fails as it would on
CUDA: before this test, block attention built its causal mask on the CPU and the server could not
answer one request on a GPU. Reading a meta value (`.item()`, `int()`, `.cpu()`) is patched to give
zeros, so the runner's host-side bookkeeping goes on; the values are meaningless, the placement is not."""

from __future__ import annotations

import pytest
import torch

from prefixserve.models.layers import TilePlan
from prefixserve.models.loaders.hf_folder import HFModel
from prefixserve.models.loaders.hybrid_folder import HybridHFModel, build_hybrid
from prefixserve.models.loaders.llama_weights import build_decoder
from prefixserve.runner import ModelRunner, StepItem
from prefixserve.runner.codec import SnapshotCodec
from tests.hybrid.tiny import make_model
from tests.runner.test_reference import make_tiny


@pytest.fixture
def meta_values(monkeypatch):
    """Host reads of meta tensors give zeros (positions: 300, within every state's capacity below)."""
    cpu, item = torch.Tensor.cpu, torch.Tensor.item

    def fake_item(t):
        if t.device.type == "meta":
            return 0.0 if t.is_floating_point() else 300
        return item(t)

    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: torch.zeros(t.shape, dtype=t.dtype)
                        if t.device.type == "meta" else cpu(t, *a, **k))
    monkeypatch.setattr(torch.Tensor, "item", fake_item)
    monkeypatch.setattr(torch.Tensor, "__int__", lambda t: int(fake_item(t)))
    monkeypatch.setattr(torch.Tensor, "__index__", lambda t: int(fake_item(t)))
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: float(fake_item(t)))
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: bool(fake_item(t)))


def _exercise(runner: ModelRunner) -> None:
    """Prefill across attention tiles and blocks, batched decode, and prefill beside decode rows."""
    a, b = runner.new_state(600), runner.new_state(600)
    runner.step([StepItem(a, list(range(1, 140)))])
    runner.step([StepItem(b, list(range(1, 20)))])
    for _ in range(3):
        runner.step([StepItem(a, [5], decode=True), StepItem(b, [6], decode=True)])
    runner.step([StepItem(a, list(range(3, 70))), StepItem(b, [7], decode=True)])
    assert a.kv.device.type == "meta" and a.logits is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_and_hybrid_forward_stay_on_the_models_device(tmp_path, meta_values, dtype):
    make_tiny("llama", str(tmp_path / "llama"))
    hf = HFModel(str(tmp_path / "llama"))
    _exercise(ModelRunner(build_decoder(hf.arch, hf.tensor, dtype, "meta", TilePlan()), 1))
    make_model(str(tmp_path / "hybrid"), with_tokenizer=False)
    _exercise(ModelRunner(build_hybrid(HybridHFModel(str(tmp_path / "hybrid")), dtype, "meta", TilePlan()), 1))


def test_a_lower_tier_state_is_decoded_onto_the_models_device(tmp_path):
    """The disk and Redis tiers store bytes; what they load goes back where the sessions live."""
    make_model(str(tmp_path), with_tokenizer=False)
    runner = ModelRunner(build_hybrid(HybridHFModel(str(tmp_path)), torch.float32, "cpu", TilePlan()), 1)
    st = runner.new_state(200)
    runner.step([StepItem(st, list(range(1, 150)))])
    meta, payload = SnapshotCodec().encode(st.snapshot())
    back = SnapshotCodec("meta").decode(meta, memoryview(bytearray(payload)), 149)
    tensors = [p.kv for p in back.kv.pieces] + [back.recurrent.conv, back.recurrent.cell, back.recurrent.delta]
    assert all(t.device.type == "meta" for t in tensors)
    assert back.logits is not None and back.logits.device.type == "cpu"  # the runner keeps logits on the CPU
