"""GGUF `qwen35` files: a tiny GGUF written with the `gguf` package the way llama.cpp's converter
writes Qwen3.5 (norms as 1 + w, ssm_a = -exp(A_log), V heads reordered to tiled order) loads to the
same model as the HF folder it came from; the MoE sibling is refused by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from prefixserve.models import load_model
from prefixserve.models.arch import ModelLoadError
from prefixserve.models.layers import TilePlan
from prefixserve.models.loaders.hybrid_folder import HybridHFModel, build_hybrid
from prefixserve.models.loaders.hybrid_gguf import HybridGGUFModel
from prefixserve.runner import ModelRunner, StepItem
from tests.hybrid.tiny import make_model

torch.set_num_threads(1)


def _grouped_to_tiled(w: torch.Tensor, dim: int, hk: int, r: int, d: int) -> torch.Tensor:
    shape = list(w.shape)
    return w.reshape(*shape[:dim], hk, r, d, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)


def write_gguf(model, path: str, arch: str = "qwen35") -> None:
    """The converter's transformations, written out independently of the loader under test."""
    import gguf

    c = model.config
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = hv // hk
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, c.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(hk)
    w.add_ssm_time_step_rank(hv)
    w.add_ssm_inner_size(hv * dv)
    w.add_full_attention_interval(4)
    for name, t in model.state_dict().items():
        t = t.float().clone()
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        if name.endswith(".dt_bias"):
            name = name.replace(".dt_bias", ".dt_proj.bias")
        if "conv1d" in name:
            t = t.squeeze(1)
        if hk != hv and "linear_attn." in name:
            if "in_proj_qkv" in name or "conv1d" in name:
                t = torch.cat([t[: 2 * hk * dk], _grouped_to_tiled(t[2 * hk * dk :], 0, hk, r, dv)])
            elif "in_proj_z" in name:
                t = _grouped_to_tiled(t, 0, hk, r, dv)
            elif "in_proj_b" in name or "in_proj_a" in name or "A_log" in name or "dt_proj" in name:
                t = _grouped_to_tiled(t.reshape(t.shape[0], -1), 0, hk, r, 1).reshape(t.shape)
            elif "out_proj" in name:
                t = _grouped_to_tiled(t, 1, hk, r, dv)
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        w.add_tensor(gname, np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("lin_k_heads", [2, 4])  # 2 < 4 value heads: the V-head reorder is undone
def test_gguf_loads_the_same_model_as_the_hf_folder(tmp_path, lin_k_heads):
    folder = str(tmp_path / "hf")
    model = make_model(folder, seed=5, lin_k_heads=lin_k_heads, with_tokenizer=False)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(model, path)
    plan = TilePlan()
    a = build_hybrid(HybridHFModel(folder), torch.float32, "cpu", plan)
    g = HybridGGUFModel(path)
    assert dataclasses.replace(g.arch, rms_eps=a.arch.rms_eps) == a.arch  # GGUF keeps eps as f32
    assert abs(g.arch.rms_eps - a.arch.rms_eps) < 1e-12
    b = build_hybrid(g, torch.float32, "cpu", plan)  # type: ignore[arg-type]
    ids = list(range(7, 7 + 100))
    out = []
    for dec in (a, b):
        runner = ModelRunner(dec, 1)
        st = runner.new_state(len(ids))
        runner.step([StepItem(st, ids)])
        out.append(st.logits)
    # -exp / log round trip of A_log costs an ulp or so; everything else is the same numbers
    assert (out[0] - out[1]).abs().max().item() < 1e-5
    assert int(out[0].argmax()) == int(out[1].argmax())


def test_gguf_moe_sibling_is_refused_by_name(tmp_path):
    model = make_model(str(tmp_path / "hf"), seed=6, with_tokenizer=False)
    path = str(tmp_path / "moe.gguf")
    write_gguf(model, path, arch="qwen35moe")
    with pytest.raises(ModelLoadError, match="MoE"):
        load_model(path, torch.float32)
