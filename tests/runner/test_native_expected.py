"""A first start prepares the model while its native kernels still compile (models/loaders/load.py,
`native.expected`), and comes through a build that then fails: the model is prepared again for the
torch formulations and loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefixserve.models.kernels import native

# A "compiler" that answers --version at once and fails a compile only once the loader waits for it
# (the file $MARKER exists): the build is still running while the model is prepared, whatever the
# machine's speed, and fails after.
FAKE_CC = """#!/bin/sh
[ "$1" = "--version" ] && { echo "fake-cc 1.0"; exit 0; }
while [ ! -e "$MARKER" ]; do sleep 0.05; done
exit 1
"""

LOAD = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from prefixserve.models.kernels import native_build
native_build.prebuild()
import torch
from prefixserve.models import load_model
seen = []
def waiting(begins):
    seen.append(begins)
    if begins:
        open(sys.argv[2], "w").close()  # the compile fails now
m = load_model(None, torch.bfloat16, "cpu", cache_dir=sys.argv[1], waiting=waiting)
d = m.decoder
packs = [w for lw in d.layers for w in lw.int4 if w is not None]
from prefixserve.runner import ModelRunner
runner = ModelRunner(d)
state = runner.new_state()
runner.prefill(state, m.tokenizer.encode("The capital of France is"), 64)
print(json.dumps({"seen": seen, "native_attention": d.native_attention, "packs": len(packs),
                  "native_packs": sum(w.native is not None for w in packs), "int4_decode": d.int4_decode,
                  "finite": bool(torch.isfinite(state.logits).all())}))
"""


def test_a_build_that_fails_after_the_model_was_prepared_for_it(tmp_path: Path) -> None:
    if native.library() is None:
        pytest.skip("no native kernels on this machine: nothing is prepared for them")
    cc = tmp_path / "cc"
    cc.write_text(FAKE_CC)
    cc.chmod(0o755)
    marker, cache = tmp_path / "fail-now", tmp_path / "models"
    env = {**os.environ, "CC": str(cc), "MARKER": str(marker), "PREFIXSERVE_NATIVE_DIR": str(tmp_path / "native"),
           "PREFIXSERVE_NATIVE": "1"}
    out = subprocess.run([sys.executable, "-c", LOAD, str(cache), str(marker)], env=env, check=False,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # the loader went on while the build ran and waited for it where it needed the kernels ...
    assert got["seen"] == [True, False]
    assert "their build failed while the model was prepared for them" in out.stderr
    # ... then made the model again for torch's kernels: no native packs, torch's attention
    assert got["packs"] > 0 and got["native_packs"] == 0 and got["int4_decode"]
    assert got["native_attention"] is False and got["finite"]  # and it runs
    # both preparations are kept: the native one serves a later start whose kernels build
    entries = [p for p in cache.iterdir() if (p / "manifest.json").is_file()]
    keys = sorted(json.loads((p / "manifest.json").read_text())["key"]["int4_native"] for p in entries)
    assert keys == ["False", "True"]
    assert not (tmp_path / "native").exists() or not [
        n for n in os.listdir(tmp_path / "native") if n.endswith(".so")]
