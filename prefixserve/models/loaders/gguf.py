"""GGUF files (llama.cpp's format): metadata -> ArchConfig, tensors dequantised with the `gguf` package."""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from prefixserve.models.arch import ArchConfig, ModelLoadError
from prefixserve.models.kernels.int4 import Codes, codes_from_gguf, permute_rows

# Types we have tested; the gguf package dequantises more, which we accept and name in errors if it fails.
TESTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
_ARCH_MAP = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


class GGUFTensor(NamedTuple):
    """One tensor of a GGUF file as `read_gguf` found it: `shape` in ggml's order (fastest-moving
    dimension first), `tensor_type` a GGML quantisation type number, `data` a read-only view of its
    bytes in the mapped file, shaped as the `gguf` package's reader shapes it (elements for float and
    integer types, [rows..., bytes per row] for block-quantised ones)."""

    name: str
    tensor_type: int
    shape: tuple[int, ...]
    data: np.ndarray


# GGUF value types: 0-7 and 10-12 scalars (struct format), 8 string, 9 array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_SKIPPED = "tokenizer.ggml."  # prefix of the keys `read_gguf` does not decode (the vocabulary: transformers reads it)
_UNREADABLE = object()
# tensor types whose data the gguf package's reader gives as elements, not block bytes
_ELEMENT_TYPES = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}


