"""Kernels chosen by timing (models/llama/kernel_choice.py): the choosing logic on given timings, what the
start-up log says, and the real decoder configured by the verdict, remembered for the next process."""

from __future__ import annotations

import pytest
import torch

from prefixserve.models import load_model
from prefixserve.models.llama import kernel_choice
from prefixserve.models.llama.kernel_choice import KernelChoice, close_calls, fastest


def test_fastest_takes_the_least_time_of_its_group():
    seconds = {"matmul:amx": 0.30, "matmul:q4": 0.12, "matmul:fp32": 0.11, "matmul:bf16": 0.95,
               "attention:native": 0.002, "attention:torch": 0.009}
    assert fastest(seconds, "matmul") == "fp32"
    assert fastest(seconds, "attention") == "native"
    assert fastest({"matmul:q4": 0.1, "matmul:fp32": 0.1}, "matmul") == "q4"  # a tie: the earlier
    with pytest.raises(ValueError):
        fastest({"matmul:q4": 0.1}, "attention")


def test_close_calls_are_the_candidates_one_pass_cannot_tell_apart():
    """A slow moment on a VM made fp32 copies (26.1 ms) beat the 4-bit codes (27.5 ms) on one pass;
    quietly the codes take 1.5x less. Candidates within CLOSE of the fastest are timed again."""
    seconds = {"matmul:q4": 0.0275, "matmul:fp32": 0.0261, "matmul:bf16": 0.114, "attention:native": 0.0012}
    assert close_calls(seconds, "matmul") == ["fp32", "q4"]  # fastest first
    assert close_calls({"matmul:q4": 0.020, "matmul:fp32": 0.031, "matmul:bf16": 0.12}, "matmul") == []
    assert close_calls({"matmul:q4": 0.020}, "matmul") == []  # one candidate: nothing to tell apart
    assert close_calls({"matmul:q4": 0.02, "matmul:fp32": 0.0249, "matmul:bf16": 0.0251}, "matmul") == ["q4", "fp32"]
    assert close_calls(seconds, "decode") == []


def test_describe_names_the_winner_and_what_it_beat_by_how_much():
    c = KernelChoice("q4", "native", {"matmul:q4": 0.050, "matmul:fp32": 0.060, "matmul:bf16": 0.200})
    line = c.describe()
    assert "matmul q4 50.0 ms" in line and "beat fp32 1.20x, bf16 4.00x" in line and "timed here" in line
    assert "not timed" in KernelChoice("amx", "native").describe()
    d = KernelChoice("q4", "native", {"matmul:q4": 0.05, "decode:fp32": 0.012, "decode:int8": 0.006}, "int8")
    assert "decode int8 6.0 ms a step at position 256 (beat fp32 2.00x)" in d.describe()


def test_decode_activations_follow_the_timing_unless_set(monkeypatch):
    seconds = {"decode:fp32": 0.010, "decode:int8": 0.004}
    assert fastest(seconds, "decode") == "int8"
    assert fastest({"decode:fp32": 0.004, "decode:int8": 0.010}, "decode") == "fp32"
    monkeypatch.setenv("PREFIXSERVE_DECODE_ACTIVATIONS", "int16")

    class Dec:
        int4_decode = True

    with pytest.raises(ValueError, match="auto, fp32 or int8"):
        kernel_choice.decode_wanted(Dec())  # type: ignore[arg-type]


