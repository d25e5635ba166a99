"""The kernels' build: importable without torch, started early, waited for, the same file."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prefixserve.models.kernels import native


def test_prebuild_then_library_in_a_fresh_process(tmp_path: Path) -> None:
    """A process that starts the build before importing torch gets the kernels from that build (one
    file, named as `library()` alone names it), and had not imported torch to start it."""
    code = ("import sys; from prefixserve.models.kernels import native_build; native_build.prebuild(); "
            "assert 'torch' not in sys.modules; from prefixserve.models.kernels import native; "
            "lib = native.library(); print(lib is not None, native.build_name())")
    env = {**os.environ, "PREFIXSERVE_NATIVE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=False, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    ok, name = out.stdout.split()
    if native.library() is None:
        pytest.skip("no native kernels on this machine")
    assert ok == "True" and name == native.build_name()
    assert sorted(os.listdir(tmp_path)) == [name]  # the objects and the temporary directory are gone


BUILD_NOW = [sys.executable, "-m", "prefixserve.models.kernels.native_build"]


def test_the_install_time_build_is_the_file_serve_loads(tmp_path: Path) -> None:
    """`python -m prefixserve.models.kernels.native_build` (make install runs it beside pip) leaves the
    very file a server's `library()` loads, so a first start compiles nothing; run again, it finds it."""
    if native.library() is None:
        pytest.skip("no native kernels on this machine")
    env = {**os.environ, "PREFIXSERVE_NATIVE_DIR": str(tmp_path)}
    first = subprocess.run(BUILD_NOW, env=env, check=False, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    built = tmp_path / native.build_name()
    assert sorted(os.listdir(tmp_path)) == [built.name] and str(built) in first.stdout
    made = built.stat().st_mtime_ns
    again = subprocess.run(BUILD_NOW, env=env, check=False, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and str(built) in again.stdout
    assert built.stat().st_mtime_ns == made  # found, not built again


@pytest.mark.parametrize(("setting", "says"), [({"CC": "/nonexistent/cc"}, "build failed"),
                                               ({"PREFIXSERVE_NATIVE": "0"}, "not built"),
                                               ({"PREFIXSERVE_NATIVE_ISA": "vax"}, "not built")])
def test_the_install_time_build_never_fails_the_install(tmp_path: Path, setting: dict[str, str], says: str) -> None:
    env = {**os.environ, "PREFIXSERVE_NATIVE_DIR": str(tmp_path), **setting}
    out = subprocess.run(BUILD_NOW, env=env, check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and says in out.stdout, (out.stdout, out.stderr[-2000:])
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".so") or n.startswith(".build-")]


def test_a_failed_build_is_reported_once_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefixserve.models.kernels import native_build

    monkeypatch.setenv("PREFIXSERVE_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(native_build, "_built", None)
    with pytest.raises(subprocess.CalledProcessError):
        native_build.built_path("false")  # a "compiler" that always fails
    with pytest.raises(subprocess.CalledProcessError):
        native_build.built_path("false")
    assert os.listdir(tmp_path) == []


def test_cancel_stops_a_build_in_flight_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A start-up that ends during a first build (SIGTERM while importing) cancels it: the waiting call
    raises BuildCancelled within moments, no compiler keeps running, no file or directory is left."""
    from prefixserve.models.kernels import native_build

    cc = native_build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("PREFIXSERVE_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(native_build, "_built", None)
    monkeypatch.setattr(native_build, "_cancelled", threading.Event())
    outcome: list[BaseException | str] = []

    def build() -> None:
        try:
            outcome.append(native_build.built_path(cc))
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            outcome.append(e)

    thread = threading.Thread(target=build)
    thread.start()
    deadline = time.monotonic() + 30
    while not any(n.startswith(".build-") for n in os.listdir(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the compilers are running
    started = time.monotonic()
    native_build.cancel()
    thread.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - started < 2
    assert len(outcome) == 1 and isinstance(outcome[0], native_build.BuildCancelled), outcome
    assert os.listdir(tmp_path) == []
    ps = subprocess.run(["ps", "-eo", "args"], check=True, capture_output=True, text=True).stdout
    assert str(tmp_path) not in ps  # no compiler (cc1 included) still writes there
    with pytest.raises(native_build.BuildCancelled):
        native_build.built_path(cc)  # and none starts later in this process
