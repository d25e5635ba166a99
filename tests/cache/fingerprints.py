"""The lower tiers' fingerprint (engine.tier_fingerprint) of a tiny decoder, and the fingerprints
that each change of the runtime's identity (runner/identity.py) or of the model gives: shared by the
disk and Redis tier tests, which check that an entry of one is never served under another."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from prefixserve.engine import tier_fingerprint
from prefixserve.models.kernels import native
from prefixserve.models.kernels.threads import KERNEL_THREADS
from prefixserve.models.layers import TilePlan
from prefixserve.models.llama.decoder import Decoder
from prefixserve.runner import identity


def decoder(dtype: torch.dtype = torch.bfloat16, tiles: TilePlan | None = None, int4: bool = False) -> Decoder:
    embed = torch.zeros(4, 8, dtype=dtype)
    arch: Any = SimpleNamespace(rope_theta=10000.0, head_dim=8)
    d = Decoder(arch, embed, [], embed[0], embed, tiles or TilePlan())
    d.int4_decode = int4
    return d


def _forget() -> None:
    """Clear the identity's once-read parts (a replaced one has no cache)."""
    for cached in (identity.code_digest, identity.torch_build, identity.cpu):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def variants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, str]]:
    """(this runtime's fingerprint of a model, {what changed: the fingerprint after that change})."""
    weights, other_weights = tmp_path / "a.gguf", tmp_path / "b.gguf"
    weights.write_bytes(b"weights of model a")
    other_weights.write_bytes(b"weights of model b")
    info = native.cpu_info()
    changes: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
        "torch version": lambda m: m.setattr(torch, "__version__", torch.__version__ + "+other"),
        "torch build": lambda m: m.setattr(torch.__config__, "show", lambda: "another build"),
        "code": lambda m: m.setattr(identity, "code_digest", lambda: "an edited kernel"),
        "cpu flags": lambda m: m.setattr(native, "cpu_info", lambda: info | {"flags": info.get("flags", "") + " amx_new"}),
        "cpu model": lambda m: m.setattr(native, "cpu_info", lambda: info | {"model name": "Another CPU"}),
        "native build": lambda m: m.setattr(native, "digest", lambda: "another native build"),
        "kernel threads": lambda m: m.setattr(KERNEL_THREADS, "threads", KERNEL_THREADS.threads + 1),
        "package version": lambda m: m.setattr(identity, "__version__", "99.0"),
    }
    _forget()
    base = tier_fingerprint(str(weights), decoder())
    assert base == tier_fingerprint(str(weights), decoder())  # a restart of the same server
    others = {
        "model": tier_fingerprint(str(other_weights), decoder()),
        "dtype": tier_fingerprint(str(weights), decoder(torch.float32)),
        "padding": tier_fingerprint(str(weights), decoder(tiles=TilePlan(32, 16))),
        "lm_head padding": tier_fingerprint(str(weights), decoder(tiles=TilePlan(64, 8))),
        "decode kernel": tier_fingerprint(str(weights), decoder(int4=True)),
    }
    for what, change in changes.items():
        with monkeypatch.context() as m:
            change(m)
            _forget()
            others[what] = tier_fingerprint(str(weights), decoder())
        _forget()
    assert len({base, *others.values()}) == 1 + len(others), others
    return base, others
