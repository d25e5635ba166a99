"""4-bit decode rows (models/kernels/int4.py): the GGUF codes are read exactly, the kernel's rows are
independent of the batch, and the model decoded this way stays batch-invariant and close to dense."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from prefixserve.models.arch import ModelLoadError
from prefixserve.models.kernels.int4 import Codes, dequantize, int4_linear, pack
from prefixserve.models.layers import TilePlan
from prefixserve.models.loaders.gguf import GGUFModel
from prefixserve.models.loaders.load import gguf_decoder
from prefixserve.runner import ModelRunner, StepItem
from tests.runner.test_gguf import Q, write_tiny_gguf
from tests.runner.test_reference import TINY, make_tiny

pytestmark = pytest.mark.skipif(not hasattr(torch, "_weight_int4pack_mm_for_cpu"), reason="no int4 CPU kernel")


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    """A tiny llama GGUF with Q4_1 matrices (embedding and output too)."""
    folder = tmp_path_factory.mktemp("q4")
    ref = make_tiny("llama", str(folder / "hf"), intermediate_size=128)
    write_tiny_gguf(str(folder / "q.gguf"), ref, Q.Q4_1)
    return str(folder / "q.gguf")


def load(path: str, dtype: torch.dtype, decode_kernel: str = "auto"):
    return gguf_decoder(GGUFModel(path), dtype, "cpu", TilePlan(), decode_kernel)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_codes_dequantise_to_the_gguf_weights_exactly(tmp_path, qtype):
    ref = make_tiny("llama", str(tmp_path / "hf"), intermediate_size=128)
    write_tiny_gguf(str(tmp_path / "q.gguf"), ref, qtype)
    gm = GGUFModel(str(tmp_path / "q.gguf"))
    checked = 0
    for name in gm._tensors:
        codes = gm.codes(name)
        if len(gm._tensors[name].shape) != 2:
            assert codes is None
            continue
        assert codes is not None and len(codes) == (2 if qtype == Q.Q8_0 else 1), name
        assert all(int(c.q.min()) >= 0 and int(c.q.max()) <= 15 for c in codes)
        assert torch.equal(dequantize(codes), gm.tensor(name)), name  # q/k rows un-permuted like the weights
        checked += 1
    assert checked == 2 + 7 * TINY["num_hidden_layers"]


@pytest.mark.parametrize("n", [48, 100])
def test_kernel_rows_do_not_depend_on_the_batch(n):
    g = torch.Generator().manual_seed(0)
    k = 96
    codes = [Codes(torch.randint(0, 16, (n, k), generator=g), torch.rand(n, k // 32, generator=g) * 0.1,
                   torch.randn(n, k // 32, generator=g) * 0.1)]
    w = pack([codes])
    assert w is not None and w.out_features == n
    x = torch.randn(40, k, generator=g).bfloat16()
    full = int4_linear(x, w)
    assert full.shape == (40, n)
    for rows in range(1, 21):
        for offset in (0, 7, 40 - rows):
            assert torch.equal(int4_linear(x[offset : offset + rows], w), full[offset : offset + rows]), (rows, offset)
    dense = F.linear(x.float(), dequantize(codes))
    assert (full.float() - dense).abs().max() <= 0.02 * dense.abs().max()  # bf16 scales and output


def test_decode_kernel_choice(tiny_q4, tmp_path):
    assert load(tiny_q4, torch.bfloat16, decode_kernel="int4").int4_decode
    assert load(tiny_q4, torch.bfloat16).int4_decode  # auto
    assert load(tiny_q4, torch.bfloat16, decode_kernel="dense").decode_matches_prefill
    assert load(tiny_q4, torch.float32).decode_matches_prefill  # auto: fp32 stays dense
    with pytest.raises(ModelLoadError, match="bf16"):
        load(tiny_q4, torch.float32, decode_kernel="int4")
    f32 = tmp_path / "f32.gguf"
    write_tiny_gguf(str(f32), make_tiny("llama", str(tmp_path / "hf")))
    with pytest.raises(ModelLoadError, match="Q4_0, Q4_1 or Q8_0"):
        load(str(f32), torch.bfloat16, decode_kernel="int4")


def _greedy(runner: ModelRunner, st, steps: int, others=()) -> tuple[list[int], torch.Tensor]:
    """Greedy-decode `st`; each step also feeds the `others` (decode rows or prefill chunks)."""
    out = []
    for step in range(steps):
        out.append(int(torch.argmax(st.logits)))
        items = [StepItem(st, [out[-1]], decode=True)]
        for o, ids in others:
            if o.num_tokens < len(ids):
                items.append(StepItem(o, ids[o.num_tokens : o.num_tokens + 3]))
            else:
                items.append(StepItem(o, [int(torch.argmax(o.logits)) if o.logits is not None else 1], decode=True))
        runner.step(items[::-1] if step % 2 else items)
    return out, st.logits


@pytest.mark.parametrize("matmuls", ["bf16", "fp32", "q4"])
def test_int4_decode_is_batch_invariant_and_close_to_dense(tiny_q4, matmuls):
    """Also with the dense tiles in fp32, or prefill's matmuls on the 4-bit codes, and the decode
    rows' attention native (`use_fp32_matmuls`, the default on CPUs without bf16 arithmetic)."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in (37, 20, 50, 9)]
    runner = ModelRunner(load(tiny_q4, torch.bfloat16, decode_kernel="int4"))
    dense = ModelRunner(load(tiny_q4, torch.bfloat16, decode_kernel="dense"))
    if matmuls != "bf16":
        for r in (runner, dense):
            r.decoder.use_fp32_matmuls(q4=matmuls == "q4")
        if matmuls == "q4" and not runner.decoder.prefill_q4:
            pytest.skip("no native 4-bit packs here (models/kernels/native.py)")
        assert runner.decoder.prefill_q4 == (matmuls == "q4")
        assert (runner.decoder.layers[0].qkv.dtype == torch.float32) == (matmuls == "fp32")
        assert dense.decoder.layers[0].qkv.dtype == torch.float32 and not dense.decoder.prefill_q4
        assert runner.decoder.native_decode_attention == runner.decoder.native_attention

    def start(r: ModelRunner, ids: list[int]):
        st = r.new_state()
        r.step([StepItem(st, ids)])
        return st

    alone_tokens, alone_logits = _greedy(runner, start(runner, prompts[0]), 12)
    others = [(start(runner, prompts[1]), prompts[1]), (runner.new_state(), prompts[2])]
    others[1][0].reserve(1)
    runner.step([StepItem(others[1][0], prompts[2][:4])])  # mid-prefill while we decode
    batched_tokens, batched_logits = _greedy(runner, start(runner, prompts[0]), 12, others)
    assert batched_tokens == alone_tokens
    assert torch.equal(batched_logits, alone_logits)

    st_d = start(dense, prompts[0])
    st_q = start(runner, prompts[0])
    n = len(prompts[0])
    if matmuls == "q4":  # prefill multiplies the 4-bit codes: other bits than the dense path, close
        assert F.cosine_similarity(st_d.kv[..., :n, :].flatten().float(), st_q.kv[..., :n, :].flatten().float(),
                                   dim=0) > 0.999
    else:
        assert torch.equal(st_d.kv[..., :n, :], st_q.kv[..., :n, :])  # prefill is the same dense path in both
    assert F.cosine_similarity(st_d.logits, st_q.logits, dim=0) > 0.999  # only the 4-bit lm_head differs
    for _ in range(4):  # same fed tokens: the 4-bit decode logits stay close to the dense ones
        token = int(torch.argmax(st_d.logits))
        dense.step([StepItem(st_d, [token], decode=True)])
        runner.step([StepItem(st_q, [token], decode=True)])
        cos = F.cosine_similarity(st_d.logits, st_q.logits, dim=0)
        assert cos > 0.999, float(cos)


