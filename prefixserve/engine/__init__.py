"""The engine: `build_engine` loads the model, self-tests it, opens the cache tiers and starts the
engine thread around an `EngineCore` (engine/core.py: the scheduler, cache writer and output
processor it wires); `AsyncEngine` (engine/async_engine.py) is the server's view of it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prefixserve.config import CacheConfig, EngineConfig, ModelConfig
from prefixserve.engine.protocol import EngineClient, EngineHealth

if TYPE_CHECKING:
    from prefixserve.cache import CacheListener
    from prefixserve.cache.disk import DiskTier
    from prefixserve.cache.shared import SharedTier
    from prefixserve.engine.async_engine import AsyncEngine
    from prefixserve.engine.core import EngineCore
    from prefixserve.models.loaders.prepared import Later
    from prefixserve.runner import ModelRunner
    from prefixserve.runner.selftest import SelfTestResult

log = logging.getLogger("prefixserve.engine")

__all__ = ["AsyncEngine", "EngineClient", "EngineCore", "EngineHealth", "build_engine"]


def __getattr__(name: str) -> Any:
    """AsyncEngine and EngineCore on first use: they import torch (seconds), and the server imports
    this package's protocol before it listens (server/run.py answers /health while loading)."""
    if name == "AsyncEngine":
        from prefixserve.engine.async_engine import AsyncEngine

        return AsyncEngine
    if name == "EngineCore":
        from prefixserve.engine.core import EngineCore

        return EngineCore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


Progress = Callable[[str, str], None]  # (phase, what it is doing): server/startup.py's StartupProgress.phase


def build_engine(
    model_config: ModelConfig, cache_config: CacheConfig, engine_config: EngineConfig,
    progress: Progress | None = None, cache_listener: CacheListener | None = None,
    later: Later | None = None,
) -> AsyncEngine:
    """Load the model, run the invariance self-test, and start the engine thread.

    `progress` is called (on the engine's thread) as each long phase begins: "loading_model" (within
    it "native_kernels" then "loading_model" again where a first start's kernels still compile when
    the loader needs them), "self_test" (the two again for --dtype auto's fp32 retry), "cache_tiers"
    (where a disk or shared tier is configured). `cache_listener` is told of the RAM cache's entries (the KV
    events, docs/gateway.md); the caller owns and closes it. `later`: given, a model prepared anew is
    stored in the prepared-model cache by a job handed to it (`load_model`), which the caller runs
    once it serves. Raises models.ModelLoadError (with a clear message) when the model cannot be
    loaded."""
    from prefixserve.engine.async_engine import AsyncEngine
    from prefixserve.engine.torch_thread import TorchThread

    thread = TorchThread()
    try:
        core, model_id, tokenizer, detail, vocab_size = thread.call(
            lambda: _build_core(model_config, cache_config, engine_config, progress or _silent, cache_listener, later)
        )
    except BaseException:
        thread.close()
        raise
    source = os.path.abspath(model_config.path) if model_config.path else "embedded"
    return AsyncEngine(core, model_id, tokenizer, detail, vocab_size, thread, model_source=source)


def default_num_threads() -> int:
    """Torch threads when `--num-threads` is not given: every usable core but one (at least one).

    One OpenMP team over every core stalls at each of a forward's ~1,000 parallel regions whenever
    any other process takes a core: measured on 2 cores with a busy Python loop beside the server, a
    cold 600-token prompt took 33.6 s instead of 1.48 s (22.8x) with 2 threads, and 1.81 s instead of
    1.79 s with 1; warm TTFT 290 vs 66 ms with 2 threads, 58 vs 39 ms with 1 (the HTTP server and
    tokenizer keep the spare core). OMP_WAIT_POLICY=passive instead doubles the quiet time (3.1 s).
    docs/architecture.md, "Threads"."""
    from prefixserve.models.kernels.threads import usable_cores

    return max(1, usable_cores() - 1)


def _silent(phase: str, detail: str) -> None:
    pass


