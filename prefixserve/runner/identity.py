"""The runtime's identity: everything besides the model's bytes that decides the bits of a state or
an output this process computes.

One `RuntimeIdentity` (`runtime_identity(decoder)`) feeds every place that must tell one runtime's
states from another's:

- the lower cache tiers' fingerprint (`engine.tier_fingerprint`: disk file headers, the Redis key
  space and value headers), so a disk file or a Redis value computed by another runtime is dropped,
  never served (docs/cache.md, "File format");
- the OpenAI `system_fingerprint` (engine/async_engine.py);
- the self-test's remembered verdict (runner/selftest_memo.py), which adds what only the test's
  outcome depends on (the native build's compiler, the environment, Python).

It covers our package version and the source of the code that computes states (`CODE_DIRS`: every
.py, .c and .h of prefixserve/models and prefixserve/runner), torch's version and build
(`torch.__config__.show()`), torch's CPU dispatch level, the CPU (model, family, stepping and flags
from `native.cpu_info()`) and the native kernels' build identity (`native.digest()`: their source,
flags and the CPU flags they are built for), the GPU where there is one, and the decoder's own
choices: dtype and kernels (`kernel_fingerprint()`: decode kernel, tile plan, matmul precision,
attention kernel, device) and the thread counts. Nothing here proves a difference in any of these
leaves the bits alone, so any difference is another identity.

The parts that cannot change while the process runs are read once (`code_digest`, `torch_build`,
`cpu`); tests that vary them clear those caches.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
from dataclasses import dataclass
from typing import Any

import torch

from prefixserve import __version__
from prefixserve.models.kernels import native
from prefixserve.models.kernels.threads import KERNEL_THREADS

CODE_DIRS = ("models", "runner")  # the code that computes states, and the self-test that checks it
_CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags")


@dataclass(frozen=True, slots=True)
class RuntimeIdentity:
    """What decides a computed state's bits, besides the model's bytes (module docstring)."""

    version: str  # prefixserve.__version__
    code: str  # code_digest(): models/ and runner/ sources
    torch: str  # torch.__version__
    torch_build: str  # torch_build(): a digest of torch.__config__.show()
    cpu_capability: str  # torch's CPU dispatch level (AVX2, AVX512, ...)
    cpu: str  # cpu(): model and flags
    native: str  # native.digest(): the native kernels' source, flags and target CPU flags
    gpu: str  # the CUDA device and CUDA version; "" on the CPU
    dtype: str
    kernels: str  # the decoder's kernel_fingerprint()
    threads: str  # torch and kernel-team threads

    def parts(self) -> dict[str, str]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def digest(self) -> str:
        """32 hex digits naming this identity: equal exactly when every part is."""
        data = json.dumps(self.parts(), sort_keys=True).encode()
        return hashlib.blake2b(data, digest_size=16).hexdigest()


def runtime_identity(decoder: Any) -> RuntimeIdentity:
    """The identity of the runtime `decoder` runs in (its dtype, device and kernel choices as they
    are now: take it after the self-test has chosen them)."""
    device = getattr(decoder, "device", None)
    gpu = ""
    if device is not None and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = f"{props.name}|{props.major}.{props.minor}|cuda {torch.version.cuda}"
    return RuntimeIdentity(
        version=__version__,
        code=code_digest(),
        torch=torch.__version__,
        torch_build=torch_build(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        cpu=cpu(),
        native=native.digest(),
        gpu=gpu,
        dtype=str(decoder.dtype),
        kernels=decoder.kernel_fingerprint(),
        threads=f"torch={torch.get_num_threads()}|kernel={KERNEL_THREADS.threads}",
    )


@functools.cache
def code_digest() -> str:
    """BLAKE2b-128 of every .py, .c and .h file (name and bytes) in CODE_DIRS and their subfolders."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.blake2b(digest_size=16)
    for sub in CODE_DIRS:
        folder = os.path.join(root, sub)
        names = (os.path.relpath(os.path.join(d, n), folder) for d, _, files in os.walk(folder) for n in files)
        for name in sorted(names):
            if name.endswith((".py", ".c", ".h")):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(f"{sub}/{name}".encode() + b"\0" + f.read())
    return h.hexdigest()


@functools.cache
def torch_build() -> str:
    """BLAKE2b-128 of torch's build configuration (compiler, BLAS, ISA flags, ...)."""
    return hashlib.blake2b(torch.__config__.show().encode(), digest_size=16).hexdigest()


@functools.cache
def cpu() -> str:
    """The CPU's identity and flags (the first processor's, `native.cpu_info()`) and the machine."""
    info = native.cpu_info()
    keep = {k: info[k] for k in _CPU_FIELDS if k in info}
    keep["machine"] = platform.machine()
    return json.dumps(keep, sort_keys=True)