def test_mixed_decode_and_prefill_order_is_enforced(tiny_q4):
    runner = ModelRunner(load(tiny_q4, torch.bfloat16))
    a, b = runner.new_state(), runner.new_state()
    runner.step([StepItem(a, [1, 2, 3]), StepItem(b, [4, 5])])
    # the runner sorts decode rows first; logits still land on the right states
    runner.step([StepItem(a, [6, 7]), StepItem(b, [8], decode=True)])
    ref_a, ref_b = runner.new_state(), runner.new_state()
    runner.step([StepItem(ref_a, [1, 2, 3])])
    runner.step([StepItem(ref_a, [6, 7])])
    runner.step([StepItem(ref_b, [4, 5])])
    runner.step([StepItem(ref_b, [8], decode=True)])
    assert torch.equal(a.logits, ref_a.logits) and torch.equal(b.logits, ref_b.logits)
    assert np.isfinite(a.logits.numpy()).all()


@pytest.mark.parametrize("q4", [False, True])
def test_fp32_matmuls_keep_prefill_chunk_invariant_and_close_to_bf16(tiny_q4, q4):
    """A bf16 model whose dense tiles multiply in fp32, or whose prefill multiplies the 4-bit codes
    (`prefill_q4`, only a tile's real rows): the KV and logits of a prompt do not depend on how it is
    chunked, differ from the bf16 tiles' only by rounding, and the disk tier's fingerprint tells the
    modes apart."""
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, TINY["vocab_size"], (150,), generator=g).tolist()
    bf16 = ModelRunner(load(tiny_q4, torch.bfloat16))
    wide = ModelRunner(load(tiny_q4, torch.bfloat16))
    wide.decoder.use_fp32_matmuls(q4=q4)
    if q4 and not wide.decoder.prefill_q4:
        pytest.skip("no native 4-bit packs here (models/kernels/native.py)")
    other = ModelRunner(load(tiny_q4, torch.bfloat16))
    other.decoder.use_fp32_matmuls(q4=not q4)
    modes = 3 if wide.decoder.prefill_q4 or other.decoder.prefill_q4 else 2  # (no packs: other is fp32 too)
    assert len({r.decoder.kernel_fingerprint() for r in (bf16, wide, other)}) == modes
    states = []
    for r, chunks in ((wide, (150,)), (wide, (1, 63, 64, 22)), (wide, (37, 113)), (bf16, (150,))):
        st = r.new_state()
        at = 0
        for c in chunks:
            r.step([StepItem(st, ids[at : at + c], want_logits=at + c == len(ids))])
            at += c
        states.append(st)
    one, *others, narrow = states
    for st in others:
        assert torch.equal(st.kv[..., :150, :], one.kv[..., :150, :])
        assert torch.equal(st.logits, one.logits)
    assert one.kv.dtype == torch.bfloat16
    assert F.cosine_similarity(one.logits, narrow.logits, dim=0) > 0.999


