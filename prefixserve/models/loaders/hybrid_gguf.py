"""GGUF `qwen35` files (llama.cpp's Qwen3.5 dense) -> the HybridDecoder's HF-named tensors.

llama.cpp's converter changes some tensors; `tensor()` undoes it so `hybrid_folder.build_hybrid`
sees transformers' layout (names from the gguf package's own tensor map):
- zero-centred norm weights are stored as 1 + w (all norms but the gated `ssm_norm`);
- `ssm_a` holds -exp(A_log); `ssm_dt.bias` is dt_bias; `ssm_conv1d` is squeezed to [channels, K];
- with fewer key than value heads, the value heads are reordered from grouped-by-key-head to tiled
  order (the V rows of `attn_qkv`, `attn_gate`, `ssm_beta` / `ssm_alpha`, `ssm_a`, `ssm_dt`, the V
  channels of the conv, the input columns of `ssm_out`).
"""

from __future__ import annotations

from typing import Any

import torch

from prefixserve.models.arch import ModelLoadError
from prefixserve.models.hybrid.config import HybridConfig
from prefixserve.models.loaders.gguf import GGUFModel

GGUF_HYBRID_ARCHS = ("qwen35",)
GGUF_UNSUPPORTED = {"qwen35moe": "the Qwen3.5 MoE sibling is not supported; only the dense qwen35 is",
                    "qwen3next": "qwen3next (Qwen3-Next) is not supported; only the dense qwen35 is"}
_LAYER = {  # GGUF suffix -> HF suffix (gguf.get_tensor_name_map(MODEL_ARCH.QWEN35))
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight", "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight", "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias", "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_PLUS_ONE = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


def gguf_architecture(path: str) -> str | None:
    """general.architecture of a GGUF file, None when unreadable (the generic loader reports that).

    Read from the header's key-value section directly: the `gguf` package's reader parses every
    field (the 49k-token vocabulary included) in Python, several seconds for this one string."""
    import struct

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF scalar value types
    try:
        with open(path, "rb") as f:
            def read(fmt: str) -> tuple[Any, ...]:
                return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))

            def string() -> bytes:
                (n,) = read("Q")
                return f.read(n)

            def skip(vtype: int) -> None:
                if vtype in sizes:
                    f.seek(sizes[vtype], 1)
                elif vtype == 8:
                    f.seek(read("Q")[0], 1)
                elif vtype == 9:
                    etype, count = read("IQ")
                    if etype in sizes:
                        f.seek(sizes[etype] * count, 1)
                    else:
                        for _ in range(count):
                            skip(etype)
                else:
                    raise ValueError(f"GGUF value type {vtype}")

            magic, version = f.read(4), read("I")[0]
            if magic != b"GGUF" or version not in (2, 3):
                return None
            _, num_kv = read("QQ")
            for _ in range(num_kv):
                key = string()
                (vtype,) = read("I")
                if key == b"general.architecture" and vtype == 8:
                    return string().decode("utf-8")
                skip(vtype)
    except (OSError, ValueError, struct.error, UnicodeDecodeError):
        return None
    return None


