"""The embedded default model answers sensibly through our runtime (greedy)."""

from __future__ import annotations

import pytest
import torch

from prefixserve.runner import StepItem

pytestmark = pytest.mark.slow


def test_capital_of_france_is_paris(embedded):
    model, runner = embedded
    ids = model.tokenizer.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    st = runner.new_state()
    runner.prefill(st, ids, 256)
    out: list[int] = []
    for _ in range(24):
        t = int(torch.argmax(st.logits))
        if t in model.tokenizer.eos_token_ids:
            break
        out.append(t)
        runner.step([StepItem(st, [t])])
    assert "Paris" in model.tokenizer.decode(out)
