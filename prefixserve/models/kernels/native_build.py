"""Building the native kernels (models/kernels/native.py): the compiler run, importable without torch.

It owns what a build is made of: the C sources beside this file (`SOURCES`, `HEADERS`), the flags
(`FLAGS` and the ISA level's `isa.march_flags()`), the directory of built files (`build_dir()`) and
the build's identity (`digest()`).

`prebuild()` starts the build on a thread as soon as a process knows it will want the
kernels (`prefixserve serve` does first of all), so the compilers run on the other core while the
process imports its modules and torch and prepares the model (as for kernels that build:
`building()`, `native.expected()`); `native.library()` then waits for that build (`built_path`)
instead of starting its own. The result is the same file either way: its name is a
digest of the source, the flags, the compiler's version and the CPU's flags (`digest()`).
`python -m prefixserve.models.kernels.native_build` builds them at once (`main`: `make install` runs it
beside pip). `cancel()` stops a build in flight (its compilers killed, nothing left behind) for a process that
ends before it needs the kernels: a SIGTERM during a first start's imports.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time

from prefixserve.models.kernels import isa

log = logging.getLogger("prefixserve.models")

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = tuple(os.path.join(HERE, name) for name in ("attention.c", "qmatmul.c", "gemm.c", "amx.c", "decode.c"))
HEADERS = (os.path.join(HERE, "simd.h"),)
FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC", "-pthread")
NICE_INCREMENT = 10  # the compilers' priority below this process's
_build_lock = threading.Lock()  # held while the kernels compile: `built_path` waits for `prebuild`'s build
_built: str | BaseException | None = None  # the built file's path, or why the build failed
_cancelled = threading.Event()  # `cancel()`: a build in flight stops, a later one does not start
_prebuilding = threading.Event()  # `prebuild()` started its thread (once a process)
_digest: str | None = None


def build_dir() -> str:
    """Where built kernels go: PREFIXSERVE_NATIVE_DIR, else `$XDG_CACHE_HOME/prefixserve/native`."""
    # XDG's cache home, as config.cache_home computes it (models import nothing of ours above them).
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return os.environ.get("PREFIXSERVE_NATIVE_DIR") or os.path.join(base, "prefixserve", "native")


def digest() -> str:
    """The built kernel's identity: source, flags, CPU flags (what -march=native sees). Part of the
    tier fingerprint: a state computed by another build is another state."""
    global _digest
    if _digest is None:
        h = hashlib.blake2b(digest_size=8)
        for path in SOURCES + HEADERS:
            with open(path, "rb") as f:
                h.update(f.read())
        h.update(" ".join(FLAGS + isa.march_flags()).encode())
        h.update(isa.cpu_flags().encode())
        _digest = h.hexdigest()
    return _digest


def _build(cc: str) -> str:
    """The built kernels' path: compiled now unless a file of this name is there. Each source is
    compiled on its own (`-c`, all at once, at a lower priority: one translation unit each, as one
    `cc` call with all of them compiles them), then linked."""
    version = subprocess.run([cc, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
    name = hashlib.blake2b((digest() + version).encode(), digest_size=12).hexdigest()
    out_dir = build_dir()
    path = os.path.join(out_dir, f"kernels-{name}.so")
    if os.path.isfile(path):
        check_private(out_dir, path)
        return path
    os.makedirs(out_dir, mode=0o700, exist_ok=True)
    check_private(out_dir)
    work = tempfile.mkdtemp(prefix=".build-", dir=out_dir)
    procs: list[subprocess.Popen[str]] = []
    try:
        flags = [*FLAGS, *isa.march_flags()]
        objs = [os.path.join(work, os.path.basename(src) + ".o") for src in SOURCES]
        for src, obj in zip(SOURCES, objs, strict=True):
            # each in a process group of its own (not a session: that would be a scheduler autogroup of its
            # own, where `nice` means nothing): a kill reaches the compiler proper (cc1) too
            procs.append(subprocess.Popen([*_lower_priority(), cc, *flags, "-c", "-o", obj, src], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, process_group=0))
        for proc in procs:
            err = _finished(proc, timeout=300)
            if proc.returncode:
                raise subprocess.CalledProcessError(proc.returncode, proc.args, stderr=err)
        tmp = os.path.join(work, "kernels.so")
        subprocess.run([cc, *flags, "-o", tmp, *objs, "-lm"], check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, path)  # atomic: a concurrent build of the same source writes the same bytes
    finally:
        for proc in procs:  # a failed, timed-out or cancelled build leaves no compiler running
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                _gone(proc.pid)
        shutil.rmtree(work, ignore_errors=True)
    return path


def _gone(group: int, timeout: float = 5.0) -> None:
    """Wait (at most `timeout` s) until no process of this process group is alive: the driver's wait
    returns while its compiler proper and assembler (cc1, as), killed with it, may still be exiting,
    slowly on a busy machine. Zombies count as gone; without /proc it returns at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pids = [p for p in os.listdir("/proc") if p.isdigit()]
        except OSError:
            return
        alive = False
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            except (OSError, IndexError):
                continue
            if int(fields[2]) == group and fields[0] != "Z":
                alive = True
                break
        if not alive:
            return
        time.sleep(0.01)


