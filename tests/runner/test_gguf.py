"""GGUF loading: llama.cpp's q/k permutation undone, every tested quantisation type dequantised."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixserve.models.arch import ModelLoadError
from prefixserve.models.layers import TilePlan
from prefixserve.models.loaders.gguf import GGUFModel
from prefixserve.models.loaders.llama_weights import build_decoder
from prefixserve.runner import ModelRunner, StepItem
from tests.runner.test_reference import TINY, make_tiny

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows of llama models."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: str, hf_model, qtype=None) -> dict[str, np.ndarray]:
    """Write the HF model as a llama GGUF; matrices in `qtype` (None = F32). Returns the expected fp32 tensors."""
    c = hf_model.config
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_theta if hasattr(c, "rope_theta") else 10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    sd = {k: v.float().numpy() for k, v in hf_model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
                 "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
                 "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                 "mlp.down_proj.weight": "ffn_down.weight"}
    expected = {}
    for hf_name, arr in sd.items():
        if hf_name.startswith("model.layers."):
            _, _, i, rest = hf_name.split(".", 3)
            gname = f"blk.{i}.{per_layer[rest]}"
        else:
            gname = names[hf_name]
        out = arr
        if rest_is(hf_name, "q_proj.weight"):
            out = _permute(arr, c.num_attention_heads)
        elif rest_is(hf_name, "k_proj.weight"):
            out = _permute(arr, c.num_key_value_heads)
        if qtype is not None and arr.ndim == 2:
            data = gguf.quants.quantize(out, qtype)
            w.add_tensor(gname, data, raw_dtype=qtype)
            deq = gguf.quants.dequantize(data, qtype)
            expected[hf_name] = _unpermute_like(deq, hf_name, c)
        else:
            w.add_tensor(gname, out.astype(np.float32))
            expected[hf_name] = arr
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def rest_is(name: str, suffix: str) -> bool:
    return name.endswith(suffix)


def _unpermute_like(arr: np.ndarray, hf_name: str, c) -> np.ndarray:
    if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = c.num_attention_heads if hf_name.endswith("q_proj.weight") else c.num_key_value_heads
        return arr.reshape(heads, arr.shape[0] // heads // 2, 2, *arr.shape[1:]).swapaxes(1, 2).reshape(arr.shape)
    return arr


def test_f32_gguf_matches_transformers(tmp_path):
    ref = make_tiny("llama", str(tmp_path / "hf"))
    write_tiny_gguf(str(tmp_path / "tiny.gguf"), ref)
    gm = GGUFModel(str(tmp_path / "tiny.gguf"))
    assert gm.arch.num_layers == TINY["num_hidden_layers"] and not gm.arch.tie_embeddings
    runner = ModelRunner(build_decoder(gm.arch, gm.tensor, torch.float32, "cpu", TilePlan()))
    ids = torch.randint(0, TINY["vocab_size"], (50,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids[None]).logits[0, -1]
    st = runner.new_state()
    runner.step([StepItem(st, ids.tolist())])
    assert (st.logits - want).abs().max().item() < 1e-4


# Q4_0/Q4_1/Q8_0 need rows that are multiples of 32, hence intermediate_size=128; BF16/F16 any.
@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantised_types_dequantise_exactly(tmp_path, qtype):
    ref = make_tiny("llama", str(tmp_path / "hf"), intermediate_size=128)
    expected = write_tiny_gguf(str(tmp_path / "q.gguf"), ref, qtype)
    gm = GGUFModel(str(tmp_path / "q.gguf"))
    for name, arr in expected.items():
        got = gm.tensor(name)
        assert got is not None, name
        assert torch.equal(got, torch.from_numpy(np.asarray(arr, dtype=np.float32))), name
    build_decoder(gm.arch, gm.tensor, torch.float32, "cpu", TilePlan())  # assembles without error


def test_unsupported_type_is_named(tmp_path, monkeypatch):
    ref = make_tiny("llama", str(tmp_path / "hf"), intermediate_size=128)
    write_tiny_gguf(str(tmp_path / "q.gguf"), ref, Q.Q8_0)
    gm = GGUFModel(str(tmp_path / "q.gguf"))

    def refuse(data, qtype):
        raise NotImplementedError(f"no dequantisation for {qtype.name}")

    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    monkeypatch.setattr(gguf.quants, "_type_traits", {})  # the block code loaders/gguf.dequantize runs itself
    with pytest.raises(ModelLoadError, match="Q8_0"):
        gm.tensor("model.layers.0.self_attn.q_proj.weight")


def test_small_pages_turns_numpys_huge_pages_off_while_it_lasts_and_restores_them() -> None:
    """`small_pages` (around every model load): numpy's huge-page advice is off inside, as it was after,
    an exception included."""
    from numpy._core.multiarray import _set_madvise_hugepage

    from prefixserve.models.loaders.gguf import small_pages

    def current() -> bool:
        was = _set_madvise_hugepage(True)
        _set_madvise_hugepage(was)
        return bool(was)

    for before in (True, False):
        _set_madvise_hugepage(before)
        try:
            with small_pages():
                assert current() is False
            assert current() is before
            with pytest.raises(KeyError), small_pages():
                raise KeyError("x")
            assert current() is before
        finally:
            _set_madvise_hugepage(True)
