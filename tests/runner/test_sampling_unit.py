"""runner/sampling.adjust_logits without a model: OpenAI's definitions of presence_penalty,
frequency_penalty and logit_bias, the grammar mask, and the input left untouched."""

from __future__ import annotations

import torch

from prefixserve.runner.sampling import adjust_logits, token_logprob
from prefixserve.types import SamplingParams


def test_penalties_and_bias_follow_openai_definitions() -> None:
    logits = torch.zeros(6, dtype=torch.bfloat16)
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((4, 3.0), (5, -100.0)))
    out = adjust_logits(logits, sp, [1, 1, 1, 2])
    # token 1 seen 3 times: -(0.25 * 3 + 0.5); token 2 once: -(0.25 + 0.5); unseen tokens only biased
    assert out.dtype == torch.float32 and out.tolist() == [0.0, -1.25, -0.75, 0.0, 3.0, -100.0]
    assert logits.tolist() == [0.0] * 6  # the input (maybe a cache entry's logits) is not modified
    negative = adjust_logits(logits, SamplingParams(presence_penalty=-1.0), [3])
    assert negative.tolist() == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # a negative penalty favours repeats
    assert adjust_logits(logits, SamplingParams(presence_penalty=1.0), []) is logits  # nothing generated yet


def test_the_mask_applies_after_bias_and_logprobs_ignore_all_of_it() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0])
    allowed = torch.tensor([False, True, True])
    out = adjust_logits(logits, SamplingParams(logit_bias=((0, 50.0),)), [], allowed)
    assert out[0] == float("-inf") and out[1:].tolist() == [1.0, 0.0]
    lp = token_logprob(logits, 1, 2)  # from the raw logits: token 0 still leads
    assert [t for t, _ in lp.top] == [0, 1] and abs(lp.logprob - float(torch.log_softmax(logits, 0)[1])) < 1e-7
