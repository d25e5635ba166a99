"""Start, watch and stop one server process: free port, readiness, peak RSS, clean shutdown.

A `ServerProcess` is a context manager. It starts the command in its own process group, waits
until `GET /v1/models` answers 200, samples the RSS of the whole group while it lives, and on
exit (normal, exception or Ctrl-C) sends SIGTERM to the group, then SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx
import psutil


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """One server under test. `cmd` must already carry host, port and API key."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        port: int,
        api_key: str,
        log_path: Path,
        ready_timeout_s: float = 600.0,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.cmd = cmd
        self.cwd = cwd  # `python -m` imports from its working directory before PYTHONPATH
        self.port = port
        self.api_key = api_key
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.env = env
        self.startup_s: float | None = None
        self.peak_rss_bytes = 0
        self.idle_rss_bytes = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._stop_sampling = threading.Event()
        self._sampler: threading.Thread | None = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Launch the command and block until it serves `/v1/models`; raise if it dies first."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        started = time.perf_counter()
        self._proc = subprocess.Popen(
            self.cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # own process group: stop() reaches every child
            env={**os.environ, **(self.env or {})},
            cwd=self.cwd,
        )
        log.close()
        self._sampler = threading.Thread(target=self._sample_rss, daemon=True)
        self._sampler.start()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - started
        self.idle_rss_bytes = self._group_rss_bytes()

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it after `grace_s`. Safe to call twice."""
        proc = self._proc
        if proc is None:
            return
        self._proc = None
        self._stop_sampling.set()
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=grace_s)
        # A child that ignored SIGTERM can outlive the leader; the group is still addressable.
        _signal_group(proc.pid, signal.SIGKILL)
        if self._sampler is not None:
            self._sampler.join(timeout=2.0)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def model_id(self) -> str:
        """The first model id `GET /v1/models` lists: what requests name in `model`."""
        headers = {"Authorization": f"Bearer {self.api_key}"}
        response = httpx.get(f"{self.base_url}/v1/models", headers=headers, timeout=10.0)
        response.raise_for_status()
        data = response.json().get("data") or [{}]
        return str(data[0].get("id", "default"))

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        headers = {"Authorization": f"Bearer {self.api_key}"}
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self._proc.returncode} while starting:\n{self.log_tail()}"
                )
            try:
                response = httpx.get(f"{self.base_url}/v1/models", headers=headers, timeout=5.0)
                if response.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)  # start-up is a measured row: poll finely
        raise TimeoutError(f"{self.name} not ready after {self.ready_timeout_s:.0f}s:\n{self.log_tail()}")

    def _members(self) -> list[psutil.Process]:
        """The server's process and its descendants (none once it is gone)."""
        proc = self._proc
        if proc is None:
            return []
        try:
            root = psutil.Process(proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def _group_rss_bytes(self) -> int:
        total = 0
        for member in self._members():
            try:
                total += member.memory_info().rss
            except psutil.Error:
                pass
        return total

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the server's process group has used so far."""
        total = 0.0
        for member in self._members():
            try:
                t = member.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def _sample_rss(self) -> None:
        while not self._stop_sampling.is_set():
            self.peak_rss_bytes = max(self.peak_rss_bytes, self._group_rss_bytes())
            self._stop_sampling.wait(0.1)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
