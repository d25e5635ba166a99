"""The hybrid decoder (Gated DeltaNet + gated attention: the dense Qwen3.5 family): `HybridDecoder`,
its config (`config`) and the delta rule at fixed shapes (`gated_delta`). docs/hybrid.md."""
