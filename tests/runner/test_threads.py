"""More threads for the big matmuls (models/kernels/threads.py): only for kinds of call the self-test showed
thread-count invariant, back to torch's count while another process holds a core, and never a
different bit."""

from __future__ import annotations

import time

import pytest
import torch

from prefixserve.models.kernels.threads import KernelThreads
from prefixserve.models.layers import TilePlan
from prefixserve.models.loaders.hf_folder import HFModel
from prefixserve.models.loaders.llama_weights import build_decoder
from prefixserve.runner import selftest
from tests.runner.test_reference import make_tiny


@pytest.fixture
def base_one():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def test_only_allowed_kinds_run_on_more_threads(base_one):
    kt = KernelThreads()
    kt.configure(2)
    seen = []
    kt.run("dense", "a", lambda: seen.append(torch.get_num_threads()))
    kt.allow({"dense"})
    kt.run("dense", "a", lambda: seen.append(torch.get_num_threads()))
    kt.run("int4", "b", lambda: seen.append(torch.get_num_threads()))
    assert seen == [1, 2, 1]
    assert torch.get_num_threads() == 1  # restored after every call
    assert kt.describe() == "1 threads (dense calls on 2)"


def test_stalls_back_off_only_when_they_keep_coming(base_one):
    kt = KernelThreads()
    kt.configure(2)
    kt.allow({"int4"})
    kt.STALL_SLACK_S = 0.002
    kt.run("int4", "k", lambda: None)  # the fastest call of its kind: ~0 s
    for _ in range(kt.STALLS_TO_BACK_OFF - 1):  # isolated stalls: counted, no back-off
        kt.run("int4", "k", lambda: time.sleep(0.004))
    assert kt.stalls == kt.STALLS_TO_BACK_OFF - 1 and kt.backoffs == 0
    kt._recent_stalls.clear()
    kt.STALL_WINDOW_S = 10.0
    for _ in range(kt.STALLS_TO_BACK_OFF):
        kt.run("int4", "k", lambda: time.sleep(0.004))
    assert kt.backoffs == 1
    threads = []
    kt.run("int4", "k", lambda: threads.append(torch.get_num_threads()))
    assert threads == [1]  # backing off: torch's count
    kt.backoff_until = 0.0
    kt.run("int4", "k", lambda: threads.append(torch.get_num_threads()))
    assert threads == [1, 2]  # and back when the back-off ends


def test_the_self_test_allows_a_kind_only_where_its_bits_hold(base_one, monkeypatch, tmp_path):
    make_tiny("llama", str(tmp_path))
    hf = HFModel(str(tmp_path))
    dec = build_decoder(hf.arch, hf.tensor, torch.float32, "cpu", TilePlan())
    monkeypatch.setattr(selftest.KERNEL_THREADS, "threads", 2)
    kinds, why = selftest.check_threads(dec, {"dense", "int4"})
    if "dense" not in kinds:
        assert "dense" in why  # refused, with its reason
    # a kernel whose bits change with the thread count is refused
    real_on = selftest.KERNEL_THREADS.on

    def drifting(threads, fn, *args):
        y = real_on(threads, fn, *args)
        return y + 1e-6 if threads == 2 else y

    monkeypatch.setattr(selftest.KERNEL_THREADS, "on", drifting)
    kinds, why = selftest.check_threads(dec, {"dense", "int4"})
    assert "dense" not in kinds and "differs between 1 and 2 threads" in why
    # one thread configured: nothing to check, nothing allowed
    monkeypatch.setattr(selftest.KERNEL_THREADS, "threads", 1)
    assert selftest.check_threads(dec, {"dense", "int4"}) == (set(), "")


def test_widened_tiles_are_the_same_two_calls_on_any_count(base_one):
    """fp32 copies of bf16 weights (`use_fp32_matmuls`): a tile is two calls, one per half of the
    outputs, each on torch's count, whether they run one after the other or at once on the pool."""
    from prefixserve.models.layers import half_rows, linear

    g = torch.Generator().manual_seed(2)
    for n, k, rows in ((960, 576, 64), (100, 64, 16), (16, 32, 3)):
        w = torch.randn(n, k, generator=g).bfloat16().float()
        bias = torch.randn(n, generator=g).bfloat16().float()
        x = torch.randn(rows, k, generator=g).bfloat16()
        cut = half_rows(n)
        assert cut % 16 == 0 and 0 < cut <= n
        halves = torch.cat([torch.nn.functional.linear(x.float(), w[:cut], bias[:cut]),
                            torch.nn.functional.linear(x.float(), w[cut:], bias[cut:])], dim=-1).bfloat16()
        assert torch.equal(linear(x, w, bias, ways=1), halves)
        assert torch.equal(linear(x, w, bias, ways=2), halves)
