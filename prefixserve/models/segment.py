"""`Segment`: one session's share of a batched forward, what every decoder's `forward` takes
(models/llama/decoder.py, models/hybrid/decoder.py) and the runner builds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixserve.models.final_rows import Scores


@dataclass(slots=True)
class Segment:
    """One session's share of a batched forward.

    kv: [num_layers, 2, num_kv_heads, capacity, head_dim]; positions [0, start) hold the session's
    past keys/values, the forward writes [start, start + num_new), everything after stays zero.
    """

    start: int
    num_new: int
    kv: torch.Tensor
    want_logits: bool = True
    decode: bool = False  # a generated token: runs the decode kernels (must precede prefill segments)
    rec: object | None = None  # recurrent layers' state (models/hybrid/decoder.py RecurrentState); None for KV-only models
    # prompt logprobs: new row i scores targets[i] (its next token) for i < len(targets): `scores` (final_rows.py)
    targets: torch.Tensor | None = None
    num_top: int = 0
    scores: Scores | None = None
