"""Run in a child process at one PREFIXSERVE_NATIVE_ISA level (tests/runner/test_isa_levels.py): the
native kernels' outputs on fixed inputs, the embedded model's greedy run through the native 4-bit
prefill (on fp32 and on int8 activations) and decode (the same), and whether a prompt resumed at a split point gives its one-shot logits, saved to the file named on the command line for the parent to compare."""

from __future__ import annotations

import os
import sys

import torch


def main(out_path: str) -> None:
    from prefixserve.config import default_model_cache_dir
    from prefixserve.models import load_model
    from prefixserve.models.kernels import native
    from prefixserve.runner import ModelRunner
    from prefixserve.runner.runner import StepItem

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(5)
    out: dict[str, torch.Tensor | str] = {"isa": native.isa(), "build": native.build_name()}
    for dtype in (torch.float32, torch.bfloat16):
        for start, rows in ((0, 1), (0, 37), (300, 1), (600, 40)):
            kv = torch.randn(2, 3, start + rows + 5, 64, generator=g).to(dtype)
            q = torch.randn(rows, 9, 64, generator=g).to(dtype)
            out[f"attention-{dtype}-{start}-{rows}"] = native.attention(q, kv[0], kv[1], start)
    # no self-test: the default tiles and one thread for every call, the same calls at each level
    m = load_model(None, torch.bfloat16, "cpu", decode_kernel="int4", cache_dir=default_model_cache_dir(os.environ))
    runner = ModelRunner(m.decoder, 1)
    out["matmuls"] = m.decoder.matmuls
    ids = torch.randint(0, m.arch.vocab_size, (150,), generator=g).tolist()
    st = runner.new_state()
    runner.step([StepItem(st, ids)])
    assert st.logits is not None
    logits = [st.logits.clone()]
    for _ in range(8):
        token = int(torch.argmax(logits[-1]))
        runner.step([StepItem(st, [token], decode=True)])
        logits.append(st.logits.clone())
    out["logits"] = torch.stack(logits)
    # the decode step on int8 activations (qmatmul.c `qmatmul_x`): its own bits, the same at every level
    from prefixserve.models.llama import kernel_choice

    kernel_choice.apply_decode(m.decoder, "int8")
    assert m.decoder.decode_int8 and m.decoder.decode_kernel == "int4"
    st8 = runner.new_state()
    runner.step([StepItem(st8, ids)])
    assert st8.logits is not None
    int8 = [st8.logits.clone()]
    for _ in range(8):
        runner.step([StepItem(st8, [int(torch.argmax(int8[-1]))], decode=True)])
        int8.append(st8.logits.clone())
    out["logits_int8"] = torch.stack(int8)
    split = runner.new_state()
    runner.step([StepItem(split, ids[:77])])
    runner.step([StepItem(split, ids[77:])])
    out["resumed_equal"] = bool(torch.equal(split.logits, logits[0]))
    # prompt rows on int8 activations (gemm.c X4, the AVX2 class's choice): the same bits at every
    # level, and a resumed prompt still gives its one-shot logits
    assert m.decoder.use_int8_prefill()
    one = runner.new_state()
    runner.step([StepItem(one, ids)])
    resumed = runner.new_state()
    runner.step([StepItem(resumed, ids[:77])])
    runner.step([StepItem(resumed, ids[77:])])
    assert one.logits is not None and resumed.logits is not None
    out["logits_x8"] = one.logits.clone()
    out["resumed_equal_x8"] = bool(torch.equal(resumed.logits, one.logits))
    torch.save(out, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