class HybridGGUFModel(GGUFModel):
    """An opened `qwen35` GGUF: `arch` (a HybridConfig) and `tensor(hf_name)` (fp32, transformers' layout)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._raw = {_hf(t.name): t for t in self.raw_tensors}

    def _arch_config(self) -> HybridConfig:  # type: ignore[override]
        name = self.meta.get("general.architecture")
        if name in GGUF_UNSUPPORTED:
            raise ModelLoadError(f"GGUF architecture {name!r}: {GGUF_UNSUPPORTED[name]}")
        if name not in GGUF_HYBRID_ARCHS:
            raise ModelLoadError(f"GGUF architecture {name!r} is not a supported hybrid")
        self._permuted = False

        def m(key: str, default: Any = None) -> Any:
            v = self.meta.get(f"{name}.{key}", default)
            if v is None:
                raise ModelLoadError(f"GGUF metadata {name}.{key} is missing")
            return v

        n = int(m("block_count"))
        interval = int(m("full_attention_interval", 4))
        heads, hidden = int(m("attention.head_count")), int(m("embedding_length"))
        v_heads, k_dim = int(m("ssm.time_step_rank")), int(m("ssm.state_size"))
        embed = next((t for t in self.raw_tensors if t.name == "token_embd.weight"), None)
        if embed is None:
            raise ModelLoadError("GGUF file has no token_embd.weight tensor")
        return HybridConfig(
            arch="qwen3_5", vocab_size=int(embed.shape[1]), hidden_size=hidden,
            intermediate_size=int(m("feed_forward_length")),
            layer_types=tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)),
            num_heads=heads, num_kv_heads=int(m("attention.head_count_kv", heads)),
            head_dim=int(m("attention.key_length", hidden // heads)), rotary_dim=int(m("rope.dimension_count")),
            rope_theta=float(m("rope.freq_base", 10000.0)), rms_eps=float(m("attention.layer_norm_rms_epsilon", 1e-6)),
            max_position=int(m("context_length", 32768)), conv_kernel=int(m("ssm.conv_kernel")),
            lin_k_heads=int(m("ssm.group_count")), lin_v_heads=v_heads, lin_k_dim=k_dim,
            lin_v_dim=int(m("ssm.inner_size")) // v_heads,
            tie_embeddings=not any(t.name == "output.weight" for t in self.raw_tensors),
        )

    def tensor(self, hf_name: str) -> torch.Tensor | None:
        t = self._raw.get(hf_name)
        if t is None:
            return None
        self._tensors[hf_name] = t  # the base class dequantises by HF name
        w = super().tensor(hf_name)
        assert w is not None
        a: HybridConfig = self.arch  # type: ignore[assignment]
        leaf = hf_name.split(".", 3)[-1]
        if hf_name == "model.norm.weight" or leaf.endswith(_PLUS_ONE):
            w = w - 1.0
        if leaf == "linear_attn.A_log":
            w = torch.log(-w)
        if leaf == "linear_attn.conv1d.weight":
            w = w.reshape(a.conv_dim, 1, a.conv_kernel)
        return _ungroup(w, leaf, a) if a.lin_k_heads != a.lin_v_heads else w


def _hf(gguf_name: str) -> str:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in _LAYER:
            return f"model.layers.{idx}.{_LAYER[rest]}"
    return gguf_name


def _tiled_to_grouped(w: torch.Tensor, dim: int, k_heads: int, per_k: int, head_dim: int) -> torch.Tensor:
    """Inverse of the converter's V-head reorder along `dim`: tiled [per_k, k_heads] -> grouped [k_heads, per_k]."""
    shape = list(w.shape)
    w = w.reshape(*shape[:dim], per_k, k_heads, head_dim, *shape[dim + 1:])
    return w.transpose(dim, dim + 1).reshape(shape)


def _ungroup(w: torch.Tensor, leaf: str, a: HybridConfig) -> torch.Tensor:
    hk, r = a.lin_k_heads, a.lin_v_heads // a.lin_k_heads
    if leaf == "linear_attn.in_proj_qkv.weight":
        qk = 2 * a.lin_key_size
        return torch.cat([w[:qk], _tiled_to_grouped(w[qk:], 0, hk, r, a.lin_v_dim)])
    if leaf == "linear_attn.conv1d.weight":
        qk = 2 * a.lin_key_size
        return torch.cat([w[:qk], _tiled_to_grouped(w[qk:], 0, hk, r, a.lin_v_dim)])
    if leaf == "linear_attn.in_proj_z.weight":
        return _tiled_to_grouped(w, 0, hk, r, a.lin_v_dim)
    if leaf in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.A_log",
                "linear_attn.dt_bias"):
        return _tiled_to_grouped(w.reshape(w.shape[0], -1), 0, hk, r, 1).reshape(w.shape)
    if leaf == "linear_attn.out_proj.weight":
        return _tiled_to_grouped(w, 1, hk, r, a.lin_v_dim)
    return w
