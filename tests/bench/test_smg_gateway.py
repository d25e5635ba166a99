"""bench/smg_gateway.py: the keys SMG gets from a replicas' keys file (docs/gateway.md, "A local
cluster"), exactly; the real binaries run in tests/server/test_gateway_real.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# bench/ on the path for this import only (its scripts' names must not shadow other packages)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from smg_gateway import main, smg_argv, tenant_keys

sys.path.pop(0)


def test_named_unnamed_and_colon_tenants_become_smg_tenant_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# tenants\nalice sk-alice-1 # rotated monthly\nsk-bare-2\nteam:ops sk-ops:3\n")
    assert tenant_keys(str(keys)) == [("alice", "sk-alice-1"), ("key-11200ee5b4fb", "sk-bare-2"),
                                      ("team_ops", "sk-ops:3")]


def test_argv_carries_the_gateway_key_and_every_tenant_key_after_the_flags() -> None:
    flags = ["--port", "8000", "--policy", "consistent_hashing"]
    assert smg_argv(flags, [("alice", "sk-a"), ("bob", "sk-b")], "sk-gw") == [
        "launch", "--port", "8000", "--policy", "consistent_hashing", "--api-key", "sk-gw",
        "--tenant-api-key", "alice:sk-a", "--tenant-api-key", "bob:sk-b"]
    assert smg_argv(flags, [], None) == ["launch", *flags]  # open replicas: SMG gets no key


@pytest.mark.parametrize(("text", "reason"), [
    ("", "no API keys"),
    ("smg-gateway sk-x\n", "the gateway's own"),
    ("a b c\n", "'KEY' or 'TENANT KEY'"),
])
def test_a_file_the_cluster_cannot_use_is_refused_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, reason: str) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(text)
    assert main(["--check", "--api-keys-file", str(keys)]) == 2
    assert reason in capsys.readouterr().err
