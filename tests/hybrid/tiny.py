"""A tiny random-weight Qwen3.5 (dense hybrid) folder, built offline: transformers' config and
`Qwen3_5ForCausalLM`, `save_pretrained`, and a byte-level BPE tokenizer with a ChatML template."""

from __future__ import annotations

import os

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 256 + len(SPECIALS)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tokenizer(folder: str, merges: tuple[str, ...] = ()) -> None:
    """`merges`: two-character tokens (ids from 256 on, the control tokens after them), so that a text
    has one encoding and a model may write it another way ("aa" as "a" + "a")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    vocab.update({m: len(vocab) + k for k, m in enumerate(merges)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(m[0], m[1]) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def make_model(folder: str, *, layers: int = 4, seed: int = 0, hidden: int = 64, tie: bool = False,
               kv_heads: int = 2, lin_k_heads: int = 2, lin_v_heads: int = 4, head_dim: int = 16,
               lin_dim: int = 16, intermediate: int = 128, with_tokenizer: bool = True, vocab: int = VOCAB):
    """Save a random hybrid model (every 4th layer full attention) to `folder`; returns the transformers model.
    Every weight gets noise (norm weights too, so the zero-centred (1 + w) path is exercised). `vocab`:
    more than the tokenizer's for one saved after (with_tokenizer=False) that adds tokens; EOS stays <|im_end|>."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim, linear_conv_kernel_dim=4,
        linear_key_head_dim=lin_dim, linear_value_head_dim=lin_dim, linear_num_key_heads=lin_k_heads,
        linear_num_value_heads=lin_v_heads, max_position_embeddings=8192, tie_word_embeddings=tie,
        eos_token_id=VOCAB - 1,
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.3)
            elif p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.normal_(0.0, 0.6 / p.shape[-1] ** 0.5)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    if with_tokenizer:
        save_tokenizer(folder)
    return model
