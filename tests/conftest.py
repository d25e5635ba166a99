"""Shared fixtures: the embedded model, loaded once per dtype per test session."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

# Tests never write to the real home: anything that falls back to the default data directory
# (config.default_data_dir), here or in a server subprocess inheriting the environment, lands in a
# temporary directory instead.
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="prefixserve-xdg-")
os.environ.pop("PREFIXSERVE_DATA_DIR", None)

_MODELS: dict[str, object] = {}
# In-process model tests run on one thread: bits are the same for a fixed thread count, and two
# threads stall badly whenever a server subprocess (or anything else) competes for the 2 cores.
IN_PROCESS_THREADS = 1


def load_embedded(mode: str):
    """The embedded SmolLM2 as (LoadedModel, ModelRunner), cached across tests, configured as the
    server would configure it on this machine: the start-up self-test picks the tile plan (and may
    refuse the mode, and then the test is skipped with the self-test's reason).

    mode: 'fp32' | 'bf16' (both with dense decode) | 'int4' (bf16, 4-bit decode rows: the server's
    default; its dense tiles in fp32 where the CPU has no bf16 arithmetic)."""
    if mode not in _MODELS:
        from prefixserve.models import load_model
        from prefixserve.runner import ModelRunner
        from prefixserve.runner.selftest import self_test

        dtype = torch.float32 if mode == "fp32" else torch.bfloat16
        m = load_model(None, dtype, decode_kernel="int4" if mode == "int4" else "dense")
        runner = ModelRunner(m.decoder, IN_PROCESS_THREADS)
        result = self_test(runner)
        refused = not result.ok or (mode == "int4" and result.decode_kernel != "int4")
        _MODELS[mode] = (m, runner, result.detail if refused else None)
    m, runner, refused = _MODELS[mode]
    if refused:
        pytest.skip(f"mode {mode} is refused on this machine by the self-test: {refused}")
    return m, runner


@pytest.fixture(scope="session", params=["fp32", "bf16", "int4"])
def embedded(request):
    return load_embedded(request.param)


@pytest.fixture(scope="session")
def embedded_fp32():
    return load_embedded("fp32")


def server_default_mode() -> str:
    """The mode `prefixserve serve` picks here with its defaults: bf16 (its dense tiles in fp32 on CPUs
    without bf16 arithmetic, models/loader.py) with 4-bit decode rows where the self-test accepts
    them, else with dense decode, else fp32."""
    for mode in ("int4", "bf16"):
        try:
            load_embedded(mode)
            return mode
        except pytest.skip.Exception:
            continue
    return "fp32"
