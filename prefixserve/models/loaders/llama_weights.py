"""Turn a name -> tensor mapping (HF naming) into Decoder weights, fusing qkv and gate/up."""

from __future__ import annotations

from collections.abc import Callable

import torch

from prefixserve.models.arch import ArchConfig, ModelLoadError
from prefixserve.models.kernels.int4 import Codes, Int4Weight, native_available, pack
from prefixserve.models.layers import TilePlan
from prefixserve.models.llama.decoder import Decoder
from prefixserve.models.llama.layer_weights import LayerWeights

GetTensor = Callable[[str], "torch.Tensor | None"]  # HF name -> fp32 tensor, or None when absent
GetCodes = Callable[[str], "list[Codes] | None"]  # HF name -> 4-bit codes (models/kernels/int4.py), or None


def build_decoder(arch: ArchConfig, get: GetTensor, dtype: torch.dtype, device: str, tiles: TilePlan) -> Decoder:
    """Assemble a Decoder from HF-named tensors. Raises ModelLoadError naming a missing or misshapen tensor."""

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
    layers = []
    for i in range(arch.num_layers):
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
        layers.append(LayerWeights(
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
        ))
    embed = cast(need("model.embed_tokens.weight", (arch.vocab_size, hid)))
    head = get("lm_head.weight")
    if arch.tie_embeddings or head is None:
        lm_head = embed
    else:
        lm_head = cast(need("lm_head.weight", (arch.vocab_size, hid)))
    final_norm = cast(need("model.norm.weight", (hid,)))
    return Decoder(arch, embed, layers, final_norm, lm_head, tiles)


def attach_int4(decoder: Decoder, get: GetCodes) -> int:
    """Give every linear layer whose GGUF codes the int4 kernel takes a 4-bit copy for decode rows.
    Returns how many of the model's linear weights got one (the rest decode dense). Packed for the
    native kernels where they build (models/kernels/int4.py)."""
    arch = decoder.arch
    native_layout = native_available(decoder.dtype, decoder.device.type)

    def fused(*names: str) -> Int4Weight | None:
        pieces = [get(n) for n in names]
        if any(p is None for p in pieces):
            return None
        return pack(pieces, native_layout)  # type: ignore[arg-type]

    count = 0
    for i, lw in enumerate(decoder.layers):
        p = f"model.layers.{i}."
        lw.qkv_q4 = fused(*(p + f"self_attn.{x}_proj.weight" for x in "qkv"))
        lw.o_q4 = fused(p + "self_attn.o_proj.weight")
        lw.gate_up_q4 = fused(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        lw.down_q4 = fused(p + "mlp.down_proj.weight")
        count += sum(w is not None for w in (lw.qkv_q4, lw.o_q4, lw.gate_up_q4, lw.down_q4))
    head = "model.embed_tokens.weight" if arch.tie_embeddings else "lm_head.weight"
    decoder.lm_head_q4 = fused(head)
    count += decoder.lm_head_q4 is not None
    decoder.int4_decode = count > 0
    return count
