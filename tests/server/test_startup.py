"""A start-up that talks (server/startup.py, server/run.py): each long phase is a console line with
the time since launch and, where the last start's is known, its duration; the last line is the URL
and the total. While the model loads the port already answers: /health is a 503 `loading` with the
phase, anything else a 503 in OpenAI's error shape with Retry-After. SIGTERM while loading exits 0."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixserve.server import run
from prefixserve.server.startup import LoadingServer, StartupProgress, hand_over
from tests.helpers.server_proc import REPO_ROOT, TEST_MODEL_CACHE, ServerProcess, free_port

PHASE_LINES = ("importing the runtime", "loading the embedded model", "self-test:", "starting HTTP on ")
# `native_kernels` only where a first start's kernels still compile as the model loader needs them:
# within `loading_model`, which resumes after it
PHASE_RANK = {"starting": 0, "importing": 1, "loading_model": 2, "native_kernels": 2, "self_test": 3,
              "starting_http": 4}


def test_progress_prints_each_phase_and_the_ready_line_and_remembers_the_times(tmp_path: Path) -> None:
    out = io.StringIO()
    times = str(tmp_path / "startup-times.json")
    p = StartupProgress(out=out, timings_path=times, key="m|auto|auto", tick_s=0)
    assert p.snapshot()["status"] == "loading"
    p.phase("loading_model", "loading the model")
    time.sleep(0.05)
    state = p.snapshot()
    assert state["phase"] == "loading_model" and state["detail"] == "loading the model"
    assert state["phase_elapsed_s"] >= 0.05 and state["elapsed_s"] >= state["phase_elapsed_s"]
    assert "estimate_s" not in state  # nothing recorded yet
    p.phase("self_test", "self-test")
    total = p.ready("http://127.0.0.1:1", "m")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and all(line.startswith("prefixserve: [") for line in lines)
    assert lines[0].endswith("loading the model ...") and lines[1].endswith("self-test ...")
    assert "ready on http://127.0.0.1:1, serving m: started in" in lines[2] and "model 0." in lines[2]
    record = json.loads(Path(times).read_text())["m|auto|auto"]
    assert record["total"] == pytest.approx(total, abs=0.01) and set(record["phases"]) == {"loading_model", "self_test"}

    again = StartupProgress(out=None, timings_path=times, key="m|auto|auto", tick_s=0)
    again.phase("loading_model", "loading the model")
    assert again.snapshot()["estimate_s"] == pytest.approx(record["phases"]["loading_model"], abs=0.01)
    other = StartupProgress(out=None, timings_path=times, key="another model", tick_s=0)
    other.phase("loading_model", "x")
    assert "estimate_s" not in other.snapshot()


def test_a_long_phase_says_it_is_still_running() -> None:
    out = io.StringIO()
    p = StartupProgress(out=out, tick_s=0.1)
    p.phase("self_test", "self-test")
    time.sleep(0.35)
    p.close()
    assert "... still self-test (0 s)" in out.getvalue()


def test_an_unwritable_times_file_is_no_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    p = StartupProgress(out=None, timings_path=str(tmp_path / "file" / "times.json"), tick_s=0)
    p.phase("self_test", "x")
    p.ready("http://h:1", "m")  # logged, not raised


def _loading(progress: StartupProgress) -> tuple[LoadingServer, socket.socket, str]:
    sock = run.bind_socket("127.0.0.1", 0)
    server = LoadingServer(sock, progress)
    server.start()
    return server, sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_the_loading_server_answers_health_and_a_retryable_503() -> None:
    progress = StartupProgress(out=None, tick_s=0)
    progress.phase("loading_model", "loading the model")
    server, sock, url = _loading(progress)
    try:
        r = httpx.get(url + "/health", timeout=5)
        assert r.status_code == 503 and r.headers["retry-after"].isdigit()
        body = r.json()
        assert body["status"] == "loading" and body["phase"] == "loading_model" and body["elapsed_s"] >= 0
        assert httpx.head(url + "/health", timeout=5).status_code == 503
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/tokenize")):
            r = httpx.request(method, url + path, json={"messages": [{"role": "user", "content": "x" * 5000}]},
                              headers={"Authorization": "Bearer sk-x"}, timeout=5)
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, (method, path)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == "model_loading"
            assert "loading_model" in err["message"]
    finally:
        server.stop()
        sock.close()


def test_after_the_hand_over_the_socket_still_listens_and_nothing_is_refused() -> None:
    """stop() leaves the socket listening: a connection made then waits for the next server (uvicorn)."""
    progress = StartupProgress(out=None, tick_s=0)
    server, sock, url = _loading(progress)
    try:
        assert httpx.get(url + "/health", timeout=5).status_code == 503
        server.stop()
        server.stop()  # idempotent
        client = socket.create_connection(sock.getsockname()[:2], timeout=5)  # queued, not refused
        accepted, _ = sock.accept()
        accepted.close()
        client.close()
    finally:
        sock.close()


def test_hand_over_runs_as_the_lifespan_start_up_completes() -> None:
    import asyncio

    calls: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        calls.append("app")
        await send({"type": "lifespan.startup.complete"})

    async def send(message: Any) -> None:
        calls.append(message["type"])

    async def receive() -> Any:
        return {}

    wrapped = hand_over(app, lambda: calls.append("handed over"))
    asyncio.run(wrapped({"type": "lifespan"}, receive, send))
    assert calls == ["app", "handed over", "lifespan.startup.complete"]
    calls.clear()
    asyncio.run(wrapped({"type": "http"}, receive, send))
    assert calls == ["app", "lifespan.startup.complete"]  # other scopes pass through untouched


@pytest.mark.slow
def test_serve_tells_each_phase_and_health_says_loading_before_ok() -> None:
    srv = ServerProcess(["--no-ledger"], start_timeout=240)
    seen: list[tuple[int, dict[str, Any]]] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                r = httpx.get(srv.base_url + "/health", timeout=2)
                seen.append((r.status_code, r.json()))
                if r.status_code == 200:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with srv:
            poller.join(timeout=30)
            log = srv.log_text()
    finally:
        done.set()
        poller.join()
    loading = [body for status, body in seen if status == 503]
    assert loading and seen[-1][0] == 200 and seen[-1][1]["status"] == "ok"
    assert all(b["status"] == "loading" and b["phase"] and b["elapsed_s"] >= 0 for b in loading)
    phases = [b["phase"] for b in loading]
    assert phases == sorted(phases, key=PHASE_RANK.__getitem__)  # in order, never back
    lines = [line for line in log.splitlines() if line.startswith("prefixserve: [")]
    for text in PHASE_LINES:
        assert any(text in line for line in lines), (text, lines)
    ready = [line for line in lines if "ready on " in line]
    assert len(ready) == 1 and f"ready on {srv.base_url}, serving " in ready[0] and "started in " in ready[0]
    assert lines[-1] == ready[0]
    assert srv.returncode == 0


@pytest.mark.slow
def test_sigterm_while_loading_exits_cleanly(tmp_path: Path) -> None:
    """A SIGTERM while the server loads (here: a first start, its kernels compiling in an empty
    directory while torch is imported) exits 0 without a traceback, leaving no compiler running and
    no half-built kernels."""
    port = free_port()
    native_dir = tmp_path / "native"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFIXSERVE_MODEL_CACHE_DIR": TEST_MODEL_CACHE,
           "PYTHONPATH": str(REPO_ROOT), "PREFIXSERVE_NATIVE_DIR": str(native_dir)}
    log = tmp_path / "log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "prefixserve.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(port), "--data-dir", str(tmp_path / "data"), "--no-ledger"],
                                cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        phase = None
        while phase is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                phase = r.json()["phase"] if r.status_code == 503 else None
            except httpx.HTTPError:
                time.sleep(0.05)
        assert phase is not None, log.read_text(errors="replace")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text(errors="replace")
        assert "Traceback" not in log.read_text(errors="replace")
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        assert not [n for n in (os.listdir(native_dir) if native_dir.exists() else []) if n.startswith(".build-")]
        ps = subprocess.run(["ps", "-eo", "args"], check=True, capture_output=True, text=True).stdout
        assert str(native_dir) not in ps
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_log_level_warning_leaves_info_lines_out() -> None:
    """`--log-level warning`: no phase lines, no INFO record of the server's own loggers (the access
    log, the model's), from start-up to a served request; the server serves as ever."""
    with ServerProcess(["--no-ledger", "--log-level", "warning"], start_timeout=240) as srv:
        r = httpx.post(srv.openai_url + "/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200, r.text
        log = srv.log_text()
    assert "OPEN" in log  # a warning still goes out: no API keys, every caller is one tenant
    assert not [line for line in log.splitlines() if line.startswith("prefixserve: [") or " INFO " in line], log[-3000:]