def _build_core(
    model_config: ModelConfig, cache_config: CacheConfig, engine_config: EngineConfig, progress: Progress,
    cache_listener: CacheListener | None, later: Later | None = None,
) -> tuple[EngineCore, str, Any, str, int]:
    """Runs on the engine's TorchThread, which all later torch work uses too: the runtime's threads and
    kernels, the model and its self-test, the cache tiers, then the core. Returns the core, the served
    model's id, the server's tokenizer, the self-test's verdict and the vocabulary's size."""
    import torch

    from prefixserve.cache import PrefixCache
    from prefixserve.engine.core import EngineCore

    device, dtype = _prepare_runtime(model_config)
    loaded, runner, result, dtype = _load_self_tested(model_config, device, dtype, progress, later)
    disk, shared = _open_tiers(cache_config, loaded, device, progress)
    max_len = _context_length(model_config, loaded.arch.max_position)
    if cache_config.max_bytes == 0 and (cache_config.disk_max_bytes > 0 or cache_config.shared is not None):
        log.warning("--cache-max-bytes 0 turns caching off: the disk and shared tiers are neither written nor read")
    core = EngineCore(
        runner=runner,
        tokenizer=loaded.tokenizer.copy(),  # the engine thread's own: never waits on the server's encodes
        cache=PrefixCache(cache_config, cache_listener),
        config=engine_config,
        max_model_len=max_len,
        emit=lambda rid, d: None,
        exact_reuse=result.ok,
        disk=disk,
        shared=shared,
        # the grammar compiler is built once the server serves (AsyncEngine.build_grammars_soon), not
        # here: its build holds the GIL (~0.5 s), which made up most of a second start's self-test phase
    )
    model_id = model_config.served_model_name or loaded.name
    log.info("model %s (%s, %s, %s), context %d tokens, %d threads, decode kernel %s", model_id, loaded.arch.arch,
             dtype, device, max_len, torch.get_num_threads(),
             loaded.decoder.decode_kernel + (" on int8 activations" if getattr(loaded.decoder, "decode_int8", False)
                                             else "")
             + ("" if loaded.decoder.decode_matches_prefill
                                             else " (a finished turn is re-fed by prefill before it is cached)"))
    return core, model_id, loaded.tokenizer, result.detail, loaded.arch.vocab_size


def _prepare_runtime(model_config: ModelConfig) -> tuple[str, Any]:
    """Set torch's and the decode kernels' threads, resolve the device and dtype. Returns (device,
    dtype). The native kernels (on a CPU) are built or found as the model loads: `load_model` waits for
    a first start's build only where it first needs them."""
    import torch

    from prefixserve.models import resolve_device, resolve_dtype
    from prefixserve.models.kernels.threads import KERNEL_THREADS, usable_cores

    torch.set_num_threads(model_config.num_threads or default_num_threads())
    KERNEL_THREADS.configure(model_config.decode_threads or usable_cores())
    return resolve_device(model_config.device), resolve_dtype(model_config.dtype)


def _load_self_tested(
    model_config: ModelConfig, device: str, dtype: Any, progress: Progress,
    later: Later | None = None,
) -> tuple[Any, ModelRunner, SelfTestResult, Any]:
    """Load the model and run the invariance self-test (its verdict remembered under the prepared-model
    cache); with --dtype auto, a failed non-fp32 mode is loaded again in fp32 and tested. Returns
    (loaded model, runner, self-test result, dtype)."""
    import torch

    from prefixserve.models import load_model
    from prefixserve.models.kernels import native
    from prefixserve.runner import ModelRunner
    from prefixserve.runner.selftest_memo import remembered_self_test

    model_name = os.path.basename(model_config.path) if model_config.path else "the embedded model"
    cache_note = (f"from or into the prepared-model cache {model_config.cache_dir}" if model_config.cache_dir
                  else "without the prepared-model cache")

    def load(dtype: torch.dtype, decode_kernel: str) -> Any:
        loading = f"loading {model_name} ({str(dtype).removeprefix('torch.')}, {device}) {cache_note}"

        def waiting(begins: bool) -> None:  # for the native kernels' build, where a first start's is still running
            progress(*(("native_kernels", f"native kernels: waiting for their build ({native.build_dir()})")
                       if begins else ("loading_model", loading)))

        progress("loading_model", loading)
        return load_model(model_config.path, dtype, device, decode_kernel=decode_kernel,
                          cache_dir=model_config.cache_dir, waiting=waiting, later=later)

    loaded = load(dtype, model_config.decode_kernel)
    memo = None if model_config.cache_dir is None else os.path.join(model_config.cache_dir, "selftest")

    def self_test(runner: ModelRunner, identity: str | None) -> SelfTestResult:
        progress("self_test", "self-test: checking that this machine computes cached states exactly"
                 + (" (a verdict remembered for this machine and build skips most of it)"
                    if memo is not None and not model_config.fresh_self_test else ""))
        return remembered_self_test(runner, memo, identity, fresh=model_config.fresh_self_test)

    runner = ModelRunner(loaded.decoder)
    result = self_test(runner, loaded.identity)
    if not result.ok and model_config.dtype == "auto" and dtype != torch.float32:
        # --dtype auto takes the fastest mode that is exact here: bf16 failed, so try fp32
        log.warning("self-test (%.1fs): %s; trying fp32", result.seconds, result.detail)
        dtype = torch.float32
        loaded = load(dtype, "dense")
        runner = ModelRunner(loaded.decoder)
        result = self_test(runner, loaded.identity)
    (log.info if result.ok else log.error)("self-test (%.1fs%s): %s", result.seconds,
                                           f", remembered: {result.remembered}" if result.remembered else "",
                                           result.detail)
    return loaded, runner, result, dtype


