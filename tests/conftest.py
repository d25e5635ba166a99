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
# The native kernels of test runs, and the kernel-timing verdict remembered beside them
# (models/llama/kernel_choice.py), live apart from the user's ~/.cache: a verdict timed while `make
# test`'s parallel workers load both cores (the 4-bit codes 1.07x ahead of fp32 copies there, 1.52x
# alone, on a Zen 3) must never become a later `prefixserve serve`'s choice.
os.environ.setdefault("PREFIXSERVE_NATIVE_DIR", os.path.join(
    tempfile.gettempdir(), f"prefixserve-test-kernels-{os.getuid()}", "native"))

# PREFIXSERVE_TEST_DEVICE=cuda runs the model tests that honour it (the exactness, cache and hybrid
# tests: `make test-cuda`) on the GPU; everything else, and CI, runs on the CPU.
TEST_DEVICE = os.environ.get("PREFIXSERVE_TEST_DEVICE", "cpu")
if TEST_DEVICE not in ("cpu", "cuda"):
    raise pytest.UsageError(f"PREFIXSERVE_TEST_DEVICE must be cpu or cuda, not {TEST_DEVICE!r}")
if TEST_DEVICE == "cuda" and not torch.cuda.is_available():
    raise pytest.UsageError("PREFIXSERVE_TEST_DEVICE=cuda but torch sees no CUDA device")

_MODELS: dict[str, object] = {}
# In-process model tests run torch on one thread, as the server does on 2 cores
# (engine.default_num_threads: a team over both cores stalls whenever anything else takes one).
IN_PROCESS_THREADS = 1
# ... and the embedded model's big calls (4-bit decode matmuls, dense tiles, native attention) on every
# usable core, as the server does (models/kernels/threads.py; a pytest-xdist worker: its share of
# them, `_embedded_kernel_threads`): the kinds each loaded mode's self-test
# showed to give the same bits on both counts, in the test modules that load the embedded model.
# Every other module (tiny random-weight models, whose call shapes no self-test checked) runs
# everything on one thread.
_KERNEL_KINDS: dict[str, set[str]] = {}
_EMBEDDED_FILES: set[str] = set()


def _test_file() -> str:
    """The file of the test being set up or run, module fixtures included (pytest's PYTEST_CURRENT_TEST:
    'path::name (phase)')."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0]


def _test_workers() -> int:
    """How many pytest processes share this machine's cores (pytest-xdist's workers, `make test`)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)


def _embedded_kernel_threads() -> None:
    from prefixserve.models.kernels.threads import KERNEL_THREADS, usable_cores

    # each of N workers gets its share of the cores: a team of two on a core the other worker holds
    # waits for it at every call (the self-test still checks every kind at both counts)
    KERNEL_THREADS.configure(max(1, usable_cores() // _test_workers()))
    KERNEL_THREADS.allow(set.intersection(*_KERNEL_KINDS.values()) if _KERNEL_KINDS else set())


@pytest.fixture(autouse=True)
def _kernel_threads():
    from prefixserve.models.kernels.threads import KERNEL_THREADS

    if _test_file() in _EMBEDDED_FILES:
        _embedded_kernel_threads()
    elif KERNEL_THREADS.threads != 1:
        KERNEL_THREADS.configure(1)


# Files whose tests assert a bound on time (elapsed, waited, a share of a core, the timing audits,
# latency and memory bounds under load): `make test` runs them after the rest, alone on the machine;
# everything else runs in parallel workers (pytest-xdist, `-m "not serial"`), a file to a worker.
SERIAL = ("tests/reliability/", "tests/bench/test_settle.py", "tests/cache/test_cache_shared.py",
          "tests/engine/test_eager_refill.py", "tests/engine/test_engine_faults.py",
          "tests/engine/test_engine_metrics.py", "tests/engine/test_step_faults.py",
          "tests/runner/test_native_build.py", "tests/server/test_metrics_busy.py",
          "tests/server/test_shutdown_endings.py")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by it
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.nodeid.startswith(SERIAL):  # 'tests/...py::name', relative to the repository root
            item.add_marker(pytest.mark.serial)


def load_embedded(mode: str):
    """The embedded SmolLM2 as (LoadedModel, ModelRunner), cached across tests, configured as the
    server would configure it on this machine: the start-up self-test picks the tile plan (and may
    refuse the mode, and then the test is skipped with the self-test's reason).

    mode: 'fp32' | 'bf16' (both with dense decode) | 'int4' (bf16, 4-bit decode rows: the server's
    default; its dense tiles in fp32 where the CPU has no bf16 arithmetic). On CUDA the server's
    default is bf16 with dense decode (the 4-bit rows are a CPU kernel), and 'int4' loads that."""
    if TEST_DEVICE == "cuda" and mode == "int4":
        mode = "bf16"
    if mode not in _MODELS:
        from prefixserve.models import load_model
        from prefixserve.models.kernels.threads import KERNEL_THREADS, usable_cores
        from prefixserve.runner import ModelRunner
        from prefixserve.runner.selftest import self_test

        dtype = torch.float32 if mode == "fp32" else torch.bfloat16
        m = load_model(None, dtype, TEST_DEVICE, decode_kernel="int4" if mode == "int4" else "dense")
        runner = ModelRunner(m.decoder, IN_PROCESS_THREADS)
        KERNEL_THREADS.configure(usable_cores())  # the self-test checks each kind of call on both counts
        result = self_test(runner)
        refused = not result.ok or (mode == "int4" and result.decode_kernel != "int4")
        _KERNEL_KINDS[mode] = set(KERNEL_THREADS.allowed) if result.ok else set()
        _MODELS[mode] = (m, runner, result.detail if refused else None)
    _EMBEDDED_FILES.add(_test_file())
    _embedded_kernel_threads()
    m, runner, refused = _MODELS[mode]
    if refused:
        pytest.skip(f"mode {mode} is refused on this machine by the self-test: {refused}")
    return m, runner


# function-scoped (the models are cached all the same), so that load_embedded runs in the test's own
# module and switches its kernel threads on
@pytest.fixture(params=["fp32", "bf16", "int4"])
def embedded(request):
    if TEST_DEVICE == "cuda" and request.param == "int4":
        pytest.skip("4-bit decode rows are a CPU kernel: on CUDA the default is the bf16 case")
    return load_embedded(request.param)


@pytest.fixture
def embedded_fp32():
    return load_embedded("fp32")


def server_default_mode() -> str:
    """The mode `prefixserve serve` picks here with its defaults: bf16 (its dense tiles in fp32 on CPUs
    without bf16 arithmetic, models/loaders/load.py) with 4-bit decode rows where the self-test accepts
    them, else with dense decode, else fp32."""
    for mode in ("int4", "bf16"):
        try:
            load_embedded(mode)
            return mode
        except pytest.skip.Exception:
            continue
    return "fp32"


def refeeds(mode: str) -> bool:
    """Whether the mode's decode states differ from prefill ones, so a finished turn is re-fed before
    it is cached (4-bit decode rows); dense decode (bf16, and every mode on CUDA) is cached as it is."""
    return not load_embedded(mode)[1].decoder.decode_matches_prefill
