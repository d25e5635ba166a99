"""The kernels' directory is checked before a library in it is loaded (models/kernels/native_build.py
`check_private`): another user's, or one others may write, is refused with an ERROR line and the
server computes with torch, never loading code someone else could have put there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prefixserve.models.kernels import native, native_build

LOAD = "from prefixserve.models.kernels import native; print(native.library() is not None)"


def load_in(build_dir: Path) -> tuple[bool, str]:
    """Whether a fresh process loads native kernels from `build_dir`, and its stderr."""
    env = {**os.environ, "PREFIXSERVE_NATIVE_DIR": str(build_dir)}
    out = subprocess.run([sys.executable, "-c", LOAD], env=env, check=False, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()[-1] == "True", out.stderr


def test_a_directory_others_may_write_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    build_dir = tmp_path / "native"
    build_dir.mkdir()
    build_dir.chmod(0o777)
    loaded, err = load_in(build_dir)
    assert not loaded
    assert f"refusing {build_dir}: writable by its group or others" in err and "torch formulation" in err
    assert os.listdir(build_dir) == []  # nothing compiled into it


def test_a_library_others_may_write_is_not_loaded(tmp_path: Path) -> None:
    if native.library() is None:
        pytest.skip("no native kernels on this machine")
    build_dir = tmp_path / "native"
    build_dir.mkdir(mode=0o700)
    lib = build_dir / native.build_name()
    shutil.copyfile(os.path.join(native.build_dir(), native.build_name()), lib)
    lib.chmod(0o755)
    assert load_in(build_dir)[0]  # the same file, private: loaded
    lib.chmod(0o757)
    loaded, err = load_in(build_dir)
    assert not loaded and f"refusing {lib}: writable by its group or others" in err


def test_check_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    (own / "k.so").write_bytes(b"")
    native_build.check_private(str(own), str(own / "k.so"))  # no error
    (own / "k.so").chmod(0o620)
    with pytest.raises(native_build.UnsafeBuildDir, match="writable by its group or others"):
        native_build.check_private(str(own), str(own / "k.so"))
    (own / "link.so").symlink_to(own / "k.so")
    (own / "k.so").chmod(0o600)
    with pytest.raises(native_build.UnsafeBuildDir, match="not a regular file"):
        native_build.check_private(str(own), str(own / "link.so"))
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(own).st_uid + 1)
    with pytest.raises(native_build.UnsafeBuildDir, match="owned by uid"):
        native_build.check_private(str(own))