def _open_tiers(cache_config: CacheConfig, loaded: Any, device: str, progress: Progress
                ) -> tuple[DiskTier | None, SharedTier | None]:
    """The disk and shared (Redis) tiers the config asks for, each None when off (and both while the
    RAM cache is off), under one fingerprint (`tier_fingerprint`). Returns (disk, shared)."""
    disk: DiskTier | None = None
    shared: SharedTier | None = None
    if cache_config.max_bytes == 0 or (cache_config.disk_max_bytes == 0 and cache_config.shared is None):
        return disk, shared
    progress("cache_tiers", "opening the cache tiers (" + ", ".join(
        ([f"disk {cache_config.disk_dir}"] if cache_config.disk_max_bytes > 0 else [])
        + (["shared (Redis)"] if cache_config.shared is not None else [])) + ")")
    from prefixserve import __version__
    from prefixserve.cache.tier import TierKeys
    from prefixserve.runner.codec import SnapshotCodec

    fingerprint = tier_fingerprint(loaded.path, loaded.decoder, loaded.identity)
    # the names of namespaces and prefixes: keyed by the deployment secret where there is one (the
    # disk then names its files as the replicas name Redis keys), else by the disk directory's key
    keys = None if cache_config.shared is None else TierKeys.from_secret(cache_config.shared.secret)
    if cache_config.disk_max_bytes > 0:
        from prefixserve.cache.disk import DiskTier

        assert cache_config.disk_dir is not None
        disk = DiskTier(cache_config.disk_dir, cache_config.disk_max_bytes, fingerprint, __version__,
                        SnapshotCodec(device), keys)
    if cache_config.shared is not None:
        from prefixserve.cache.shared import SharedTier

        shared = SharedTier(cache_config.shared, fingerprint, __version__, SnapshotCodec(device), keys)
    return disk, shared


def _context_length(model_config: ModelConfig, max_position: int) -> int:
    """The context: the model's positions, or fewer where --max-model-len asks (more is warned about)."""
    max_len = max_position
    if model_config.max_model_len is not None:
        if model_config.max_model_len > max_len:
            log.warning("--max-model-len %d is beyond the model's %d positions: the context is %d tokens",
                        model_config.max_model_len, max_len, max_len)
        max_len = min(max_len, model_config.max_model_len)
    return max_len


def tier_fingerprint(model_path: str, decoder: Any, identity: str | None = None) -> str:
    """One fingerprint for every lower tier (docs/cache.md, "File format"): the model's bytes and the
    runtime's identity (runner/identity.py: package version, the code that computes states, torch's
    version and build, the CPU and its flags, the native kernels' build, dtype, kernels, threads),
    whose digest `system_fingerprint` carries too. A disk file or Redis value of any other
    fingerprint is dropped, never served. The kernel choices are spelled out for the logs.
    `identity`: the model's digest when the loader already read every byte for it (not read again)."""
    from prefixserve.models.loaders.prepared import file_identity  # a digest of the model's bytes
    from prefixserve.runner.identity import runtime_identity

    runtime = runtime_identity(decoder)
    return f"{identity or file_identity(model_path)}|{runtime.kernels}|runtime={runtime.digest()}"
