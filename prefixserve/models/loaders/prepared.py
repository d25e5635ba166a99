"""Prepared-model cache: a GGUF file's decoder weights and tokenizer, stored once in the form the
runtime uses, so later starts skip parsing and dequantising (docs/architecture.md, "Start-up").

Opening the embedded SmolLM2 GGUF the first time costs ~15-19 s on 2 cores: the `gguf` package
parses the 49k-token vocabulary field by field in Python (once for the architecture, once for the
weights, once more inside transformers' tokenizer conversion), then every tensor is dequantised to
fp32, cast, fused and its 4-bit codes repacked. None of it depends on anything but the file's
bytes, the dtype and device, the int4 kernel's packing (torch version and CPU capability) and this
code. An entry is a directory named by a digest of all of these:

    manifest.json   the key's parts, the architecture, the payload's size and XXH3-128 digest
    tensors.pt      every decoder tensor and 4-bit pack (torch.save; loaded with weights_only)
    tokenizer/      the converted tokenizer (save_pretrained), loaded back as a model folder

A load verifies the payload's digest before using it: a torn, truncated or bit-flipped entry is
removed and the model is prepared from the file again, so the cache can make start-up faster and
never change a bit. Entries are written to a temporary directory and renamed into place (two
processes starting together both prepare; the first rename wins). At most MAX_ENTRIES are kept,
least recently used first out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch
import xxhash

from prefixserve.models.arch import ArchConfig
from prefixserve.models.kernels import int4
from prefixserve.models.kernels.int4 import Int4Weight
from prefixserve.models.layers import TilePlan
from prefixserve.models.llama.decoder import Decoder
from prefixserve.models.llama.layer_weights import LayerWeights
from prefixserve.models.tokenizer import Tokenizer, load_tokenizer_folder

log = logging.getLogger("prefixserve.models")

FORMAT = 2  # 2: digests are XXH3-128 (were blake2b)
MAX_ENTRIES = 4
# the code that turns a file into the runtime's tensors: a change to any of it is a new key
# (paths under models/; kernels/qmatmul.c: the native 4-bit layout)
_PREPARING_MODULES = ("loaders/prepared.py", "loaders/gguf.py", "loaders/llama_weights.py", "kernels/int4.py",
                      "tokenizer.py", "loaders/load.py", "llama/decoder.py", "llama/layer_weights.py",
                      "kernels/qmatmul.c")
_LAYER_TENSORS = ("attn_norm", "qkv", "qkv_bias", "o_proj", "mlp_norm", "gate_up", "down", "q_norm", "k_norm")
_LAYER_INT4 = ("qkv_q4", "o_q4", "gate_up_q4", "down_q4")
Later = Callable[[Callable[[], None]], None]  # takes a job to run when its caller has time (`save_later`)


def file_identity(path: str) -> str:
    """A digest of a model's bytes (a file: all of it; a folder: every file's name, size and mtime).

    XXH3-128: it guards against damage and mix-ups, not against someone forging a model file (whoever
    can write the model can change the weights). The 380 MB payload took 0.09 s against blake2b's 0.6
    (one core of the Ice Lake Xeon, file in the page cache)."""
    h = xxhash.xxh3_128()
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            st = os.stat(os.path.join(path, name))
            h.update(f"{name}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    else:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def _code_digest() -> str:
    h = hashlib.blake2b(digest_size=16)
    models_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in _PREPARING_MODULES:
        with open(os.path.join(models_dir, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def key_parts(identity: str, dtype: torch.dtype, device: str, use_int4: bool) -> dict[str, str]:
    """Everything a prepared entry's bits depend on."""
    return {
        "format": str(FORMAT),
        "model": identity,
        "dtype": str(dtype),
        "device": device,
        "int4": str(use_int4),
        # 4-bit weights packed for the native kernels or for torch's (models/kernels/int4.py)
        "int4_native": str(use_int4 and int4.native_available(dtype, device)),
        "torch": torch.__version__,
        # the int4 kernel's packed layout follows the ISA torch dispatches to
        "cpu_capability": torch.backends.cpu.get_cpu_capability() if device == "cpu" else "",
        "code": _code_digest(),
    }