def read_gguf(path: str) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """A GGUF file's metadata and tensors in one pass over its header, the tensors' data mapped, not read.

    The metadata holds every key but those under `tokenizer.ggml.` (skipped unread), and the header's
    `GGUF.version`, `GGUF.tensor_count` and `GGUF.kv_count`, each value as the `gguf` package's
    `GGUFReader` fields' `contents()` give it (int, float, bool, str or a list of them);
    a value that does not decode (a string that is not UTF-8) is None. The tensors come in file order
    with plain ndarray views (no np.memmap: slicing a memmap per row block cost seconds of Python in
    dequantisation). The `gguf` package's reader decoded the 49k-token vocabulary element by element
    (~3 s on the 2-core machine, more under load) for metadata this loader never used.
    Raises ValueError (or struct.error) on a file that is not a well-formed GGUF v2/v3."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    header = _Header(memoryview(mm))
    version, n_tensors, n_kv = header.preamble()
    meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
    meta.update(header.metadata(n_kv))
    infos = header.tensor_infos(n_tensors)
    alignment = meta.get("general.alignment", 32)
    start = header.pos + (-header.pos % alignment)
    return meta, _mapped_tensors(mm, infos, start)


class _Header:
    """A cursor over a mapped GGUF file's header: each read decodes at `pos` and moves past it."""

    def __init__(self, blob: memoryview) -> None:
        self.blob = blob
        self.pos = 0

    def preamble(self) -> tuple[int, int, int]:
        """(version, tensor count, key-value count), after checking the magic and the version."""
        if bytes(self.blob[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (no GGUF magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", self.blob, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        self.pos = 24
        return version, n_tensors, n_kv

    def string(self) -> bytes:
        (n,) = struct.unpack_from("<Q", self.blob, self.pos)
        self.pos += 8 + n
        if self.pos > len(self.blob):
            raise ValueError("GGUF header runs past the end of the file")
        return bytes(self.blob[self.pos - n : self.pos])

    def u32(self) -> int:
        (v,) = struct.unpack_from("<I", self.blob, self.pos)
        self.pos += 4
        return int(v)

    def value(self, vtype: int, keep: bool) -> Any:
        """A value of GGUF type `vtype`: decoded where `keep`, else skipped (None); _UNREADABLE for a
        string that is not UTF-8 (or an array holding one)."""
        if vtype in _SCALARS:
            fmt = "<" + _SCALARS[vtype]
            (v,) = struct.unpack_from(fmt, self.blob, self.pos)
            self.pos += struct.calcsize(fmt)
            return v
        if vtype == 8:
            raw = self.string()
            if not keep:
                return None
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                return _UNREADABLE
        if vtype == 9:
            etype, count = struct.unpack_from("<IQ", self.blob, self.pos)
            self.pos += 12
            if etype in _NUMPY:
                arr = np.frombuffer(self.blob, dtype=_NUMPY[etype], count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist() if keep else None
            items = [self.value(etype, keep) for _ in range(count)]
            return _UNREADABLE if any(i is _UNREADABLE for i in items) else items
        raise ValueError(f"GGUF value type {vtype} is not known")

    def metadata(self, n_kv: int) -> dict[str, Any]:
        """The `n_kv` key-value pairs, those under _SKIPPED left out (skipped unread)."""
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self.string().decode("utf-8")
            vtype = self.u32()
            keep = not key.startswith(_SKIPPED)
            v = self.value(vtype, keep)
            if keep:
                meta[key] = None if v is _UNREADABLE else v
        return meta

    def tensor_infos(self, n_tensors: int) -> list[tuple[str, tuple[int, ...], int, int]]:
        """(name, dims in ggml's order, type, offset from the data start) of each tensor, in file order."""
        infos = []
        for _ in range(n_tensors):
            name = self.string().decode("utf-8")
            (n_dims,) = struct.unpack_from("<I", self.blob, self.pos)
            dims = struct.unpack_from(f"<{n_dims}Q", self.blob, self.pos + 4)
            ttype, offset = struct.unpack_from("<IQ", self.blob, self.pos + 4 + 8 * n_dims)
            self.pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, ttype, offset))
        return infos


def _mapped_tensors(mm: mmap.mmap, infos: list[tuple[str, tuple[int, ...], int, int]], start: int) -> list[GGUFTensor]:
    """Each tensor's data as a read-only view of the mapped file (its data section at `start`)."""
    import gguf

    tensors, seen = [], set()
    for name, dims, ttype, offset in infos:
        if name in seen:
            raise ValueError(f"duplicated tensor {name!r}")
        seen.add(name)
        qtype = gguf.GGMLQuantizationType(ttype)
        elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = elements * type_size // block
        shape = tuple(reversed(dims))
        at = start + offset
        if at + nbytes > len(mm):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        if qtype.name in _ELEMENT_TYPES:
            dtype = np.dtype(_ELEMENT_TYPES[qtype.name])
            data = np.frombuffer(mm, dtype=dtype, count=nbytes // dtype.itemsize, offset=at).reshape(shape)
        else:
            data = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=at).reshape(
                gguf.quants.quant_shape_to_byte_shape(shape, qtype))
        tensors.append(GGUFTensor(name, int(ttype), tuple(int(d) for d in dims), data))
    return tensors


class GGUFModel:
    """Opened GGUF file: `arch` and `tensor(hf_name)` returning fp32 tensors in HF layout; `meta` and
    `raw_tensors` as `read_gguf` gives them."""

    def __init__(self, path: str) -> None:
        import gguf

        if not os.path.isfile(path):
            raise ModelLoadError(f"model file not found: {path}")
        try:
            self.meta, self.raw_tensors = read_gguf(path)
        except Exception as e:  # a corrupt file fails in assorted ways (struct, numpy, gguf's enums)
            raise ModelLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from e
        self.path = path
        self._gguf = gguf
        self._tensors: dict[str, GGUFTensor] = {}
        for t in self.raw_tensors:
            self._tensors[_hf_name(t.name)] = t
        self.arch = self._arch_config()

    def tensor(self, hf_name: str) -> torch.Tensor | None:
        t = self._tensors.get(hf_name)
        if t is None:
            return None
        qtype = self._gguf.GGMLQuantizationType(t.tensor_type)
        try:
            data = dequantize(t.data, qtype)
        except NotImplementedError as e:
            raise ModelLoadError(
                f"tensor {t.name!r} uses quantisation type {qtype.name}, which cannot be dequantised "
                f"(supported and tested: {', '.join(TESTED_TYPES)})"
            ) from e
        # a copy only of what still is the file's memory (an unquantised tensor's mapped bytes)
        fresh = data.dtype == np.float32 and data.flags.c_contiguous and not np.may_share_memory(data, t.data)
        w = torch.from_numpy(data if fresh else np.array(data, dtype=np.float32, copy=True))
        if self._permuted and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.arch.num_heads if hf_name.endswith("q_proj.weight") else self.arch.num_kv_heads
            w = _unpermute(w, heads)
        return w

    def codes(self, hf_name: str) -> list[Codes] | None:
        """The tensor's raw 4-bit codes for the int4 decode kernel (models/kernels/int4.py), in HF row
        order; None when absent or not Q4_0 / Q4_1 / Q8_0."""
        t = self._tensors.get(hf_name)
        if t is None or len(t.shape) != 2:
            return None
        qtype = self._gguf.GGMLQuantizationType(t.tensor_type).name
        codes = codes_from_gguf(np.asarray(t.data), qtype, (int(t.shape[1]), int(t.shape[0])))
        if codes is not None and self._permuted and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.arch.num_heads if hf_name.endswith("q_proj.weight") else self.arch.num_kv_heads
            codes = permute_rows(codes, _unpermute(torch.arange(codes[0].q.shape[0]), heads))
        return codes

    def _arch_config(self) -> ArchConfig:
        name = self.meta.get("general.architecture")
        if name not in _ARCH_MAP:
            raise ModelLoadError(f"GGUF architecture {name!r} is not supported (supported: {', '.join(_ARCH_MAP)})")
        # llama.cpp's converter permutes q/k rows of llama-style models for its interleaved RoPE.
        self._permuted = name in ("llama", "mistral")

        def m(key: str, default: Any = None) -> Any:
            v = self.meta.get(f"{name}.{key}", default)
            if v is None:
                raise ModelLoadError(f"GGUF metadata {name}.{key} is missing")
            return v

        embed = self._tensors.get("model.embed_tokens.weight")
        if embed is None:
            raise ModelLoadError("GGUF file has no token_embd.weight tensor")
        hidden = int(m("embedding_length"))
        heads = int(m("attention.head_count"))
        return ArchConfig(
            arch=_ARCH_MAP[name],
            vocab_size=int(embed.shape[1]) if len(embed.shape) > 1 else int(m("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(m("feed_forward_length")),
            num_layers=int(m("block_count")),
            num_heads=heads,
            num_kv_heads=int(m("attention.head_count_kv", heads)),
            head_dim=int(m("attention.key_length", hidden // heads)),
            rope_theta=float(m("rope.freq_base", 10000.0)),
            rms_eps=float(m("attention.layer_norm_rms_epsilon", 1e-6)),
            max_position=int(m("context_length", 4096)),
            tie_embeddings="lm_head.weight" not in self._tensors,
            qkv_bias="model.layers.0.self_attn.q_proj.bias" in self._tensors,
            qk_norm="model.layers.0.self_attn.q_norm.weight" in self._tensors,
        )


@contextlib.contextmanager
def small_pages() -> Iterator[None]:
    """numpy's new large arrays on ordinary pages while a model is prepared (numpy asks the kernel for
    huge pages beyond 4 MB). On the 2-core Zen 3 VM, new memory after a minute idle: 30 MB numpy arrays
    on huge pages 5.5-15 ms a MB, on ordinary ones 0.5-0.6 (torch's tensors 0.3); the embedded model's
    `build_decoder` 1.18-1.55 -> 0.45-0.50 s and `attach_int4` 0.65-0.72 -> 0.44-0.47 s (docs/
    architecture.md, "Start-up"). A no-op where numpy has no such switch. Process-wide while it lasts:
    start-up only, where nothing else makes large numpy arrays."""
    try:
        from numpy._core.multiarray import _set_madvise_hugepage  # type: ignore[attr-defined]
    except ImportError:
        yield
        return
    was = _set_madvise_hugepage(False)
    try:
        yield
    finally:
        _set_madvise_hugepage(was)


DEQUANT_ROWS = 1024  # rows dequantised per numpy call (the gguf package takes 16: ~12k calls per model)


def dequantize(data: np.ndarray, qtype: Any) -> np.ndarray:
    """fp32 values of a GGUF tensor's data: the `gguf` package's `quants.dequantize`, bit for bit (its
    block formulas are elementwise, so how many rows one call takes cannot change a value;
    tests/runner/test_tokenizer_gguf.py compares every tensor of the embedded model), with its own
    block code run over DEQUANT_ROWS rows a call. Raises NotImplementedError for a type it lacks."""
    import gguf

    traits = getattr(gguf.quants, "_type_traits", {}).get(qtype)
    if traits is None or data.ndim < 1 or data.shape[-1] == 0:
        return np.asarray(gguf.quants.dequantize(data, qtype))
    traits.init_grid()
    rows = data.reshape(-1, data.shape[-1])
    shape = gguf.quants.quant_shape_from_byte_shape(data.shape, qtype)
    # into one array made here (not parts, then their concatenation): new memory is slow on the VMs
    # this runs on (`small_pages`), and the embedded model's embedding is 113 MB of fp32
    out = np.empty((len(rows), shape[-1]), dtype=np.float32)
    for i in range(0, len(rows), DEQUANT_ROWS):
        out[i : i + DEQUANT_ROWS] = traits.dequantize_rows(rows[i : i + DEQUANT_ROWS])
    return out.reshape(shape)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"model.layers.{idx}.{_LAYER_NAMES[rest]}"
    return gguf_name


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert-time permutation: back to the rotate-half row order."""
    rows = w.shape[0]
    return w.view(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

