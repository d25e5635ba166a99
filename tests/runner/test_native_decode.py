"""The native 4-bit matmuls (qmatmul.c for decode rows, gemm.c for prompt rows), the one-call decode step and the native prefill layers (decode.c,
models/llama/native_decode.py): they compute what the weights say, a row's bits are its own whatever the
batch, the chunking and the thread count, and a model run this way stays close to its torch
formulation (llama, qwen2's qkv bias, qwen3's q/k norms)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixserve.models.kernels import native
from prefixserve.models.kernels.int4 import GROUP, Codes, dequantize, int4_linear, pack
from prefixserve.models.layers import TilePlan
from prefixserve.models.llama import kernel_choice, native_decode
from prefixserve.models.loaders.hf_folder import HFModel
from prefixserve.models.loaders.llama_weights import attach_int4, build_decoder
from prefixserve.models.segment import Segment
from prefixserve.runner import ModelRunner, StepItem
from tests.runner.test_reference import make_tiny

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the native kernels cannot build")


def _codes(g: torch.Generator, n: int, k: int, q8: bool) -> list[Codes]:
    if q8:  # as codes_from_gguf splits a Q8_0 matrix: q + 128 = 16 hi + lo
        q = torch.randint(-128, 128, (n, k), generator=g) + 128
        d = torch.rand(n, k // GROUP, generator=g) * 0.01
        return [Codes(q >> 4, 16 * d, torch.zeros_like(d)), Codes(q & 15, d, 8 * d)]
    d = torch.rand(n, k // GROUP, generator=g) * 0.1
    m = torch.randn(n, k // GROUP, generator=g) * 0.1
    return [Codes(torch.randint(0, 16, (n, k), generator=g), d, m + 8 * d)]


@pytest.mark.parametrize("q8", [False, True])
@pytest.mark.parametrize("n", [48, 100])
def test_qmatmul_rows_are_their_own_and_exact_to_fp32(n, q8):
    g = torch.Generator().manual_seed(n)
    k = 160
    codes = _codes(g, n, k, q8)
    w = pack([codes], native_layout=True)
    assert w is not None and w.native is not None and w.out_features == n and w.rows == n + (-n % 16)
    x = torch.randn(150, k, generator=g).bfloat16()  # calls of 8+ rows widen the codes, 64 rows at a time
    full = int4_linear(x, w, out_dtype=torch.float32, ways=1)
    reference = F.linear(x.double(), dequantize(codes).double())
    assert (full.double() - reference).abs().max() <= 1e-5 * reference.abs().max()  # fp32 throughout
    for rows in [*range(1, 21), 64, 65, 100]:
        for offset in (0, 7, 63, 150 - rows):
            part = int4_linear(x[offset : offset + rows], w, out_dtype=torch.float32, ways=1)
            assert torch.equal(part, full[offset : offset + rows]), (rows, offset)
    for ways in (2, 3):  # outputs split between threads: the same bits
        assert torch.equal(int4_linear(x, w, out_dtype=torch.float32, ways=ways), full)


@pytest.mark.parametrize("q8", [False, True])
@pytest.mark.parametrize("n", [48, 100])
def test_qgemm_rows_are_their_own_and_exact_to_fp32(n, q8):
    """gemm.c, prompt rows' matmul: the same weights as qmatmul, each output one chain over K, so a row's
    bits are its own for any row count (across the 6-row tiles and 512-row chunks), any output range
    (across its 16- and 32-output panels) and any K (across its 192-input slices); the same for the
    Q4 weights' copies (P4: Q4's bits; X4: on the rows rounded to int8)."""
    g = torch.Generator().manual_seed(n + 1)
    k = 416  # three slices of K
    codes = _codes(g, n, k, q8)
    w = pack([codes], native_layout=True)
    assert w is not None and w.native is not None
    x = torch.randn(600, k, generator=g)
    full = torch.full((600, w.rows), float("nan"))
    native.qgemm(x, w.native, w.native_kind, full)
    reference = F.linear(x.double(), dequantize(codes).double())
    assert (full[:, :n].double() - reference).abs().max() <= 1e-5 * reference.abs().max()
    assert torch.equal(full[:, n:], torch.zeros(600, w.rows - n))  # the padding outputs' weights are 0
    for rows in [*range(1, 14), 63, 513]:
        for offset in (0, 5, 600 - rows):
            part = torch.empty(rows, w.rows)
            native.qgemm(x[offset : offset + rows].contiguous(), w.native, w.native_kind, part)
            assert torch.equal(part, full[offset : offset + rows]), (rows, offset)
    for cut in (4, 20, 36, w.rows - 4):  # outputs split (threads): partial panels, the same bits
        split = torch.empty(600, w.rows)
        native.qgemm(x, w.native, w.native_kind, split, (0, cut))
        native.qgemm(x, w.native, w.native_kind, split, (cut, w.rows))
        assert torch.equal(split, full), cut
    if not q8:  # the panel-ordered copy prompt rows read (gemm.c P4): Q4's bits, row by row
        p4 = native.qpanel_pack(w.native)
        for rows, offset, cut in ((600, 0, 16), (7, 5, 32), (23, 100, w.rows - 16)):
            part = torch.full((rows, w.rows), float("nan"))
            native.qgemm(x[offset : offset + rows].contiguous(), p4, 2, part, (0, cut))
            native.qgemm(x[offset : offset + rows].contiguous(), p4, 2, part, (cut, w.rows))
            assert torch.equal(part, full[offset : offset + rows]), (rows, offset, cut)
        # the copy multiplied by int8 rows (gemm.c X4): a row's bits its own, within int8 rounding of Q4's
        x4 = native.qx4_pack(w.native)
        x[3, 32:64] = 0.0  # a group of zeros: scale 0, codes 0
        full = torch.full((600, w.rows), float("nan"))
        native.qgemm(x, w.native, 0, full)
        rounded = torch.full((600, w.rows), float("nan"))
        native.qgemm(x, x4, 3, rounded)
        assert torch.equal(rounded[:, n:], torch.zeros(600, w.rows - n))
        err = ((rounded - full).norm() / full.norm()).item()
        assert 0 < err < 2e-2, err
        for rows in [*range(1, 10), 63]:
            for offset, cut in ((0, 16), (5, 32), (600 - rows, w.rows - 16)):
                part = torch.full((rows, w.rows), float("nan"))
                native.qgemm(x[offset : offset + rows].contiguous(), x4, 3, part, (0, cut))
                native.qgemm(x[offset : offset + rows].contiguous(), x4, 3, part, (cut, w.rows))
                assert torch.equal(part, rounded[offset : offset + rows]), (rows, offset, cut)


def _quantise(w: torch.Tensor) -> list[Codes]:
    """A Q4_1-style rounding of an fp32 [N, K] weight (per group of 32: scale and minimum)."""
    n, k = w.shape
    groups = w.view(n, k // GROUP, GROUP)
    lo, hi = groups.min(-1).values, groups.max(-1).values
    d = ((hi - lo) / 15).clamp_min(1e-8)
    q = ((groups - lo.unsqueeze(-1)) / d.unsqueeze(-1)).round().clamp(0, 15).to(torch.int64).view(n, k)
    return [Codes(q, d, lo + 8 * d)]


def _runner(folder: str, int4: bool) -> ModelRunner:
    hf = HFModel(folder)
    dec = build_decoder(hf.arch, hf.tensor, torch.bfloat16, "cpu", TilePlan())
    if int4:
        def get(name: str) -> list[Codes] | None:
            t = hf.tensor(name)
            return None if t is None else _quantise(t.float())
        assert attach_int4(dec, get) > 0
    return ModelRunner(dec)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    make_tiny(request.param, folder, intermediate_size=128, head_dim=16, tie_word_embeddings=True)
    return folder


def _start(r: ModelRunner, ids: list[int]):
    st = r.new_state()
    r.step([StepItem(st, ids)])
    return st


def _torch_packed(folder: str, monkeypatch) -> ModelRunner:
    """The same 4-bit codes packed for torch's kernel: decode rows run the per-layer torch formulation."""
    from prefixserve.models.loaders import llama_weights
    with monkeypatch.context() as m:
        m.setattr(llama_weights, "native_available", lambda dtype, device: False)
        r = _runner(folder, int4=True)
    assert r.decoder.native_decode_plan() is None
    return r


