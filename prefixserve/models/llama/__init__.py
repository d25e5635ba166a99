"""The Llama-family decoder (llama, mistral, qwen2, qwen3): `Decoder` and the pieces it holds, its
4-bit decode rows (`int4_rows`, `native_decode`) and the timed choice of its prefill kernels
(`kernel_choice`)."""