def entry_key(parts: Mapping[str, str]) -> str:
    return hashlib.blake2b("\x1f".join(f"{k}={v}" for k, v in sorted(parts.items())).encode(),
                           digest_size=16).hexdigest()


def load(cache_dir: str, parts: Mapping[str, str], tiles: TilePlan) -> tuple[Decoder, Tokenizer] | None:
    """The cached decoder and tokenizer for `parts`, or None (absent, or damaged: then removed)."""
    entry = os.path.join(cache_dir, entry_key(parts))
    manifest_path = os.path.join(entry, "manifest.json")
    if not os.path.isfile(manifest_path):
        return None
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest.get("key") != dict(parts):
            raise ValueError("the manifest's key does not match its directory")
        payload = os.path.join(entry, "tensors.pt")
        if os.path.getsize(payload) != manifest["payload_bytes"]:
            raise ValueError("tensors.pt does not have its size")
        # one after the other: side by side in threads (as when the digest was blake2b's ~1.1 s, which
        # lets go of the GIL) the three now took longer than in a row, all of it Python holding the
        # GIL: the digest ~0.1 s, the tokenizer ~1.1-1.5 s (importing transformers, building the
        # fast tokenizer). The payload is mapped, not read (~0.04 s instead of ~0.4 s): the digest
        # has just brought it into the page cache, entries are never written in place (a new one
        # is renamed into place, an old one unlinked), and the weights' pages are shared with the
        # page cache instead of copied.
        digest = file_identity(payload)
        tensors = torch.load(payload, map_location=parts["device"], weights_only=True, mmap=True)
        tokenizer = load_tokenizer_folder(os.path.join(entry, "tokenizer"), manifest["extra_eos_ids"])
        if digest != manifest["payload_xxh3"]:
            raise ValueError("tensors.pt does not match its digest")
        arch = ArchConfig(**manifest["arch"])
        decoder = _decoder(arch, tensors, tiles)
    except Exception as e:  # noqa: BLE001  -- anything wrong with an entry means: prepare again
        log.warning("prepared-model cache: dropping %s (%s: %s)", entry, type(e).__name__, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    os.utime(manifest_path)  # recency for the LRU
    return decoder, tokenizer


def save(cache_dir: str, parts: Mapping[str, str], decoder: Decoder, tokenizer: Tokenizer) -> None:
    """Store a freshly prepared model. Failures are logged, never raised (the cache is an optimisation)."""
    save_while(cache_dir, parts, decoder, lambda: tokenizer)


def save_while(cache_dir: str, parts: Mapping[str, str], decoder: Decoder,
               make_tokenizer: Callable[[], Tokenizer]) -> Tokenizer:
    """`save` of a decoder whose tokenizer `make_tokenizer` converts on this thread meanwhile: the
    tensors are written on a thread of their own. The write is mostly the kernel filling the page
    cache (torch.save lets go of the GIL) and the conversion is Python holding it, so side by side
    they take about as long as the longer of the two (on the 2-core Zen 3 VM, first start: the
    write 1.8-2.9 s, the conversion 1.4-1.7 s, until now one after the other). Returns the
    tokenizer; an exception of `make_tokenizer` is raised once the write has stopped, and leaves
    no entry."""
    entry = os.path.join(cache_dir, entry_key(parts))
    tmp = _begin(cache_dir, entry)
    if tmp is None:
        return make_tokenizer()
    payload = os.path.join(tmp, "tensors.pt")
    written: list[BaseException | None] = []

    def write() -> None:
        try:
            torch.save(_tensors(decoder), payload)
            written.append(None)
        except BaseException as e:  # noqa: BLE001  -- handed to the caller's thread below
            written.append(e)

    writer = threading.Thread(target=write, name="prefixserve-prepared-save")
    writer.start()
    try:
        tokenizer = make_tokenizer()
    except BaseException:
        writer.join()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    writer.join()
    try:
        (failure,) = written
        if failure is not None:
            raise failure
        tokenizer.hf.save_pretrained(os.path.join(tmp, "tokenizer"))
        _finish(tmp, entry, parts, decoder.arch, tokenizer.extra_eos_ids)
    except OSError as e:
        log.warning("prepared-model cache: cannot store %s (%s)", entry, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when renamed
    return tokenizer


def save_later(cache_dir: str, parts: Mapping[str, str], decoder: Decoder,
               tokenizer: Tokenizer) -> Callable[[], None] | None:
    """Store a freshly prepared model in two steps: the tokenizer now (on this thread: the object is
    the server's from here on, and a fast tokenizer is not to be used from two threads at once),
    the tensors by the returned job, which the caller runs when the write costs nothing it waits
    for (the server: on a thread of its own once it serves). The job holds the tensors as prepared
    now, whatever the loader then does to the decoder (fp32 copies, AMX packs replace them, never
    change them). None: nothing to store (the entry is there, or no directory can be made). The job
    logs a failure (a full disk), never raises, and leaves no temporary directory."""
    entry = os.path.join(cache_dir, entry_key(parts))
    tmp = _begin(cache_dir, entry)
    if tmp is None:
        return None
    try:
        tokenizer.hf.save_pretrained(os.path.join(tmp, "tokenizer"))
    except OSError as e:
        log.warning("prepared-model cache: cannot store %s (%s)", entry, e)
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    tensors, arch, extra_eos_ids = _tensors(decoder), decoder.arch, tuple(tokenizer.extra_eos_ids)

    def store() -> None:
        t0 = time.perf_counter()
        try:
            torch.save(tensors, os.path.join(tmp, "tensors.pt"))
            _finish(tmp, entry, parts, arch, extra_eos_ids)
            log.info("prepared-model cache: stored %s in %.1f s", entry, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001  -- a background write: logged, the next start prepares again
            log.warning("prepared-model cache: cannot store %s (%s: %s)", entry, type(e).__name__, e)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already when renamed

    return store


STALE_TMP_S = 3600.0  # a temporary directory untouched this long is a dead process's: removed


def _begin(cache_dir: str, entry: str) -> str | None:
    """A temporary directory for `entry` in `cache_dir` (removing dead processes' ones), or None
    where the entry is there already or no directory can be made (logged)."""
    if os.path.isdir(entry):
        return None
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for name in os.listdir(cache_dir):
            path = os.path.join(cache_dir, name)
            if name.startswith(".tmp-") and time.time() - os.path.getmtime(path) > STALE_TMP_S:
                shutil.rmtree(path, ignore_errors=True)
        return tempfile.mkdtemp(prefix=".tmp-", dir=cache_dir)
    except OSError as e:
        log.warning("prepared-model cache: cannot store %s (%s)", entry, e)
        return None


def _finish(tmp: str, entry: str, parts: Mapping[str, str], arch: ArchConfig, extra_eos_ids: Sequence[int]) -> None:
    """The manifest of `tmp`, whose tensors.pt and tokenizer/ are written, then `tmp` renamed to
    `entry` (atomic: a concurrent process's rename wins, this one's OSError) and the least recently
    used entries over MAX_ENTRIES removed."""
    payload = os.path.join(tmp, "tensors.pt")
    manifest = {
        "key": dict(parts),
        "arch": asdict(arch),
        "extra_eos_ids": list(extra_eos_ids),
        "payload_bytes": os.path.getsize(payload),
        "payload_xxh3": file_identity(payload),
        "created": time.time(),
    }
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, entry)  # atomic; fails if another process got there first
    _evict(os.path.dirname(entry), keep=os.path.basename(entry))


def cached_or_prepare(
    cache_dir: str, parts: Mapping[str, str], tiles: TilePlan,
    prepare: Callable[[], tuple[Decoder, Callable[[], Tokenizer]]],
    later: Later | None = None,
) -> tuple[Decoder, Tokenizer, bool]:
    """(decoder, tokenizer, from_cache). `prepare` returns the decoder and a call that converts its
    tokenizer, made while the decoder's tensors are stored (`save_while`); or, given `later`, the
    tensors are stored by a job handed to it (`save_later`)."""
    got = load(cache_dir, parts, tiles)
    if got is not None:
        return got[0], got[1], True
    decoder, make_tokenizer = prepare()
    if later is None:
        return decoder, save_while(cache_dir, parts, decoder, make_tokenizer), False
    tokenizer = make_tokenizer()
    job = save_later(cache_dir, parts, decoder, tokenizer)
    if job is not None:
        later(job)
    return decoder, tokenizer, False


def _int4(w: Int4Weight | None) -> dict[str, Any] | None:
    if w is None:
        return None
    return {"out": w.out_features, "packed": [p for p, _ in w.parts], "sz": [s for _, s in w.parts],
            "native": w.native, "native_kind": w.native_kind}


def _from_int4(d: dict[str, Any] | None) -> Int4Weight | None:
    if d is None:
        return None
    return Int4Weight(list(zip(d["packed"], d["sz"])), int(d["out"]), d.get("native"), int(d.get("native_kind", 0)))


def _tensors(decoder: Decoder) -> dict[str, Any]:
    layers = []
    for lw in decoder.layers:
        layer: dict[str, Any] = {name: getattr(lw, name) for name in _LAYER_TENSORS}
        layer.update({name: _int4(getattr(lw, name)) for name in _LAYER_INT4})
        layers.append(layer)
    tied = decoder.lm_head is decoder.embed
    return {
        "embed": decoder.embed,
        "lm_head": None if tied else decoder.lm_head,
        "final_norm": decoder.final_norm,
        "lm_head_q4": _int4(decoder.lm_head_q4),
        "layers": layers,
    }


def _decoder(arch: ArchConfig, t: dict[str, Any], tiles: TilePlan) -> Decoder:
    if len(t["layers"]) != arch.num_layers:
        raise ValueError(f"{len(t['layers'])} layers stored, the architecture has {arch.num_layers}")
    layers = []
    for d in t["layers"]:
        lw = LayerWeights(**{name: d[name] for name in _LAYER_TENSORS})
        for name in _LAYER_INT4:
            setattr(lw, name, _from_int4(d[name]))
        layers.append(lw)
    embed = t["embed"]
    lm_head = embed if t["lm_head"] is None else t["lm_head"]
    decoder = Decoder(arch, embed, layers, t["final_norm"], lm_head, tiles)
    decoder.lm_head_q4 = _from_int4(t["lm_head_q4"])
    # as llama_weights.attach_int4 sets it: any linear weight with a 4-bit copy
    decoder.int4_decode = decoder.lm_head_q4 is not None or any(
        getattr(lw, name) is not None for lw in layers for name in _LAYER_INT4)
    if decoder.int4_decode and not int4.available(decoder.dtype, decoder.device.type):
        raise ValueError("the entry holds 4-bit weights this runtime cannot run")
    packs = [decoder.lm_head_q4] + [getattr(lw, name) for lw in layers for name in _LAYER_INT4]
    if any(w is not None and w.native is not None for w in packs) and not int4.native_available(
            decoder.dtype, decoder.device.type):
        raise ValueError("the entry holds 4-bit weights packed for native kernels that did not build")
    return decoder


def _evict(cache_dir: str, keep: str) -> None:
    entries = []
    for name in os.listdir(cache_dir):
        manifest = os.path.join(cache_dir, name, "manifest.json")
        if name != keep and os.path.isfile(manifest):
            entries.append((os.path.getmtime(manifest), name))
    for _, name in sorted(entries)[: max(0, len(entries) + 1 - MAX_ENTRIES)]:
        shutil.rmtree(os.path.join(cache_dir, name), ignore_errors=True)
