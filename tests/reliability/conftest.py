"""Two real servers for the whole reliability section, on 127.0.0.1 and free ports.

- `main`: the embedded model at its full context, a 64 MiB cache budget (small enough that the load
  and fault runs evict), the usage ledger on, and a keys file with tenants `alice`, `bob`, `loader`,
  `faults` and `probe000` .. `probeNNN` (one tenant per cross-tenant probe, see test_tenant_timing).
  It runs with MALLOC_MMAP_THRESHOLD_=1 MiB, so that RSS measures live memory: with glibc's default
  dynamic threshold, freed multi-MB session states stay in malloc's arenas and RSS ratchets to a
  high-water mark in jumps (measured, the same 32-client load in 10-s phases: 1032, 1150, 1502,
  1609, 1684, 1727 MiB; with the fixed threshold: 718, 738, 746, 757 ... 853 MiB over 23 phases),
  which would make "RSS back within 10%" a test of the allocator rather than of the server.
- `tiny`: `--cache-max-bytes 1000` (far below one prompt's state) and `--max-model-len 64`, which
  bounds what a schema-valid fuzz case can make the model generate. `test_sigterm` ends it; a later
  test asking for it gets a fresh one (so the order of the modules never matters for correctness).

`make test` runs the small counts; `make soak` sets SOAK=1 for the large ones (`scaled`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.server_proc import ServerProcess
from tests.reliability.client import Target

SOAK = os.environ.get("SOAK", "") not in ("", "0")
MAIN_CACHE_BYTES = 64 << 20
NUM_PROBES = 500 if SOAK else 200
MAIN_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
ADMIN = ["--admin-key", "sk-rel-admin-0123456789"]  # reads /metrics


def scaled(test_count: int, soak_count: int) -> int:
    """The count for this run: `test_count` under `make test`, `soak_count` under `make soak`."""
    return soak_count if SOAK else test_count


def tenant_keys() -> dict[str, str]:
    keys = {name: f"sk-rel-{name}-0123456789" for name in ("alice", "bob", "loader", "faults")}
    keys.update({f"probe{i:03d}": f"sk-rel-probe{i:03d}-0123456789" for i in range(NUM_PROBES)})
    return keys


@pytest.fixture(scope="session")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    keys = tenant_keys()
    path = tmp_path_factory.mktemp("reliability") / "keys.txt"
    path.write_text("".join(f"{tenant} {key}\n" for tenant, key in keys.items()))
    return path, keys


class ServerSlot:
    """One lazily started server; started again if a test (SIGTERM) ended the previous one."""

    def __init__(self, args: list[str], keys: dict[str, str], env: dict[str, str] | None = None) -> None:
        self.args = args
        self.keys = keys
        self.env = env or {}
        self.proc: ServerProcess | None = None

    def get(self) -> ServerProcess:
        if self.proc is not None and (self.proc.returncode is not None or self.proc.proc is None
                                      or self.proc.proc.poll() is not None):  # fmt: skip
            self.close()
        if self.proc is None:
            srv = ServerProcess(self.args, self.env)
            srv.__enter__()
            self.proc = srv
        return self.proc

    def close(self) -> None:
        if self.proc is not None:
            proc, self.proc = self.proc, None
            proc.__exit__(None, None, None)


def as_target(srv: ServerProcess, keys: dict[str, str]) -> Target:
    assert srv.proc is not None
    return Target(srv.base_url, srv.proc.pid, keys, srv.admin_key)


@pytest.fixture(scope="session")
def main_slot(keys_file: tuple[Path, dict[str, str]]) -> Iterator[ServerSlot]:
    path, keys = keys_file
    slot = ServerSlot(
        ["--api-keys-file", str(path), *ADMIN, "--cache-max-bytes", str(MAIN_CACHE_BYTES)], keys, MAIN_ENV
    )
    yield slot
    slot.close()


@pytest.fixture(scope="session")
def tiny_slot(keys_file: tuple[Path, dict[str, str]]) -> Iterator[ServerSlot]:
    path, keys = keys_file
    slot = ServerSlot(
        ["--api-keys-file", str(path), *ADMIN, "--cache-max-bytes", "1000", "--max-model-len", "64"], keys
    )
    yield slot
    slot.close()


@pytest.fixture
def main(main_slot: ServerSlot, request: pytest.FixtureRequest) -> Iterator[Target]:
    srv = main_slot.get()
    failed_before = request.session.testsfailed
    yield as_target(srv, main_slot.keys)
    if request.session.testsfailed > failed_before:
        print(f"--- main server log tail ---\n{srv.log_tail()}")


@pytest.fixture
def tiny_server(tiny_slot: ServerSlot) -> ServerProcess:
    return tiny_slot.get()


@pytest.fixture
def tiny(
    tiny_server: ServerProcess, tiny_slot: ServerSlot, request: pytest.FixtureRequest
) -> Iterator[Target]:
    failed_before = request.session.testsfailed
    yield as_target(tiny_server, tiny_slot.keys)
    if request.session.testsfailed > failed_before:
        print(f"--- tiny server log tail ---\n{tiny_server.log_tail()}")
