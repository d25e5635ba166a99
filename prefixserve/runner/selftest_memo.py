"""The self-test's verdict, remembered per machine and build, so a second start skips the checks.

The start-up self-test (runner/selftest.py) calls the runtime's kernels on fixed inputs and compares
bits. Its outcome — the tile plan, whether the 4-bit decode rows stay, which call kinds run on the
kernel threads — is a function of the things that decide those bits: the model's bytes, the
runtime's kernel choices, torch's build and CPU dispatch, the native kernels' build (source, flags,
compiler, CPU flags), the CPU, the thread counts, the environment variables that steer OpenMP, MKL
and oneDNN, and our own code. A pass recorded under exactly those (`fingerprint`) is the pass the
test would give again, so a later start with the same fingerprint applies it instead of running
~2.5-3.5 s of checks (docs/architecture.md, "Start-up"). Anything that differs — another CPU under
the same disk, an upgraded torch, an edited kernel, another `--decode-threads` — is another
fingerprint and runs the whole test. Only passes are kept: a failing machine re-runs the test at
every start and says why. `--fresh-self-test` (PREFIXSERVE_FRESH_SELF_TEST=1) runs it anyway and
records the new outcome.

A remembered start still runs one short prompt and one decode step (`_warm`), so the first request
does not pay for the lazily built native plans, thread pools and scratch buffers.

Records live beside the prepared-model cache (`<model cache dir>/selftest/<digest>.json`), written to
a temporary file and renamed into place; the newest MAX_RECORDS are kept. A record that does not
parse or whose fingerprint differs from its name's is ignored (and the test runs).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from typing import Any

import torch

from prefixserve.models.kernels import native
from prefixserve.models.kernels.threads import KERNEL_THREADS
from prefixserve.models.layers import TilePlan
from prefixserve.runner.identity import runtime_identity
from prefixserve.runner.runner import ModelRunner, StepItem
from prefixserve.runner.selftest import SelfTestResult, self_test

log = logging.getLogger("prefixserve.engine")

FORMAT = 2  # 2: the runtime's part is runner/identity.py's
MAX_RECORDS = 16
# environment variables that steer the kernels' threading and dispatch (and so, possibly, their bits)
_ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "DNNL_", "ONEDNN_", "ATEN_", "TORCH_", "OPENBLAS_",
                 "PREFIXSERVE_NATIVE", "PREFIXSERVE_DENSE_MATMUL", "PREFIXSERVE_DECODE_ACTIVATIONS", "CUDA_", "CUBLAS_")


def fingerprint(runner: ModelRunner, model_identity: str) -> dict[str, str]:
    """Everything the self-test's outcome depends on, taken before the test mutates the decoder: the
    runtime's identity (runner/identity.py, which the cache tiers and system_fingerprint use too)
    and what only the test's outcome adds (the decoder's formulation, the native build's file, which
    names its compiler, the environment, Python)."""
    dec = runner.decoder
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
    return runtime_identity(dec).parts() | {
        "format": str(FORMAT),
        "model": model_identity,
        "decoder": f"int4_decode={getattr(dec, 'int4_decode', False)}|prefill_q4={getattr(dec, 'prefill_q4', False)}"
                   f"|prefill_int8={getattr(dec, 'prefill_int8', False)}"
                   f"|decode_int8={getattr(dec, 'decode_int8', False)}"
                   f"|native_attention={getattr(dec, 'native_attention', False)}|{type(dec).__name__}",
        "native_build": native.build_name(),
        "env": json.dumps(env, sort_keys=True),
        "python": sys.version,
    }


def _record_path(folder: str, parts: dict[str, str]) -> str:
    key = hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=16).hexdigest()
    return os.path.join(folder, f"{key}.json")


def _recall(path: str, parts: dict[str, str]) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            record = json.load(f)
        if record.get("fingerprint") != parts:
            return None
        outcome = record["outcome"]
        rows = outcome["tiles"]
        if not (isinstance(rows, list) and len(rows) == 2 and all(type(r) is int and r >= 1 for r in rows)
                and type(outcome["dropped_int4"]) is bool and isinstance(outcome["detail"], str)
                and isinstance(outcome["allowed"], list) and all(isinstance(k, str) for k in outcome["allowed"])
                and isinstance(record["seconds"], (int, float)) and isinstance(record["created"], str)):
            return None
        return record  # type: ignore[no-any-return]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _store(path: str, parts: dict[str, str], outcome: dict[str, Any], seconds: float) -> None:
    """Failures are logged, never raised: the record only saves time."""
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump({"fingerprint": parts, "outcome": outcome, "seconds": round(seconds, 3),
                       "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}, f, indent=1)
        os.replace(tmp, path)
        records = sorted((os.path.getmtime(os.path.join(folder, n)), n) for n in os.listdir(folder)
                         if n.endswith(".json") and not n.startswith("."))
        for _, name in records[: max(0, len(records) - MAX_RECORDS)]:
            os.unlink(os.path.join(folder, name))
    except OSError as e:
        log.warning("self-test: cannot record the verdict in %s (%s)", folder, e)


def _apply(runner: ModelRunner, outcome: dict[str, Any]) -> None:
    """Set on the decoder what the test chose: the same mutations `self_test` makes."""
    dec = runner.decoder
    if outcome["dropped_int4"]:
        dec.drop_int4()
    dec.tiles = TilePlan(*outcome["tiles"])
    KERNEL_THREADS.allow(set(outcome["allowed"]))


def _warm(runner: ModelRunner) -> None:
    """One short prompt and one decode step: builds what the first request would otherwise wait for."""
    st = runner.new_state()
    runner.step([StepItem(st, list(range(1, 17)))])
    assert st.logits is not None
    runner.step([StepItem(st, [int(torch.argmax(st.logits))], decode=True)])


def remembered_self_test(runner: ModelRunner, folder: str | None, model_identity: str | None,
                         fresh: bool = False) -> SelfTestResult:
    """`self_test(runner)`, or the verdict a previous run recorded under the same fingerprint in
    `folder` (None, or no model identity: always run). `fresh`: run it and record it anyway."""
    if folder is None or model_identity is None:
        return self_test(runner)
    t0 = time.perf_counter()
    parts = fingerprint(runner, model_identity)
    path = _record_path(folder, parts)
    record = None if fresh else _recall(path, parts)
    if record is not None:
        _apply(runner, record["outcome"])
        _warm(runner)
        seconds = time.perf_counter() - t0
        when = f"the pass of {record['created']} ({record['seconds']:.1f} s) on this machine, build and model"
        return SelfTestResult(True, str(runner.decoder.tiles), runner.decoder.decode_kernel,
                              record["outcome"]["detail"], seconds, when)
    had_int4 = getattr(runner.decoder, "int4_decode", False)
    result = self_test(runner)
    if result.ok:
        outcome = {
            "tiles": [runner.decoder.tiles.rows, runner.decoder.tiles.head_rows],
            "dropped_int4": bool(had_int4 and not getattr(runner.decoder, "int4_decode", False)),
            "allowed": sorted(KERNEL_THREADS.allowed),
            "detail": result.detail,
        }
        _store(path, parts, outcome, result.seconds)
    return result
