"""Turn a name -> tensor mapping (HF naming) into Decoder weights, fusing qkv and gate/up."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from prefixserve.models.arch import ArchConfig, ModelLoadError
from prefixserve.models.kernels.int4 import Codes, Int4Weight, native_available, pack
from prefixserve.models.layers import TilePlan
from prefixserve.models.llama.decoder import Decoder
from prefixserve.models.llama.layer_weights import LayerWeights

GetTensor = Callable[[str], "torch.Tensor | None"]  # HF name -> fp32 tensor, or None when absent
GetCodes = Callable[[str], "list[Codes] | None"]  # HF name -> 4-bit codes (models/kernels/int4.py), or None
_T = TypeVar("_T")


def _per_layer(make: Callable[[int], _T], layers: Iterable[int], workers: int) -> list[_T]:
    """make(i) for each layer, in order; on `workers` threads where more than one: a layer's tensors are
    dequantised, cast and packed by numpy, torch and the native packers, which let go of the GIL (the
    embedded model on 2 cores: ~2.2 s on one thread). The first failing layer's error is raised."""
    if workers <= 1:
        return [make(i) for i in layers]
    with ThreadPoolExecutor(workers, thread_name_prefix="prefixserve-load") as pool:
        return list(pool.map(make, layers))


def build_decoder(arch: ArchConfig, get: GetTensor, dtype: torch.dtype, device: str, tiles: TilePlan,
                  workers: int = 1) -> Decoder:
    """Assemble a Decoder from HF-named tensors (`get` called from `workers` threads at once where more
    than one). Raises ModelLoadError naming a missing or misshapen tensor."""

    def need(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = get(name)
        if t is None:
            raise ModelLoadError(f"model weights: tensor {name!r} is missing")
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"model weights: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    hd, hid = arch.head_dim, arch.hidden_size

    def layer(i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        q = need(p + "self_attn.q_proj.weight", (arch.q_size, hid))
        k = need(p + "self_attn.k_proj.weight", (arch.kv_size, hid))
        v = need(p + "self_attn.v_proj.weight", (arch.kv_size, hid))
        bias = None
        if arch.qkv_bias:
            bias = cast(torch.cat([
                need(p + "self_attn.q_proj.bias", (arch.q_size,)),
                need(p + "self_attn.k_proj.bias", (arch.kv_size,)),
                need(p + "self_attn.v_proj.bias", (arch.kv_size,)),
            ]))
        return LayerWeights(
            attn_norm=cast(need(p + "input_layernorm.weight", (hid,))),
            qkv=cast(torch.cat([q, k, v])),
            qkv_bias=bias,
            o_proj=cast(need(p + "self_attn.o_proj.weight", (hid, arch.q_size))),
            mlp_norm=cast(need(p + "post_attention_layernorm.weight", (hid,))),
            gate_up=cast(torch.cat([
                need(p + "mlp.gate_proj.weight", (arch.intermediate_size, hid)),
                need(p + "mlp.up_proj.weight", (arch.intermediate_size, hid)),
            ])),
            down=cast(need(p + "mlp.down_proj.weight", (hid, arch.intermediate_size))),
            q_norm=cast(need(p + "self_attn.q_norm.weight", (hd,))) if arch.qk_norm else None,
            k_norm=cast(need(p + "self_attn.k_norm.weight", (hd,))) if arch.qk_norm else None,
        )

    layers = _per_layer(layer, range(arch.num_layers), workers)
    embed = cast(need("model.embed_tokens.weight", (arch.vocab_size, hid)))
    head = get("lm_head.weight")
    if arch.tie_embeddings or head is None:
        lm_head = embed
    else:
        lm_head = cast(need("lm_head.weight", (arch.vocab_size, hid)))
    final_norm = cast(need("model.norm.weight", (hid,)))
    return Decoder(arch, embed, layers, final_norm, lm_head, tiles)


def attach_int4(decoder: Decoder, get: GetCodes, workers: int = 1) -> int:
    """Give every linear layer whose GGUF codes the int4 kernel takes a 4-bit copy for decode rows.
    Returns how many of the model's linear weights got one (the rest decode dense). Packed for the
    native kernels where they build (models/kernels/int4.py), a layer a task on `workers` threads."""
    arch = decoder.arch
    native_layout = native_available(decoder.dtype, decoder.device.type)

    def fused(*names: str) -> Int4Weight | None:
        pieces = [get(n) for n in names]
        if any(p is None for p in pieces):
            return None
        return pack(pieces, native_layout)  # type: ignore[arg-type]

    def layer(i: int) -> int:
        lw, p = decoder.layers[i], f"model.layers.{i}."
        lw.qkv_q4 = fused(*(p + f"self_attn.{x}_proj.weight" for x in "qkv"))
        lw.o_q4 = fused(p + "self_attn.o_proj.weight")
        lw.gate_up_q4 = fused(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        lw.down_q4 = fused(p + "mlp.down_proj.weight")
        return sum(w is not None for w in (lw.qkv_q4, lw.o_q4, lw.gate_up_q4, lw.down_q4))

    count = sum(_per_layer(layer, range(len(decoder.layers)), workers))
    head = "model.embed_tokens.weight" if arch.tie_embeddings else "lm_head.weight"
    decoder.lm_head_q4 = fused(head)
    count += decoder.lm_head_q4 is not None
    decoder.int4_decode = count > 0
    return count
