"""The disk tier's (cache/disk.py) file-system side: what it does when its directory cannot be
written, and how its files are kept private (docs/cache.md, "Disk failures", "Privacy"). A
read-only, full or vanished filesystem must cost neither the writer thread nor memory: the tier
keeps serving what it holds, counts and logs the failures, holds no state for a write that cannot
happen, and writes again once it can."""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Sequence
from typing import BinaryIO

log = logging.getLogger("prefixserve.cache")
WRITE_RETRY_S = 5.0  # after a failed write (an OSError) offers are refused this long, then one is tried
LOG_EVERY_S = 60.0  # the same kind of failure again is logged at most this often
FILE_MODE = 0o600  # the files hold every tenant's prompt token ids in the clear
_PRIVATE = 0o077  # group and other bits


def error_kind(e: BaseException) -> str:
    """`EROFS`, `ENOSPC`, ... for an OSError; the exception's type name otherwise."""
    if isinstance(e, OSError) and e.errno is not None:
        return errno.errorcode.get(e.errno, f"errno {e.errno}")
    return type(e).__name__


class WriteHealth:
    """The failed writes of one tier; the tier mutates it under its lock.

    After a failed write on an OSError the tier refuses offers for WRITE_RETRY_S (dropping what is
    queued), then lets one write through at a time until one succeeds: a read-only filesystem never
    fills the queue with states kept alive for writes that cannot happen, and a remount is noticed
    within WRITE_RETRY_S. Each kind of error (errno) is logged once, then at most every LOG_EVERY_S,
    without a traceback: a warning per write would flood the log. Another exception (a codec bug) is
    logged with its traceback by the same rule, and fails that write only."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.num_failures = 0  # writes attempted that failed, since start
        self.failing = 0  # OSErrors since the last write that succeeded
        self._retry_at = 0.0  # time.monotonic(): offers before it are refused
        self._logged: dict[str, tuple[float, int]] = {}  # kind -> (last logged, failures not logged since)

    def refuses(self, busy: bool) -> bool:
        """Whether to refuse an offer now; `busy`: a write is queued or in flight."""
        return self.failing > 0 and (busy or time.monotonic() < self._retry_at)

    def failed(self, e: Exception, write: bool = True) -> None:
        """Count (unless not a `write`: the start-up probe) and maybe log a failed write. Keeps no
        reference to `e`: its traceback holds the frames, and so the state, of the write."""
        now = time.monotonic()
        self.num_failures += write
        if isinstance(e, OSError):
            self.failing += 1
            self._retry_at = now + WRITE_RETRY_S
        kind = error_kind(e)
        last, quiet = self._logged.get(kind, (-LOG_EVERY_S, 0))
        if now - last < LOG_EVERY_S:
            self._logged[kind] = (last, quiet + 1)
            return
        self._logged[kind] = (now, 0)
        again = f" ({quiet} more since the last report)" if quiet else ""
        if isinstance(e, OSError):
            log.warning("disk tier: cannot write to %s: [%s] %s%s; serving what it holds, trying again "
                        "every %gs (disk_write_failures)", self.directory, kind, e.strerror or e, again,
                        WRITE_RETRY_S)
        else:
            log.error("disk tier: a write failed%s", again, exc_info=(type(e), e, e.__traceback__))

    def check_directory(self) -> None:
        """At start: warn if group or other may use the directory (an operator's directory is theirs
        to chmod, not ours); if it cannot be written, start as after a failed write."""
        mode = os.stat(self.directory).st_mode
        if mode & _PRIVATE:
            log.warning("disk tier: %s has mode %04o; its files hold every tenant's prompt token ids: "
                        "make it private to this server's user (chmod 700)", self.directory, mode & 0o7777)
        try:
            probe_writable(self.directory)
        except OSError as e:  # not fatal: what the directory holds is still served
            self.failed(e, write=False)

    def ok(self) -> None:
        """A write succeeded: end a failing spell (so the next one is reported at once)."""
        if self.failing:
            log.warning("disk tier: writing to %s again after %d failures", self.directory, self.failing)
            self.failing = 0
            self._logged.clear()


def create_private(path: str) -> BinaryIO:
    """`path` opened for writing, created (or truncated) with mode FILE_MODE whatever the umask or a
    leftover file's mode: never readable by another user, even for a moment."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def make_private(path: str, mode: int) -> None:
    """Tighten a file (of `mode`) written before files were created FILE_MODE; best effort."""
    if mode & _PRIVATE:
        try:
            os.chmod(path, FILE_MODE)
        except OSError:
            pass


def probe_writable(directory: str) -> None:
    """Create and remove a file in `directory`; raises the OSError (EROFS, EACCES, ENOSPC...) if it
    cannot. A permission check is not enough: root passes it, and a read-only mount is not a mode.
    The name ends in .tmp, so a crash leaves nothing the next scan keeps."""
    path = os.path.join(directory, f".probe-{os.getpid()}.tmp")
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE))
    os.unlink(path)


def remove(paths: Sequence[str]) -> None:
    """Best effort: a file left behind (a read-only disk: EROFS) is found again by the next scan,
    and cleanup must never turn one failure into another."""
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.debug("disk tier: cannot remove %s: %s", os.path.basename(p), e)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


KEY_FILE = "names.key"  # the directory's own key for TierKeys, where no deployment secret is set
KEY_BYTES = 32


def directory_key(directory: str) -> bytes:
    """The key naming the files of `directory` (cache/tier.py, TierKeys) where no deployment secret
    is set: `KEY_FILE` in it, KEY_BYTES random bytes created once (mode FILE_MODE, whole or not at
    all: written beside it and linked into place, so two starting processes agree on one) and read
    at later starts. A key file of another length is replaced (the files named under it are removed
    by the scan as another key's). Where the directory cannot be written and holds no key, a key for
    this process only (logged): nothing in the directory is served, as nothing written there lands."""
    path = os.path.join(directory, KEY_FILE)
    for _ in range(3):
        try:
            with open(path, "rb") as f:
                make_private(path, os.fstat(f.fileno()).st_mode)
                key = f.read(KEY_BYTES + 1)
            if len(key) == KEY_BYTES:
                return key
            log.warning("disk tier: %s is not a key of %d bytes; a new one names the files from now on", path, KEY_BYTES)
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("disk tier: cannot read %s (%s); this process names its files with a key of its own", path, e)
            return os.urandom(KEY_BYTES)
        tmp = os.path.join(directory, f".key-{os.getpid()}.tmp")
        try:
            with create_private(tmp) as f:
                f.write(os.urandom(KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)  # fails if another process made one first: then that one is read
            fsync_dir(directory)
        except FileExistsError:
            pass
        except OSError as e:
            log.warning("disk tier: cannot create %s (%s); this process names its files with a key of its own", path, e)
            return os.urandom(KEY_BYTES)
        finally:
            remove([tmp])
    log.warning("disk tier: %s keeps changing; this process names its files with a key of its own", path)
    return os.urandom(KEY_BYTES)
