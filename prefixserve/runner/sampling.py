"""Per-session sampling: greedy, temperature, top-k, top-p, seeded generators; penalties,
logit_bias and grammar masks on the logits; log-probabilities of what was sampled."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixserve.models.final_rows import Scores
from prefixserve.types import SamplingParams, TokenLogprob

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


def adjust_logits(
    logits: torch.Tensor, params: SamplingParams, output_ids: Sequence[int], allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """The logits to sample from: logit_bias added, presence and frequency penalties subtracted for
    the tokens generated so far (OpenAI's definitions), tokens outside `allowed` (bool [vocab]) set to
    -inf. Returns `logits` itself when nothing applies, else a new fp32 tensor (the input is never
    modified: it may be a cache entry's stored logits)."""
    penalised = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    if not params.logit_bias and allowed is None and not (penalised and output_ids):
        return logits
    x = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        x.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], dtype=x.dtype))
    if penalised and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=x.shape[0])[: x.shape[0]]
        x -= params.frequency_penalty * counts.to(x.dtype) + params.presence_penalty * (counts > 0).to(x.dtype)
    if allowed is not None:
        x.masked_fill_(~allowed, float("-inf"))
    return x


def token_logprob(logits: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    """log_softmax of the raw fp32 logits (before temperature, penalties and masks, as OpenAI and
    vLLM report them): the sampled token's value and the `num_top` largest, most likely first."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if num_top > 0:
        values, ids = torch.topk(lp, num_top)  # sorted, largest first
        top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token_id=token_id, logprob=float(lp[token_id]), top=top)


def scored_logprobs(targets: Sequence[int], scores: Scores) -> list[TokenLogprob]:
    """A prefill step's prompt logprobs (models/final_rows.py score_rows) as one TokenLogprob per target."""
    lps, ids, tops = (t.tolist() for t in scores)
    return [TokenLogprob(token_id=t, logprob=v, top=tuple(zip(i, p, strict=True)))
            for t, v, i, p in zip(targets, lps, ids, tops, strict=True)]
