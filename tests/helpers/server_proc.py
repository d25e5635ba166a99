"""Start a real `prefixserve serve` subprocess for end-to-end tests.

    from tests.helpers.server_proc import ServerProcess, server_fixture

    # as a context manager
    with ServerProcess(["--api-key", "sk-a", "--no-ledger"], env={"PREFIXSERVE_DTYPE": "fp32"}) as srv:
        httpx.get(srv.base_url + "/health")          # base_url = "http://127.0.0.1:<port>"
        OpenAI(base_url=srv.openai_url, api_key="sk-a")  # openai_url = base_url + "/v1"

    # as a pytest fixture (module-scoped: one model load per test module)
    server = server_fixture(["--api-key", "sk-a"], scope="module")

    def test_x(server: ServerProcess) -> None: ...

What it does: picks a free port on 127.0.0.1, runs ``python -m prefixserve.cli serve --host 127.0.0.1
--port N --data-dir <fresh temp dir> <extra args>`` with this interpreter (the venv's), environment =
os.environ + `env`, stdout and stderr to a log file (`srv.log_path`; `srv.log_text()` reads it; the
tail is included in any start-up failure). `__enter__` waits for ``GET /health`` to answer 200
(`start_timeout`, default 180 s; a server that exits early fails at once). `__exit__` sends SIGTERM,
waits `stop_timeout` (default 60 s) for a graceful exit, then kills; the exit status is kept in
`srv.returncode` (0 after a clean drain). `srv.terminate()` does the SIGTERM part on its own, for
tests of shutdown behaviour. Pass `data_dir=` to choose the data directory (e.g. to find the ledger).
The servers share one prepared-model cache, `TEST_MODEL_CACHE` (unless `env` names another).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TEST_MODEL_CACHE = os.path.join(tempfile.gettempdir(), f"prefixserve-test-model-cache-{os.getuid()}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerStartError(RuntimeError):
    pass


class ServerProcess:
    """A `prefixserve serve` subprocess on 127.0.0.1 and a free port. See the module docstring."""

    def __init__(
        self,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        *,
        data_dir: str | Path | None = None,
        start_timeout: float = 180.0,
        stop_timeout: float = 60.0,
        module: str = "prefixserve.cli",
        subcommand: Sequence[str] = ("serve",),
    ) -> None:
        self.args = list(args)
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.openai_url = self.base_url + "/v1"
        self._tmp = tempfile.TemporaryDirectory(prefix="prefixserve-test-")
        self.data_dir = Path(data_dir) if data_dir is not None else Path(self._tmp.name) / "data"
        self.log_path = Path(self._tmp.name) / "server.log"
        self.command = [
            sys.executable,
            "-m",
            module,
            *subcommand,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            *self.args,
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None

    def __enter__(self) -> Self:
        self.start()
        return self

    @property
    def admin_key(self) -> str | None:
        """The `--admin-key` it was started with, if any."""
        return self.args[self.args.index("--admin-key") + 1] if "--admin-key" in self.args else None

    def metrics(self) -> str:
        """/metrics as text, read with the admin key where the server has one (with API keys, only that
        key reads /metrics)."""
        key = self.admin_key
        r = httpx.get(self.base_url + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)
        assert r.status_code == 200, r.text
        return r.text

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.terminate()
            if exc is not None or self.returncode not in (0, None):
                print(f"--- server log ({self.command[2]} exit {self.returncode}) ---\n{self.log_tail()}")
        finally:
            self._tmp.cleanup()

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        # every test server shares one prepared-model cache (models/loaders/prepared.py): the first start of a run
        # prepares the GGUF (~15 s), later ones load it in ~2 s; entries are keyed by digests, never stale
        env.setdefault("PREFIXSERVE_MODEL_CACHE_DIR", TEST_MODEL_CACHE)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.returncode = self.proc.returncode
                raise ServerStartError(
                    f"server exited with {self.proc.returncode} during start-up:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.terminate()
        raise ServerStartError(f"server not healthy after {self.start_timeout:.0f} s:\n{self.log_tail()}")

    def terminate(self) -> int | None:
        """SIGTERM, wait for a graceful exit (kill after stop_timeout). Returns the exit status."""
        if self.proc is None or self.returncode is not None:
            return self.returncode
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.returncode = self.proc.returncode
        return self.returncode

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_text()[-num_chars:]


def server_fixture(
    args: Sequence[str] = (), env: Mapping[str, str] | None = None, *, scope: Any = "module", **kwargs: Any
) -> Any:
    """A pytest fixture yielding a started ServerProcess; assign it to a name in a test module."""

    @pytest.fixture(scope=scope)
    def _server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
        with ServerProcess(args, env, **kwargs) as srv:
            failed_before = request.session.testsfailed
            yield srv
            if request.session.testsfailed > failed_before:  # show the server's side of a failure
                print(f"--- server log tail ({srv.base_url}) ---\n{srv.log_tail()}")

    return _server
