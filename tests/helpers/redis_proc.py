"""A real `redis-server` on 127.0.0.1 and a free port, for the shared cache tier's tests.

    with RedisServer() as r:          # r.url = "redis://127.0.0.1:<port>/0"
        r.kill()                      # SIGKILL (Redis down); r.start() brings it back on the same port
        r.pause()                     # SIGSTOP (Redis slow: connects, never answers); r.resume() SIGCONT

`make test` installs redis-server (apt) when it is missing; without it these tests are skipped with
that reason. No persistence (`--save ''`), `maxmemory` + `allkeys-lru` as docs/cache.md recommends.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from types import TracebackType
from typing import Self

import pytest

from tests.helpers.server_proc import free_port


def redis_server_binary() -> str:
    path = shutil.which("redis-server") or shutil.which("redis-server", path="/usr/sbin:/usr/bin")
    if path is None:
        pytest.skip("redis-server is not installed (`make test` installs it: apt-get install redis-server)")
    return path


class RedisServer:
    def __init__(self, maxmemory: str = "512mb", policy: str = "allkeys-lru") -> None:
        self.binary = redis_server_binary()
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.maxmemory = maxmemory
        self.policy = policy
        self._dir = tempfile.TemporaryDirectory(prefix="prefixserve-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.kill()
        self._dir.cleanup()

    def start(self) -> None:
        assert self.proc is None
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self._dir.name, "--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy,
             "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
