"""Start-up self-test: is the runtime split- and batch-invariant on THIS machine (DESIGN.md §3)?

The row-count threshold above which matmul rows are bit-invariant depends on the CPU, the BLAS
build and the thread count, so it is checked where the server runs. If the configured min_rows
fails, larger ones are tried; if none holds, the caller must refuse cross-request reuse.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from prefixserve.runner.runner import ModelRunner, StepItem
from prefixserve.runner.state import SessionState

CANDIDATE_MIN_ROWS = (16, 32, 64)


@dataclass(frozen=True, slots=True)
class SelfTestResult:
    ok: bool
    min_rows: int
    detail: str
    seconds: float


def check_invariance(runner: ModelRunner, num_tokens: int = 48, seed: int = 1234) -> bool:
    """True when last logits agree bitwise for one-shot, split, token-wise and batched runs."""
    g = torch.Generator().manual_seed(seed)
    vocab = runner.decoder.arch.vocab_size
    ids = torch.randint(0, vocab, (num_tokens,), generator=g).tolist()
    other = torch.randint(0, vocab, (num_tokens // 2 + 3,), generator=g).tolist()

    def run(splits: list[int]) -> SessionState:
        st = runner.new_state()
        prev = 0
        for sp in [*splits, num_tokens]:
            runner.step([StepItem(st, ids[prev:sp])])
            prev = sp
        assert st.logits is not None
        return st

    alone = run([])
    ref = alone.logits.clone()  # type: ignore[union-attr]
    for splits in ([1], [29], [num_tokens - 1], [5, 6, 33]):
        if not torch.equal(run(splits).logits, ref):  # type: ignore[arg-type]
            return False
    st = runner.new_state()
    runner.step([StepItem(st, ids[:-1])])
    o1 = runner.new_state()
    runner.step([StepItem(o1, other[:-2])])
    o2 = runner.new_state()
    runner.step([StepItem(o1, other[-2:-1]), StepItem(st, ids[-1:]), StepItem(o2, other, want_logits=False)])
    if not torch.equal(st.logits, ref):  # type: ignore[arg-type]
        return False
    # decode rows (4-bit kernels where the model has them): alone vs among other decode rows and
    # a prefill chunk
    token = int(torch.argmax(ref))
    runner.step([StepItem(alone, [token], decode=True)])
    o3 = runner.new_state()
    runner.step([StepItem(o3, other[:-4])])
    o4 = runner.new_state()
    runner.step([
        StepItem(o4, other[:9]), StepItem(o3, [other[-4]], decode=True), StepItem(st, [token], decode=True),
        StepItem(o1, [other[-1]], decode=True),
    ])
    return torch.equal(st.logits, alone.logits)  # type: ignore[arg-type]


def self_test(runner: ModelRunner) -> SelfTestResult:
    """Find the smallest candidate min_rows for which the runtime is invariant; sets it on the decoder."""
    t0 = time.perf_counter()
    tried = []
    for min_rows in sorted({runner.decoder.min_rows, *CANDIDATE_MIN_ROWS}):
        if min_rows < runner.decoder.min_rows:
            continue
        runner.decoder.min_rows = min_rows
        if check_invariance(runner):
            detail = f"split/batch invariant with matmuls padded to {min_rows} rows"
            return SelfTestResult(True, min_rows, detail, time.perf_counter() - t0)
        tried.append(min_rows)
    runner.decoder.min_rows = CANDIDATE_MIN_ROWS[0]
    detail = f"NOT invariant on this machine (tried min_rows {tried}); cross-request reuse is disabled"
    return SelfTestResult(False, runner.decoder.min_rows, detail, time.perf_counter() - t0)