def test_decode_step_computes_what_the_torch_formulation_does(tiny, monkeypatch):
    native_runner, torch_runner = _runner(tiny, int4=True), _torch_packed(tiny, monkeypatch)
    dense = _runner(tiny, int4=False)
    assert native_runner.decoder.native_decode_plan() is not None
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 320, (45,), generator=g).tolist()
    states = [_start(r, prompt) for r in (native_runner, torch_runner, dense)]
    for _ in range(4):  # the same fed tokens
        token = int(torch.argmax(states[2].logits))
        for r, st in zip((native_runner, torch_runner, dense), states):
            r.step([StepItem(st, [token], decode=True)])
        mine, theirs, full = (st.logits for st in states)
        # the same codes, fp32 vs bf16 activations and scales: nearly the same logits
        assert F.cosine_similarity(mine, theirs, dim=0) > 0.9999
        assert F.cosine_similarity(mine, full, dim=0) > 0.99  # (random weights rounded to 4 bits)
    n = states[0].num_tokens
    k_mine, k_theirs = states[0].kv[..., :n, :].float(), states[1].kv[..., :n, :].float()
    assert F.cosine_similarity(k_mine.flatten(), k_theirs.flatten(), dim=0) > 0.9999  # decoded K/V written


def test_int8_activations_stay_near_fp32_ones(tiny):
    """The decode step on int8 activations (qmatmul.c `qmatmul_x`, models/llama/kernel_choice.py): the same
    codes, activations rounded to 8 bits per 32 inputs, so nearly the fp32 step's logits."""
    fp32, int8 = _runner(tiny, int4=True), _runner(tiny, int4=True)
    kernel_choice.apply_decode(int8.decoder, "int8")
    assert int8.decoder.decode_int8 and int8.decoder.native_decode_plan() is not None
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 320, (45,), generator=g).tolist()
    states = [_start(r, prompt) for r in (fp32, int8)]
    for _ in range(4):
        token = int(torch.argmax(states[0].logits))
        for r, st in zip((fp32, int8), states):
            r.step([StepItem(st, [token], decode=True)])
        assert not torch.equal(states[0].logits, states[1].logits)  # another arithmetic
        assert F.cosine_similarity(states[0].logits, states[1].logits, dim=0) > 0.999


