"""Shared fixtures: the embedded model, loaded once per dtype per test session."""

from __future__ import annotations

import pytest
import torch

_MODELS: dict[str, object] = {}
# In-process model tests run on one thread: bits are the same for a fixed thread count, and two
# threads stall badly whenever a server subprocess (or anything else) competes for the 2 cores.
IN_PROCESS_THREADS = 1


def load_embedded(dtype: str):
    """The embedded SmolLM2 as (LoadedModel, ModelRunner), cached across tests. dtype: 'fp32' | 'bf16'."""
    if dtype not in _MODELS:
        from prefixserve.models import load_model
        from prefixserve.runner import ModelRunner

        m = load_model(None, torch.float32 if dtype == "fp32" else torch.bfloat16)
        _MODELS[dtype] = (m, ModelRunner(m.decoder, IN_PROCESS_THREADS))
    return _MODELS[dtype]


@pytest.fixture(scope="session", params=["fp32", "bf16"])
def embedded(request):
    return load_embedded(request.param)


@pytest.fixture(scope="session")
def embedded_fp32():
    return load_embedded("fp32")
