"""Our decoder against `transformers`' reference implementation on tiny random-weight models (fp32)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from prefixserve.models.arch import ModelLoadError
from prefixserve.models.layers import TilePlan
from prefixserve.models.loaders.hf_folder import HFModel
from prefixserve.models.loaders.llama_weights import build_decoder
from prefixserve.runner import ModelRunner, StepItem

TINY = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 112, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rope_theta": 10000.0}


def make_tiny(kind: str, folder: str, **overrides):
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    kw = dict(TINY)
    if kind == "qwen3":
        kw["head_dim"] = 24  # qwen3 decouples head_dim from hidden / heads
    kw.update(overrides)
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kw)).eval()
    with torch.no_grad():  # random norms too, so q/k-norm and RMSNorm weights matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_matches_transformers_within_1e4(tmp_path, kind, tied):
    ref = make_tiny(kind, str(tmp_path), tie_word_embeddings=tied)
    hf = HFModel(str(tmp_path))
    assert hf.arch.qkv_bias == (kind == "qwen2") and hf.arch.qk_norm == (kind == "qwen3")
    runner = ModelRunner(build_decoder(hf.arch, hf.tensor, torch.float32, "cpu", TilePlan()))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (70,), generator=g)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]  # [70, vocab]
    # every position: feed one token at a time after a prefix, and compare each step's logits
    st = runner.new_state()
    runner.step([StepItem(st, ids[:40].tolist())])
    assert (st.logits - want[39]).abs().max().item() < 1e-4
    for i in range(40, 70):
        runner.step([StepItem(st, [int(ids[i])])])
        diff = (st.logits - want[i]).abs().max().item()
        assert diff < 1e-4, f"{kind} position {i}: max |diff| {diff:.2e}"


def test_missing_and_corrupt_files_give_clear_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        HFModel(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="cannot read safetensors"):
        HFModel(str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    make_tiny("llama", str(tmp_path / "ok"))
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "ok" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="not supported"):
        HFModel(str(tmp_path / "ok"))


def test_gguf_errors(tmp_path):
    from prefixserve.models import load_model

    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "nope.gguf"), torch.float32)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        load_model(str(bad), torch.float32)
