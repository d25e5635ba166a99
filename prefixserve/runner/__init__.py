"""Owns device tensors: session state, batched forward, sampling. Never imports the cache."""

from prefixserve.runner.runner import ModelRunner, StepItem
from prefixserve.runner.sampling import make_generator, sample
from prefixserve.runner.state import KVSnapshot, SessionState

__all__ = ["KVSnapshot", "ModelRunner", "SessionState", "StepItem", "make_generator", "sample"]