def _batch_and_thread_invariant(folder: str, starts: list[int], capacity: int, int8: bool = False) -> None:
    dec = _runner(folder, int4=True).decoder
    if int8:
        kernel_choice.apply_decode(dec, "int8")
    plan = dec.native_decode_plan()
    assert plan is not None
    a = dec.arch
    g = torch.Generator().manual_seed(4)
    kv = (torch.randn(len(starts), a.num_layers, 2, a.num_kv_heads, capacity, a.head_dim, generator=g) / 2).bfloat16()
    tokens = torch.randint(0, a.vocab_size, (len(starts),), generator=g)

    def run(rows: list[int], ways: int) -> tuple[torch.Tensor, torch.Tensor]:
        mine = kv.clone()
        segments = [Segment(starts[i], 1, mine[i], decode=True) for i in rows]
        logits = native_decode.decode_rows(dec, plan, tokens[rows], segments, ways)
        assert logits is not None and logits.shape == (len(rows), a.vocab_size)
        return logits, mine

    every = list(range(len(starts)))
    all_logits, all_kv = run(every, 1)
    for ways in (2, 3):
        logits, kv_out = run(every, ways)
        assert torch.equal(logits, all_logits) and torch.equal(kv_out, all_kv)
    for i in every:
        alone, kv_out = run([i], 2)
        assert torch.equal(alone[0], all_logits[i])
        assert torch.equal(kv_out[i], all_kv[i])
    assert not torch.equal(all_kv, kv)  # the step wrote K/V at each session's position


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
def test_decode_step_is_batch_and_thread_invariant(tiny, int8):
    _batch_and_thread_invariant(tiny, [3, 16, 47, 100, 7], 128, int8)


