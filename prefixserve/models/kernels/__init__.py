"""The native kernels and their torch-side wrappers: the C sources (attention.c, qmatmul.c, amx.c,
decode.c, simd.h), their build (`native_build`, `isa`) and ctypes calls (`native`), the 4-bit weights
(`int4`), AMX tile packs (`amx_tiles`) and the thread team of the big calls (`threads`).

`native`, `native_build` and `isa` import without torch, so `prefixserve serve` can start compiling the
kernels before torch is imported."""
