"""Batched forward over several sessions' states (prefill chunks and decode rows together)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from prefixserve.models.final_rows import Scores
from prefixserve.models.llama.decoder import Decoder
from prefixserve.models.segment import Segment
from prefixserve.runner.state import KVPool, SessionState


@dataclass(slots=True)
class StepItem:
    """Feed `token_ids` to `state` (appending at state.num_tokens)."""

    state: SessionState
    token_ids: Sequence[int]
    want_logits: bool = True
    decode: bool = False  # one generated token (decode kernels); False = prompt tokens (prefill kernels)
    # prompt logprobs: token_ids[i] is scored on targets[i] (the token after it), for the first
    # len(targets) of them, with the `num_top` most likely; the step leaves them in `scores`
    targets: Sequence[int] = ()
    num_top: int = 0
    scores: Scores | None = None


class ModelRunner:
    """Owns the decoder and runs batched steps. Not thread-safe: one engine thread drives it."""

    def __init__(self, decoder: Decoder, num_threads: int | None = None) -> None:
        self.decoder = decoder
        if num_threads is not None and decoder.device.type == "cpu":
            torch.set_num_threads(num_threads)
        a = decoder.arch
        self.state_shape = (a.num_layers, 2, a.num_kv_heads, a.head_dim)
        self.kv_pool = KVPool()  # finished sessions' KV buffers, for the next ones (runner/state.py)

    def new_state(self, capacity: int = 0) -> SessionState:
        if getattr(self.decoder, "hybrid", False):  # attention KV + recurrent state (runner/hybrid_state.py)
            from prefixserve.runner.hybrid_state import HybridState

            d = self.decoder
            return HybridState.fresh(d.kv_shape, d.new_recurrent(), d.dtype, str(d.device), capacity)  # type: ignore[attr-defined]
        return SessionState.empty(self.state_shape, self.decoder.dtype, str(self.decoder.device), capacity,
                                  self.kv_pool)

    def recycle(self, state: SessionState | None) -> None:
        """`state` is done with (its owner drops it): keep its KV buffer for a later session. Only a
        plain SessionState; the state must not be used afterwards."""
        if type(state) is SessionState:
            self.kv_pool.give(state.kv)
            state.kv = state.kv.new_empty(0, 0, 0, 0, 0)

    def kv_bytes_per_token(self) -> int:
        layers, two, heads, head_dim = self.state_shape
        return layers * two * heads * head_dim * self.decoder.embed.element_size()

    def step(self, items: Sequence[StepItem]) -> None:
        """One batched forward. Afterwards every state has consumed its tokens; states with
        want_logits hold the fp32 logits of their new last position, the others hold none."""
        for _ in self.step_layers(items):
            pass

    def step_layers(self, items: Sequence[StepItem]) -> Iterator[None]:
        """`step`, pausing after each layer where the decoder can (`Decoder.forward_layers`). The
        states' lengths and logits change only when it has run to its end; an abandoned one leaves
        K/V written past their lengths, which block attention needs zeroed
        (`SessionState.truncate(n, force_zero=True)`) before the state is used again."""
        if not items:
            return
        items = sorted(items, key=lambda it: not it.decode)  # decode rows lead (stable: order kept)
        segments = []
        for it in items:
            assert len(it.token_ids) > 0 and (not it.decode or len(it.token_ids) == 1)
            it.state.reserve(it.state.num_tokens + len(it.token_ids))
            assert len(it.targets) <= len(it.token_ids) and not (it.decode and it.targets)
            segments.append(Segment(it.state.num_tokens, len(it.token_ids), it.state.kv, it.want_logits, it.decode,
                                    getattr(it.state, "rec", None)))
            if it.targets:
                segments[-1].targets = torch.tensor(list(it.targets), dtype=torch.long, device=self.decoder.device)
                segments[-1].num_top = it.num_top
        ids = torch.tensor([t for it in items for t in it.token_ids], dtype=torch.long, device=self.decoder.device)
        layered = getattr(self.decoder, "forward_layers", None)
        if layered is not None:
            out = yield from layered(ids, segments)
        else:  # a decoder that runs whole (models/hybrid/decoder.py: recurrent state updates in place)
            out = self.decoder.forward(ids, segments)
        logits = out.clone()  # a normal tensor, not an inference tensor
        row = 0
        for it, seg in zip(items, segments, strict=True):
            it.scores = seg.scores
            it.state.num_tokens += len(it.token_ids)
            if it.want_logits:
                it.state.logits = logits[row].cpu() if logits.device.type != "cpu" else logits[row]
                row += 1
            else:
                it.state.logits = None

    def prefill(self, state: SessionState, token_ids: Sequence[int], chunk_tokens: int) -> None:
        """Feed a whole prompt in chunks (used by tests, the CLI and the self-test)."""
        for i in range(0, len(token_ids), chunk_tokens):
            part = token_ids[i : i + chunk_tokens]
            self.step([StepItem(state, part, want_logits=i + chunk_tokens >= len(token_ids))])
