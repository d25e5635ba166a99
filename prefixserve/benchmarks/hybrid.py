"""Hybrid (Qwen3.5-shaped) cache benchmark: in-process TTFT cold / full hit / partial hits and
snapshot bytes, on random weights of the real 0.8B shape (nothing to download). Prints, never asserts.
The 2nd user message resumes at request 1's recurrent checkpoint on the grid at or below the common
prefix (docs/hybrid.md), the 3rd too (or at the boundary entry the 2nd stored).

The shape is the dense Qwen3.5 0.8B as we understand it (docs/hybrid.md): 24 layers, every 4th full
attention (8 heads x 256, 2 KV heads, 25% rotary), 18 Gated DeltaNet layers (16 key and 16 value
heads x 128), hidden 1024, MLP 3584, vocabulary 248,320, tied embeddings.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch

from prefixserve.cache import PrefixCache
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine import EngineCore
from prefixserve.models.hybrid.config import HybridConfig
from prefixserve.models.layers import TilePlan
from prefixserve.models.loaders.hybrid_folder import build_hybrid
from prefixserve.runner import ModelRunner
from prefixserve.types import Delta, Namespace, Request, SamplingParams

SHAPE_0_8B: dict[str, Any] = {
    "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584, "num_heads": 8, "num_kv_heads": 2, "head_dim": 256,
    "rotary_dim": 64, "rope_theta": 1e7, "rms_eps": 1e-6, "max_position": 32768, "conv_kernel": 4, "lin_k_heads": 16,
    "lin_v_heads": 16, "lin_k_dim": 128, "lin_v_dim": 128, "tie_embeddings": True,
}


def random_hybrid(layers: int, dtype: torch.dtype, seed: int = 0, **shape: object):
    """A HybridDecoder of the given shape with random weights (scaled so activations stay tame)."""
    arch = HybridConfig(arch="qwen3_5", layer_types=tuple(
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)), **shape)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(seed)

    class Weights:
        def __init__(self) -> None:
            self.arch = arch

        def tensor(self, name: str) -> torch.Tensor | None:
            if name == "lm_head.weight":
                return None
            shape = _shape_of(arch, name)
            if name.endswith("A_log"):
                return torch.rand(shape, generator=g).log()
            if len(shape) == 1:
                return torch.randn(shape, generator=g) * 0.1 + (1.0 if name.endswith("dt_bias") or "linear_attn.norm" in name else 0.0)
            return torch.randn(shape, generator=g) * (0.6 / shape[-1] ** 0.5)

    return build_hybrid(Weights(), dtype, "cpu", TilePlan())  # type: ignore[arg-type]


def _shape_of(a: HybridConfig, name: str) -> tuple[int, ...]:
    hid = a.hidden_size
    leaf = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    table: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (a.vocab_size, hid), "model.norm.weight": (hid,),
        "input_layernorm.weight": (hid,), "post_attention_layernorm.weight": (hid,),
        "mlp.gate_proj.weight": (a.intermediate_size, hid), "mlp.up_proj.weight": (a.intermediate_size, hid),
        "mlp.down_proj.weight": (hid, a.intermediate_size),
        "self_attn.q_proj.weight": (2 * a.q_size, hid), "self_attn.k_proj.weight": (a.kv_size, hid),
        "self_attn.v_proj.weight": (a.kv_size, hid), "self_attn.o_proj.weight": (hid, a.q_size),
        "self_attn.q_norm.weight": (a.head_dim,), "self_attn.k_norm.weight": (a.head_dim,),
        "linear_attn.in_proj_qkv.weight": (a.conv_dim, hid), "linear_attn.in_proj_z.weight": (a.lin_value_size, hid),
        "linear_attn.in_proj_b.weight": (a.lin_v_heads, hid), "linear_attn.in_proj_a.weight": (a.lin_v_heads, hid),
        "linear_attn.conv1d.weight": (a.conv_dim, 1, a.conv_kernel), "linear_attn.A_log": (a.lin_v_heads,),
        "linear_attn.dt_bias": (a.lin_v_heads,), "linear_attn.norm.weight": (a.lin_v_dim,),
        "linear_attn.out_proj.weight": (hid, a.lin_value_size),
    }
    return table[leaf]


def bench_hybrid(quick: bool, print_fn: Callable[[str], object] = print, layers: int = 24,
                 lengths: tuple[int, ...] = (600, 2000)) -> None:
    dtype = torch.float32
    from prefixserve.models.loaders.load import cpu_has_native_bf16

    if cpu_has_native_bf16():
        dtype = torch.bfloat16
    t0 = time.perf_counter()
    dec = random_hybrid(layers, dtype, **SHAPE_0_8B)
    runner = ModelRunner(dec)
    print_fn(f"\n## hybrid (Qwen3.5 0.8B shape, random weights, {layers} layers, {dtype}, "
             f"{torch.get_num_threads()} threads; built in {time.perf_counter() - t0:.1f} s)")
    firsts: dict[str, float] = {}

    def emit(rid: str, d: Delta) -> None:
        if d.token_ids:
            firsts.setdefault(rid, time.perf_counter())

    core = EngineCore(runner, _NoTokenizer(), PrefixCache(CacheConfig(max_bytes=8 << 30)), EngineConfig(), 8192, emit)
    ns = Namespace("bench-hybrid", "t")
    g = torch.Generator().manual_seed(1)

    def ttft(ids: list[int]) -> tuple[float, int]:
        rid = uuid.uuid4().hex
        out: list[int] = []
        def record(r: str, d: Delta) -> None:
            emit(r, d)
            if d.usage is not None:
                out.append(d.usage.cached_tokens)

        core.emit = record
        t = time.perf_counter()
        core.add(Request(rid, ns, tuple(ids), SamplingParams(max_tokens=1, temperature=0.0)))
        while core.has_work():
            core.step()
        return firsts[rid] - t, out[-1]

    print_fn("| prompt | cold | full hit | 2nd user message | cached (2nd) | 3rd user message | cached (3rd) "
             "| entry MB (full prompt) | of which checkpoints MB | cache MB (3 prompts) |")
    print_fn("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in lengths:
        core.cache.clear()
        system = torch.randint(0, 200000, (n,), generator=g).tolist()
        users = [torch.randint(0, 200000, (24,), generator=g).tolist() for _ in range(3)]
        cold, _ = ttft(system + users[0])
        full, _ = ttft(system + users[0])
        second, cached2 = ttft(system + users[1])
        third, cached3 = ttft(system + users[2])
        entry = core.cache.get(ns, system + users[0])
        mb = 0.0 if entry is None else entry.nbytes / 1e6
        ckpt = 0.0 if entry is None else getattr(entry.state, "checkpoint_nbytes", 0) / 1e6
        print_fn(f"| {n + 24} tokens | {cold * 1000:.0f} ms | {full * 1000:.2f} ms | {second * 1000:.0f} ms | "
                 f"{cached2} | {third * 1000:.0f} ms | {cached3} | {mb:.1f} | {ckpt:.1f} | "
                 f"{core.cache.num_bytes / 1e6:.1f} |")
        if quick:
            break


class _NoTokenizer:
    thinks = False
    think_end_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return ""

    def token_bytes(self, token_id: int) -> bytes:
        return b""

    def encode(self, text: str) -> list[int]:
        return []

    def next_turn(self, prompt_ids: Sequence[int], reply_ids: Sequence[int], form: Any = None) -> tuple[int, ...] | None:
        return None  # no text: the bench's turns are cached as sampled

    def history_form(self, template_kwargs: dict[str, Any] | None = None) -> tuple[int, str, int | None]:
        return 0, "", None

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        raise NotImplementedError("the hybrid bench feeds token ids")
