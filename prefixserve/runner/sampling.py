"""Per-session sampling: greedy, temperature, top-k, top-p, seeded generators."""

from __future__ import annotations

import torch

from prefixserve.types import SamplingParams


MIN_TEMPERATURE = 1e-5  # below this, 1/T overflows fp32 and the distribution is argmax anyway


def make_generator(seed: int | None) -> torch.Generator:
    """Same seed, same draws. Without a seed, a fresh random one."""
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """logits: fp32 [vocab] (not modified). Returns the next token id."""
    if params.greedy or params.temperature < MIN_TEMPERATURE:
        return int(torch.argmax(logits))
    # shift first: the max logit becomes 0, so even a denormal temperature gives 0 and -inf, never NaN
    x = logits.float()
    x = (x - x.max()) / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[0]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = cum - probs > params.top_p  # keep the smallest set whose mass reaches top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