@pytest.mark.slow
def test_choice_configures_the_decoder_and_is_remembered(tmp_path, monkeypatch):
    # decoders as built (a set PREFIXSERVE_DENSE_MATMUL=bf16 attaches nothing), chosen for here
    monkeypatch.setenv("PREFIXSERVE_DENSE_MATMUL", "bf16")
    timed: list[str] = []
    real = kernel_choice._time_prefill
    whole: list = []  # the decoder being chosen for

    def spy(dec, give_up_after):
        timed.append(dec.matmuls)
        # timed on the first PROBE_LAYERS layers as a decoder of their own: a candidate's copies (fp32:
        # 4 bytes a weight) are made for those only, the other layers keep their bf16 weights meanwhile
        n = kernel_choice.PROBE_LAYERS
        assert dec is not whole[-1] and dec.arch.num_layers == len(dec.layers) == n
        assert all(a is b for a, b in zip(dec.layers, whole[-1].layers[:n], strict=True))
        assert all(w.dtype == torch.bfloat16 for lw in whole[-1].layers[n:] for w in (lw.qkv, lw.gate_up))
        return real(dec, give_up_after)

    monkeypatch.setattr(kernel_choice, "_time_prefill", spy)
    dec = load_model(None, torch.bfloat16, "cpu", decode_kernel="int4").decoder
    whole.append(dec)
    built = dec.kernel_fingerprint()
    choice = kernel_choice.choose(dec, str(tmp_path))
    # each candidate timed, the close calls again (`close_calls`: under load, q4 and fp32 can be one)
    assert len(set(timed)) == len(kernel_choice._candidates(dec)) >= 3 and not choice.remembered
    assert len(timed) <= len(set(timed)) * (1 + kernel_choice.RETIMES)
    assert set(choice.seconds) >= {f"matmul:{m}" for m in ("q4", "fp32", "bf16")}
    assert "matmul:q4x8" not in choice.seconds and not dec.prefill_int8  # int8 prompt rows: asked for only
    assert choice.matmul == fastest(choice.seconds, "matmul")
    configured = {"amx": dec.amx, "q4": dec.prefill_q4, "fp32": dec.matmul_dtype == torch.float32}
    assert all(on == (name == choice.matmul) for name, on in configured.items())
    assert set(choice.seconds) >= {"decode:fp32", "decode:int8"}
    assert choice.decode == fastest(choice.seconds, "decode") and dec.decode_int8 == (choice.decode == "int8")
    assert dec.decode_kernel == "int4" and ("-i8" in dec.kernel_fingerprint()) == (choice.decode == "int8")
    assert (dec.kernel_fingerprint() == built) == (choice.matmul == "bf16" and choice.decode == "fp32")
    timed.clear()
    again = load_model(None, torch.bfloat16, "cpu", decode_kernel="int4").decoder
    second = kernel_choice.choose(again, str(tmp_path))
    assert timed == [] and second.remembered
    assert (second.matmul, second.attention, second.seconds, second.decode) == (
        choice.matmul, choice.attention, choice.seconds, choice.decode)
    assert again.kernel_fingerprint() == dec.kernel_fingerprint()
    # set, not timed: the decode activations asked for, whatever the timing said
    monkeypatch.setenv("PREFIXSERVE_DECODE_ACTIVATIONS", "fp32" if choice.decode == "int8" else "int8")
    third = load_model(None, torch.bfloat16, "cpu", decode_kernel="int4").decoder
    whole.append(third)
    kernel_choice.choose(third, str(tmp_path / "other"))
    assert third.decode_int8 == (choice.decode != "int8")


@pytest.mark.slow
def test_int8_prompt_rows_only_when_asked_for(monkeypatch):
    """PREFIXSERVE_DENSE_MATMUL=q4x8: the 4-bit codes times int8 rows (gemm.c X4), named in the kernel
    fingerprint; never a timed candidate (models/llama/kernel_choice.py)."""
    monkeypatch.setenv("PREFIXSERVE_DENSE_MATMUL", "q4x8")
    dec = load_model(None, torch.bfloat16, "cpu", decode_kernel="int4").decoder
    if not dec.int4_decode or dec.native_decode_plan() is None:
        pytest.skip("no native 4-bit prefill here")
    assert dec.prefill_q4 and dec.prefill_int8 and "mm=q4x8" in dec.kernel_fingerprint()
    assert "on int8 activations" in dec.matmuls
    assert "q4x8" not in kernel_choice._candidates(dec)
