"""Our qwen3_5 modules against transformers' Qwen3_5ForCausalLM on the same tiny random weights:
logits within 1e-4 (fp32) at every position; unsupported variants refused by name."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from prefixserve.models import load_model
from prefixserve.models.arch import ModelLoadError
from prefixserve.models.hybrid.decoder import HybridDecoder
from prefixserve.runner import ModelRunner, StepItem
from tests.hybrid.tiny import VOCAB, make_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen35"))
    ref = make_model(folder)
    return folder, ref


def _all_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits of every position, each computed by feeding one more token (so every position's row is returned)."""
    state = runner.new_state(len(ids))
    rows = []
    for t in ids:
        runner.step([StepItem(state, [t])])
        rows.append(state.logits)
    return torch.stack(rows)


@pytest.mark.parametrize("length", [1, 37, 64, 150])
def test_logits_match_transformers_every_position(tiny, length):
    folder, ref = tiny
    m = load_model(folder, torch.float32)
    assert isinstance(m.decoder, HybridDecoder)
    runner = ModelRunner(m.decoder, 1)
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].float()
    # one-pass prefill: last position; token by token: every position
    state = runner.new_state(length)
    runner.step([StepItem(state, ids)])
    assert (state.logits - expected[-1]).abs().max().item() < 1e-4
    got = _all_logits(runner, ids)
    err = (got - expected).abs().max().item()
    assert err < 1e-4, err
    assert expected.abs().max().item() > 0.5  # the comparison is not between near-zero logits


def test_tied_embeddings_and_grouped_heads(tmp_path):
    folder = str(tmp_path / "tied")
    ref = make_model(folder, layers=5, tie=True, lin_k_heads=1, lin_v_heads=4, kv_heads=1, seed=3, with_tokenizer=True)
    m = load_model(folder, torch.float32)
    runner = ModelRunner(m.decoder, 1)
    ids = list(range(3, 3 + 90))
    state = runner.new_state(len(ids))
    runner.step([StepItem(state, ids)])
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0, -1].float()
    assert (state.logits - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("model_type,needle", [
    ("qwen3_5_moe", "MoE"), ("qwen3_5_moe_text", "MoE"), ("qwen3_next", "qwen3_next"),
])
def test_unsupported_variants_are_named(tiny, tmp_path, model_type, needle):
    folder, _ = tiny
    other = tmp_path / model_type
    other.mkdir()
    for fn in os.listdir(folder):
        os.symlink(os.path.join(folder, fn), other / fn)
    cfg = json.loads(Path(folder, "config.json").read_text())
    cfg["model_type"] = model_type
    os.unlink(other / "config.json")
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=needle):
        load_model(str(other), torch.float32)


def test_multimodal_checkpoint_layout_loads_the_text_model(tiny, tmp_path):
    """model_type qwen3_5 with a nested text_config and weights under model.language_model. (the
    vision tower's tensors ignored) gives the same logits bit for bit as the plain layout."""
    from safetensors.torch import load_file, save_file

    folder, _ = tiny
    cfg = json.loads(Path(folder, "config.json").read_text())
    nested = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": cfg}
    out = tmp_path / "mm"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(nested))
    weights = load_file(os.path.join(folder, "model.safetensors"))
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in weights.items()}
    renamed["model.visual.patch_embed.weight"] = torch.zeros(2, 2)
    save_file(renamed, str(out / "model.safetensors"))
    for fn in os.listdir(folder):
        if fn.startswith("tokenizer") or fn == "special_tokens_map.json":
            os.symlink(os.path.join(folder, fn), out / fn)
    ids = list(range(5, 85))
    logits = []
    for path in (folder, str(out)):
        runner = ModelRunner(load_model(path, torch.float32).decoder, 1)
        st = runner.new_state(len(ids))
        runner.step([StepItem(st, ids)])
        logits.append(st.logits)
    assert torch.equal(logits[0], logits[1])