# Deeper than one P.V stretch (decode.c PV_SEG, 256 keys), at the head shapes decode.c keeps in
# registers: 64-dim heads 3 to a kv head (the embedded model), 7 (a group of 6 and one of 1), and 80-dim
# heads (four 16-dim slices and one alone).
@pytest.fixture(scope="module", params=[(6, 64), (14, 64), (4, 80)], ids=["rep3-hd64", "rep7-hd64", "rep2-hd80"])
def deep(request, tmp_path_factory):
    heads, head_dim = request.param
    folder = str(tmp_path_factory.mktemp(f"deep{heads}x{head_dim}"))
    make_tiny("llama", folder, hidden_size=16 * heads, intermediate_size=128, head_dim=head_dim, num_attention_heads=heads,
              num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)
    return folder


def test_deep_decode_step_is_batch_and_thread_invariant(deep):
    _batch_and_thread_invariant(deep, [5, 255, 256, 700], 768)


def test_deep_decode_step_computes_what_the_torch_formulation_does(deep, monkeypatch):
    native_runner, torch_runner = _runner(deep, int4=True), _torch_packed(deep, monkeypatch)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 320, (520,), generator=g).tolist()
    states = [_start(r, prompt) for r in (native_runner, torch_runner)]
    for _ in range(3):
        token = int(torch.argmax(states[1].logits))
        for r, st in zip((native_runner, torch_runner), states):
            r.step([StepItem(st, [token], decode=True)])
        assert F.cosine_similarity(states[0].logits, states[1].logits, dim=0) > 0.9999


def test_torch_packs_where_the_native_kernels_are_off(tiny, monkeypatch):
    """PREFIXSERVE_NATIVE=0 or no compiler: torch's int4 kernel and the per-layer torch formulation."""
    r = _torch_packed(tiny, monkeypatch)
    assert r.decoder.int4_decode and r.decoder.layers[0].qkv_q4 is not None
    assert r.decoder.layers[0].qkv_q4.native is None and r.decoder.layers[0].qkv_q4.parts
    st = _start(r, list(range(5, 40)))
    r.step([StepItem(st, [int(torch.argmax(st.logits))], decode=True)])
    assert st.num_tokens == 36 and torch.isfinite(st.logits).all()


def test_roofline_counts_the_native_packs(tiny):
    """`prefixserve bench engine`'s bytes per decoded token: the packs decode rows read."""
    from prefixserve.benchmarks.engine import decode_weight_bytes

    dec = _runner(tiny, int4=True).decoder
    packs = [w for lw in dec.layers for w in (lw.qkv_q4, lw.o_q4, lw.gate_up_q4, lw.down_q4)] + [dec.lm_head_q4]
    assert all(w is not None and w.native is not None for w in packs)
    assert decode_weight_bytes(dec) == sum(w.native.numel() for w in packs)  # type: ignore[union-attr]


def _prefill_runner(folder: str, matmuls: str) -> ModelRunner:
    """Prompt rows a layer per native call: on the 4-bit codes ("q4", what a CPU without bf16
    arithmetic runs) or on the bf16 weights' AMX packs ("amx", a CPU with AMX: models/kernels/amx_tiles.py)."""
    r = _runner(folder, int4=True)
    if matmuls == "q4":
        r.decoder.use_fp32_matmuls()
        assert r.decoder.prefill_q4
    else:
        if not native.amx_ready():
            pytest.skip("no AMX tiles on this CPU")
        assert r.decoder.use_amx_tiles() == 4 * r.decoder.arch.num_layers  # the logits keep the 4-bit head
    plan = r.decoder.native_decode_plan()
    assert plan is not None and plan.prefill_weights is not None
    kinds = plan.prefill_weights[:, native_decode.W_KINDS]
    if matmuls == "q4":  # every Q4 pack's panel-ordered copy (gemm.c P4), the tiny model having no Q8
        assert bool(((kinds >> 8) & 0xF).eq(0xF).all()) and len(plan.panels) == 4 * r.decoder.arch.num_layers
    else:
        assert bool(((kinds >> 4) & 0xF).eq(0xF).all()) and not plan.panels
    return r


