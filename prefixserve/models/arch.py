"""Architecture description shared by every loader. Plain data, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


class ModelLoadError(Exception):
    """A model file or folder is missing, corrupt or unsupported. The message says which and why."""


@dataclass(frozen=True, slots=True)
class ArchConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_position: int
    tie_embeddings: bool = False
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on q and k before RoPE

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ModelLoadError(f"unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) < 1:
                raise ModelLoadError(f"model config: {name} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError("model config: num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ModelLoadError("model config: head_dim must be even for RoPE")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
