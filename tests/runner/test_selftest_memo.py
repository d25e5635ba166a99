"""The self-test's remembered verdict (runner/selftest_memo.py): a pass recorded under the same
fingerprint is applied without running the checks, and gives the same decoder configuration and the
same bits; anything else runs the whole test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prefixserve.models import load_model
from prefixserve.models.kernels.threads import KERNEL_THREADS
from prefixserve.models.loaders.load import LoadedModel
from prefixserve.runner import ModelRunner, StepItem, identity, selftest, selftest_memo
from prefixserve.runner.selftest import SelfTestResult
from tests.conftest import IN_PROCESS_THREADS
from tests.helpers.server_proc import TEST_MODEL_CACHE

pytestmark = pytest.mark.slow
PROMPT = [(i * 7919) % 40000 + 17 for i in range(45)]


@pytest.fixture(autouse=True)
def _kernel_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test mutates the process-wide kernel thread choice; every test leaves it as it found it."""
    monkeypatch.setattr(KERNEL_THREADS, "allowed", set(KERNEL_THREADS.allowed))


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the times the whole self-test runs."""
    count: list[int] = []
    real = selftest_memo.self_test

    def counted(runner: ModelRunner) -> SelfTestResult:
        count.append(1)
        return real(runner)

    monkeypatch.setattr(selftest_memo, "self_test", counted)
    return count


def _load() -> tuple[LoadedModel, ModelRunner]:
    m = load_model(None, torch.bfloat16, cache_dir=TEST_MODEL_CACHE)  # the servers' shared cache
    assert m.identity is not None
    return m, ModelRunner(m.decoder, IN_PROCESS_THREADS)


def _bits(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a 45-token prompt (two chunks) and of one decode step after it."""
    st = runner.new_state()
    runner.step([StepItem(st, PROMPT[:30])])
    runner.step([StepItem(st, PROMPT[30:])])
    assert st.logits is not None
    prefill = st.logits.clone()
    runner.step([StepItem(st, [int(torch.argmax(prefill))], decode=True)])
    assert st.logits is not None
    return prefill, st.logits.clone()


def _config(runner: ModelRunner) -> tuple[str, str, set[str]]:
    return str(runner.decoder.tiles), runner.decoder.decode_kernel, set(KERNEL_THREADS.allowed)


def test_a_pass_is_remembered_and_gives_the_same_bits(tmp_path: Path, runs: list[int]) -> None:
    m1, r1 = _load()
    first = selftest_memo.remembered_self_test(r1, str(tmp_path), m1.identity)
    assert first.ok and len(runs) == 1 and not first.remembered
    (record,) = tmp_path.glob("*.json")
    tested = _config(r1)
    want = _bits(r1)

    m2, r2 = _load()  # a second start: a fresh decoder, the self-test's choices not yet made
    again = selftest_memo.remembered_self_test(r2, str(tmp_path), m2.identity)
    assert again.ok and len(runs) == 1, "the recorded pass was not used"
    assert again.remembered and again.detail == first.detail  # the same system_fingerprint
    assert _config(r2) == tested
    got = _bits(r2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    # --fresh-self-test runs it anyway
    m3, r3 = _load()
    assert selftest_memo.remembered_self_test(r3, str(tmp_path), m3.identity, fresh=True).ok and len(runs) == 2

    # a record that does not parse, or whose fingerprint is not the one asked for, is not trusted
    good = json.loads(record.read_text())
    for damage in ("{not json", json.dumps({**good, "fingerprint": {"model": "x"}}),
                   json.dumps({**good, "outcome": {**good["outcome"], "tiles": [0, 16]}}),
                   json.dumps({**good, "outcome": {k: v for k, v in good["outcome"].items() if k != "dropped_int4"}})):
        record.write_text(damage)
        m4, r4 = _load()
        before = len(runs)
        assert selftest_memo.remembered_self_test(r4, str(tmp_path), m4.identity).ok
        assert len(runs) == before + 1


def test_the_fingerprint_covers_what_decides_the_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    m, runner = _load()
    base = selftest_memo.fingerprint(runner, m.identity or "")
    seen = {json.dumps(base, sort_keys=True)}
    assert selftest_memo.fingerprint(runner, m.identity or "") == base  # stable
    assert {"model", "kernels", "torch", "torch_build", "cpu_capability", "cpu", "threads", "native", "code",
            "env"} <= set(base)
    for change in (
        lambda: monkeypatch.setenv("OMP_WAIT_POLICY", "passive"),
        lambda: monkeypatch.setenv("PREFIXSERVE_DENSE_MATMUL", "fp32"),
        lambda: monkeypatch.setattr(KERNEL_THREADS, "threads", KERNEL_THREADS.threads + 3),
        lambda: monkeypatch.setattr(identity, "code_digest", lambda: "edited"),
    ):
        change()
        seen.add(json.dumps(selftest_memo.fingerprint(runner, m.identity or ""), sort_keys=True))
    seen.add(json.dumps(selftest_memo.fingerprint(runner, "another model"), sort_keys=True))
    assert len(seen) == 6


def test_only_a_pass_is_remembered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runs: list[int]) -> None:
    monkeypatch.setattr(selftest_memo, "self_test", lambda runner: runs.append(1) or SelfTestResult(
        False, "16", "dense", "NOT exact on this machine; cross-request reuse is disabled", 0.0))
    for expected in (1, 2):
        m, runner = _load()
        assert not selftest_memo.remembered_self_test(runner, str(tmp_path), m.identity).ok
        assert len(runs) == expected and not list(tmp_path.glob("*.json"))


def test_a_refused_4bit_decode_stays_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runs: list[int]) -> None:
    """The test dropped the 4-bit decode rows here: a remembered start drops them too (dense decode,
    the same tiles) and computes the same bits as the tested decoder."""
    m1, r1 = _load()
    if not r1.decoder.int4_decode:
        pytest.skip("no 4-bit decode rows on this machine")
    monkeypatch.setattr(selftest, "check_int4_rows", lambda dec: "refused for this test")
    first = selftest_memo.remembered_self_test(r1, str(tmp_path), m1.identity)
    assert first.ok and first.decode_kernel == "dense" and len(runs) == 1
    tested, want = _config(r1), _bits(r1)
    m2, r2 = _load()
    assert r2.decoder.int4_decode
    again = selftest_memo.remembered_self_test(r2, str(tmp_path), m2.identity)
    assert again.ok and len(runs) == 1 and again.decode_kernel == "dense" and not r2.decoder.int4_decode
    assert _config(r2) == tested
    got = _bits(r2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
