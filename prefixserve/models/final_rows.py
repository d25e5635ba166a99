"""A forward's outputs from its final residual rows: which rows give logits, and prompt logprobs.

Every decoder (models/llama/decoder.py, its native prefill in llama/native_decode.py,
models/hybrid/decoder.py) ends the same way: the last new row of each segment that wants logits, and, for a segment with `targets`,
every new row scored on the token after it (completions' echo with logprobs, docs/exactness.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

SCORE_ROWS = 64  # prompt rows scored per logits call: a long chunk never holds its whole [rows, vocab]

Scores = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # logprob [n], top ids [n, k], top logprobs [n, k]


def score_rows(h: torch.Tensor, logits: Callable[[torch.Tensor], torch.Tensor], targets: torch.Tensor,
               num_top: int) -> Scores:
    """Prompt logprobs: row i of h [n, hidden] (final residual rows) scores `targets[i]`, the token
    that follows it. `logits` is the decoder's own batch-invariant logits of final rows (the one that
    gives a session its next token), so a position scores with the bits it would sample with;
    `log_softmax` and `topk` are row-local. fp32 results on the CPU, `num_top` per row (largest first)."""
    lp_out = torch.empty(h.shape[0])
    ids_out = torch.empty(h.shape[0], num_top, dtype=torch.long)
    top_out = torch.empty(h.shape[0], num_top)
    for r0 in range(0, h.shape[0], SCORE_ROWS):
        r1 = min(h.shape[0], r0 + SCORE_ROWS)
        lp = torch.log_softmax(logits(h[r0:r1]).float(), dim=-1).cpu()
        lp_out[r0:r1] = lp.gather(1, targets[r0:r1].view(-1, 1).cpu()).view(-1)
        if num_top > 0:
            top_out[r0:r1], ids_out[r0:r1] = torch.topk(lp, num_top, dim=-1)
    return lp_out, ids_out, top_out


class SegmentRows(Protocol):
    """What `logit_rows` and `score_segments` read and write of a forward's segment (models/segment.py)."""

    num_new: int
    want_logits: bool
    targets: torch.Tensor | None
    num_top: int
    scores: Scores | None


def logit_rows(segments: Sequence[SegmentRows]) -> list[int]:
    """The batch row of the last new position of each segment that wants its logits, in order."""
    rows, offset = [], 0
    for s in segments:
        offset += s.num_new
        if s.want_logits:
            rows.append(offset - 1)
    return rows


def score_segments(segments: Sequence[SegmentRows], h: torch.Tensor,
                   logits: Callable[[torch.Tensor], torch.Tensor], skip: int = 0) -> None:
    """Fill `scores` of every segment with targets from the final residual rows h (the batch's rows
    in segment order, less its first `skip`, which are not in h)."""
    offset = -skip
    for s in segments:
        if s.targets is not None and len(s.targets):
            assert offset >= 0
            s.scores = score_rows(h[offset : offset + len(s.targets)], logits, s.targets, s.num_top)
        offset += s.num_new
