"""Owns device tensors: session state, batched forward, sampling. Never imports the cache."""

from prefixserve.runner.runner import ModelRunner, StepItem
from prefixserve.runner.sampling import adjust_logits, make_generator, sample, scored_logprobs, token_logprob
from prefixserve.runner.state import KVSnapshot, SessionState

__all__ = ["KVSnapshot", "ModelRunner", "SessionState", "StepItem", "adjust_logits", "make_generator", "sample", "scored_logprobs",
           "token_logprob"]