@pytest.mark.parametrize("matmuls", ["q4", "amx"])
def test_native_prefill_is_chunk_batch_and_thread_invariant(tiny, matmuls):
    r = _prefill_runner(tiny, matmuls)
    dec = r.decoder
    plan = dec.native_decode_plan()
    assert plan is not None
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 320, (150,), generator=g).tolist()
    other = torch.randint(0, 320, (90,), generator=g).tolist()

    def run(chunks: list[int], company: bool = False):
        st, o, d = r.new_state(), r.new_state(), _start(r, other[:30]) if company else None
        at = 0
        for c in chunks:
            items = [StepItem(st, ids[at : at + c], want_logits=at + c == len(ids))]
            if company:  # another prompt's rows and a decoding session in the same steps
                items = [StepItem(d, [int(torch.argmax(d.logits))], decode=True), StepItem(o, other[at % 60 : at % 60 + 7]),
                         *items]
            r.step(items)
            at += c
        return st

    one = run([150])
    for chunks, company in (([1, 149], False), ([64, 64, 22], False), ([37, 113], True), ([5] * 30, True)):
        st = run(chunks, company)
        assert torch.equal(st.kv[..., :150, :], one.kv[..., :150, :]), chunks
        assert torch.equal(st.logits, one.logits), chunks
    for ways in (1, 2, 3):  # the layer calls on any number of threads
        kv = torch.zeros_like(one.kv)
        rows = native_decode.prefill_start(dec, plan, torch.tensor(ids), [Segment(0, 150, kv)])
        assert rows is not None
        for layer in range(dec.arch.num_layers):
            native_decode.prefill_layer(plan, rows, layer, ways)
        assert torch.equal(kv[..., :150, :], one.kv[..., :150, :])
        assert torch.equal(native_decode.rows_logits(plan, rows.h[-1:], ways)[0], one.logits)


@pytest.mark.parametrize("matmuls", ["q4", "amx"])
def test_native_prefill_computes_what_the_tiles_do(tiny, monkeypatch, matmuls):
    """The same weights through the tile path (torch ops around the same matmuls, bf16 between them):
    nearly the same K/V and logits; and the tile path is what runs where decode.c cannot read a KV."""
    r = _prefill_runner(tiny, matmuls)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 320, (100,), generator=g).tolist()
    native_state = _start(r, ids)
    monkeypatch.setattr(native_decode, "prefill_start", lambda *a, **k: None)
    tile_state = _start(r, ids)
    assert not torch.equal(native_state.kv, tile_state.kv)  # the other path ran
    assert F.cosine_similarity(native_state.logits, tile_state.logits, dim=0) > 0.9999
    k_native, k_tile = native_state.kv[..., :100, :].float(), tile_state.kv[..., :100, :].float()
    assert F.cosine_similarity(k_native.flatten(), k_tile.flatten(), dim=0) > 0.9999


def test_a_decode_step_the_native_call_could_not_run_takes_the_torch_path(tiny, monkeypatch):
    """decode_rows returns None when decode.c cannot have its scratch: the step still gives each row
    its logits (the per-layer formulation on the same packs), close to what the native call gives."""
    r = _runner(tiny, int4=True)
    prompt = torch.randint(0, 320, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    native_st, fallback_st = _start(r, prompt), _start(r, prompt)
    token = int(torch.argmax(native_st.logits))
    r.step([StepItem(native_st, [token], decode=True)])
    monkeypatch.setattr(native_decode, "decode_rows", lambda *a, **k: None)
    r.step([StepItem(fallback_st, [token], decode=True)])
    assert fallback_st.logits is not None and fallback_st.num_tokens == native_st.num_tokens
    assert F.cosine_similarity(fallback_st.logits, native_st.logits, dim=0) > 0.9999
