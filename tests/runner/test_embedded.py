"""The embedded default model answers sensibly through our runtime (greedy).

The question is one the model answers with a margin: asked "What is the capital of France?" its
first token is a near tie ("The" over "L", 0.08 nats with fp32 activations, an exact tie in bf16
logits with the AVX512-BF16 tiles of an AMD Zen 4), and each of the exact kernels that round
activations (bf16, int8 rows) answered "L'Étoile, la Marseillaise, ..." on some CPU class. Asked
"Name the capital city of France." every token up to "Paris" leads by >= 0.5 nats in every mode,
emulated AVX2 and the int8 prompt rows included (measured 2026-12-06)."""

from __future__ import annotations

import pytest
import torch

from prefixserve.runner import StepItem

pytestmark = pytest.mark.slow


def test_capital_of_france_is_paris(embedded):
    model, runner = embedded
    ids = model.tokenizer.render_chat([{"role": "user", "content": "Name the capital city of France."}])
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
