"""n > 1: the other choices of a request, forked from choice 0 once its prompt is done."""

from __future__ import annotations

from prefixserve.cache import PrefixCache
from prefixserve.engine.detok import IncrementalDetokenizer
from prefixserve.engine.protocol import TokenizerLike
from prefixserve.engine.session import Phase, Session, Snapshot
from prefixserve.runner import make_generator


def fork_choices(s: Session, tokenizer: TokenizerLike, cache: PrefixCache[Snapshot]) -> list[Session]:
    """Choices 1..n-1 of `s`'s request, when choice 0 `s` has the prompt's last logits (after its
    prefill, or from a full-hit entry still pending): each starts from a deep copy of `s`'s state, or
    holds its own pin of the same entry (taken here; released when its copy is made or it finishes),
    with a generator seeded seed + index and a copy of the grammar matcher. The prompt was prefilled
    once. Sets the shared `choices` list on all of them; the caller runs and samples the new ones.
    All or nothing: when a copy fails, the pins taken are released and `s` is as it was (no choices,
    its whole reservation), and the error is raised."""
    assert s.index == 0 and not s.choices
    sp = s.request.sampling
    children: list[Session] = []
    try:
        for index in range(1, s.request.num_choices):
            child = Session(
                request=s.request, detok=IncrementalDetokenizer(tokenizer, sp.stop, sp.stop_skip),
                generator=make_generator(None if sp.seed is None else sp.seed + index),
                phase=Phase.DECODE, num_cached=s.num_cached, index=index, choices=s.choices,
                matcher=None if s.matcher is None else s.matcher.fork(),
            )
            if s.state is not None:
                child.state = s.state.clone()
            else:  # a full hit whose copy is still pending
                assert s.pending_restore is not None
                cache.pin(s.pending_restore)
                child.pending_restore = s.pending_restore
            children.append(child)
    except BaseException:
        for child in children:
            if child.pending_restore is not None:
                cache.unpin(child.pending_restore)
        raise
    share = s.reserved_bytes // s.request.num_choices  # admission reserved every choice's KV on choice 0
    for child in children:
        child.reserved_bytes, s.reserved_bytes = share, s.reserved_bytes - share  # freed as each finishes
    s.choices.extend([s, *children])
    return children