def _finished(proc: subprocess.Popen[str], timeout: float) -> str:
    """Wait for a compiler (its stderr back), looking every 0.1 s for `cancel()`; BuildCancelled then."""
    deadline = time.monotonic() + timeout
    while True:
        if _cancelled.is_set():
            raise BuildCancelled()
        try:
            return proc.communicate(timeout=0.1)[1]
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                raise


class BuildCancelled(subprocess.SubprocessError):
    """`cancel()` stopped the build: the process is ending before it needed the kernels."""

    def __init__(self) -> None:
        super().__init__("the native kernels' build was cancelled")


class UnsafeBuildDir(OSError):
    """The kernels' directory or file is another user's, or others may write it: loading a library from
    it would run whatever they put there, in this process (library() falls back to torch)."""


def check_private(out_dir: str, path: str | None = None) -> None:
    """Raise UnsafeBuildDir (and log it at ERROR) unless `out_dir`, and `path` in it when given (a built
    library, a regular file, not a link), are owned by this process's user and writable by no group
    and no other user. Checked before a library there is loaded or built."""
    for p in (out_dir,) if path is None else (out_dir, path):
        st = os.stat(p) if p == out_dir else os.lstat(p)
        why = (f"owned by uid {st.st_uid}, not this process's {os.geteuid()}" if st.st_uid != os.geteuid()
               else "not a regular file" if p == path and not stat.S_ISREG(st.st_mode)
               else "writable by its group or others" if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) else None)
        if why is not None:
            log.error("native kernels: refusing %s: %s (chmod go-w it or set PREFIXSERVE_NATIVE_DIR to a directory "
                      "of your own); attention uses its torch formulation", p, why)
            raise UnsafeBuildDir(f"{p} is {why}")


def _lower_priority() -> list[str]:
    """The command prefix that runs a compiler at NICE_INCREMENT below this process (`nice`, where
    there is one), so it yields the CPU to the start-up's own Python, which the whole start-up waits
    on, and uses the cycles that leaves."""
    nice = shutil.which("nice")
    return [nice, "-n", str(NICE_INCREMENT)] if nice else []


def compiler() -> str | None:
    """$CC, else cc or gcc on PATH; None where there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def built_path(cc: str) -> str:
    """`_build(cc)` once per process; a later call (or one waiting while `prebuild`'s thread builds)
    gets the same path, or the same exception again."""
    global _built
    with _build_lock:
        if _built is None and _cancelled.is_set():
            _built = BuildCancelled()
        if _built is None:
            try:
                _built = _build(cc)
            except (OSError, subprocess.SubprocessError) as e:
                _built = e
    if isinstance(_built, BaseException):
        raise _built
    return _built


def prebuild() -> None:
    """Start building (or finding) the kernels on a thread, so the compiler runs on another core
    while this process imports torch and loads the model; `library()` waits for it. Nothing where
    `library()` would not build (PREFIXSERVE_NATIVE=0, an ISA level this CPU cannot run, no compiler).
    Not a daemon: a process that exits meanwhile (SIGTERM while importing) waits for the build to end;
    as a daemon thread its exit hung. Once a process: a later call does nothing."""
    cc = compiler()
    if cc is not None and not _prebuilding.is_set() and unbuildable() is None:
        _prebuilding.set()
        threading.Thread(target=_quietly_built, args=(cc,), name="prefixserve-native-build").start()


def building() -> bool:
    """Whether `prebuild`'s thread is still building (or finding) the kernels: `native.expected()`
    lets the model be prepared meanwhile."""
    return _prebuilding.is_set() and _built is None and not _cancelled.is_set()


def unbuildable() -> str | None:
    """Why no kernels are built in this environment (PREFIXSERVE_NATIVE=0, an ISA level this module
    does not know or this CPU cannot run, no compiler), else None: what `prebuild` and `main` ask."""
    if os.environ.get("PREFIXSERVE_NATIVE", "1") == "0":
        return "PREFIXSERVE_NATIVE=0"
    try:
        isa.isa()
    except ValueError as e:
        return str(e)
    return "no C compiler" if compiler() is None else None


def cancel() -> None:
    """Stop a build in flight within ~0.1 s (its compilers killed, its temporary directory removed) and
    start none later in this process: for a start-up that ends before it needs the kernels, so its
    exit does not wait for `prebuild`'s thread to finish compiling."""
    _cancelled.set()


def _quietly_built(cc: str) -> None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # `library()` logs a failure when it asks
        built_path(cc)


def main() -> int:
    """`python -m prefixserve.models.kernels.native_build`: build (or find) the kernels now, for the
    ISA level and directory this environment gives (PREFIXSERVE_NATIVE_ISA, PREFIXSERVE_NATIVE_DIR,
    XDG_CACHE_HOME). `make install` runs it beside pip, whose installs leave a core idle, so a first
    `prefixserve serve` finds the kernels built, as llama.cpp's server is built before it runs. Says
    what it did on stdout and returns 0 even where nothing builds (the server then logs why and runs
    the torch formulations): an install never fails for the kernels."""
    cc, why = compiler(), unbuildable()
    if why is not None or cc is None:  # (no compiler is one of `unbuildable`'s reasons)
        print(f"native kernels: not built ({why})")
        return 0
    t0 = time.monotonic()
    try:
        path = built_path(cc)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or e
        print(f"native kernels: build failed ({str(detail)[-800:]}); prefixserve serve will say so and use torch")
        return 0
    print(f"native kernels ({isa.isa()}): {path} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