def test_self_test_refusing_4bit_decode_moves_q4_prefill_to_checked_fp32_tiles(tiny_q4, monkeypatch):
    """Prefill on the 4-bit codes (`prefill_q4`) goes with the 4-bit decode rows: when the end-to-end
    check refuses those, prefill falls back to fp32 copies of the weights, whose tiles the self-test
    then checks like any dense tile before it passes."""
    from prefixserve.runner import selftest

    runner = ModelRunner(load(tiny_q4, torch.bfloat16, decode_kernel="int4"))
    runner.decoder.use_fp32_matmuls()
    if not runner.decoder.prefill_q4:
        pytest.skip("no native 4-bit packs here (models/kernels/native.py)")
    checked, real = [], selftest.check_tile_rows
    monkeypatch.setattr(selftest, "check_tile_rows", lambda dec, plan: checked.append(
        [name for name, *_ in selftest._dense_tiles(dec, plan)]) or real(dec, plan))
    refused, real_inv = [], selftest.check_invariance
    monkeypatch.setattr(selftest, "check_invariance", lambda r: real_inv(r) if refused else refused.append(1) or
                        "decode rows: logits differ alone and batched")
    result = selftest.self_test(runner)
    d = runner.decoder
    assert result.ok and result.decode_kernel == "dense" and "4-bit decode refused" in result.detail
    assert not d.prefill_q4 and d.layers[0].qkv.dtype == torch.float32
    assert "mm=torch.float32" in d.kernel_fingerprint()
    assert checked[0] == [] and checked[-1][:4] == ["qkv", "o_proj", "gate_up", "down"]


def test_layers_prepared_on_threads_equal_one_thread(tiny_q4):
    """`gguf_decoder(..., workers)`: a layer a task on several threads gives the very tensors and 4-bit
    packs of one thread (a layer's values never depend on which thread made them)."""
    one = gguf_decoder(GGUFModel(tiny_q4), torch.bfloat16, "cpu", TilePlan(), "auto", 1)
    three = gguf_decoder(GGUFModel(tiny_q4), torch.bfloat16, "cpu", TilePlan(), "auto", 3)
    assert one.int4_decode and three.int4_decode and len(one.layers) == len(three.layers) > 1
    for a, b in zip(one.layers, three.layers, strict=True):
        for name in ("attn_norm", "qkv", "o_proj", "mlp_norm", "gate_up", "down"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        for wa, wb in zip(a.int4, b.int4, strict=True):
            assert (wa is None) == (wb is None)
            if wa is not None and wa.native is not None:
                assert torch.equal(wa.native, wb.native)
            elif wa is not None:
                assert all(torch.equal(x, y) for pa, pb in zip(wa.parts, wb.parts, strict=True)
                           for x, y in zip(pa, pb, strict=True))
    assert torch.equal(one.embed, three.embed) and torch.equal(one.final_norm, three.final_norm)
