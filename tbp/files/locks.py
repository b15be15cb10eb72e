"""One writer per run: an exclusive advisory lock (fcntl.flock) on a file the writer holds open
while it lives, and a way to look at such a lock without taking it. The staging folders of
``staging.py`` use the same look to tell a live writer's folder from a killed one's."""
from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path

from ..errors import TbpError
from .atomic import open_own


class Held(TbpError):
    """A RunLock another live process holds."""


def _flock_patiently(fd: int, fcntl, tries: int = 20) -> None:
    """Take the exclusive lock, waiting out a looker's brief shared one (:func:`lock_state`,
    microseconds) for up to about 0.2 s; a writer that holds it still raises."""
    for i in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK) or i == tries - 1:
                raise
            time.sleep(0.01)


class RunLock:
    """One writer per run directory: an exclusive lock on ``RUN/.lock`` (fcntl.flock), held while
    the process lives; a second writer is refused with the holder's pid. Where flock does not
    exist (Windows) it does nothing.

    The lock file is opened with :func:`open_own`: a symlink or hard link planted at ``.lock``
    is refused, never truncated. ``created`` and ``made_lock`` record what this process made,
    so that a refused claim takes away exactly that (``release(remove_if_alone=True)``)."""

    NAME = ".lock"

    def __init__(self, run: Path):
        self.run, self.fd, self.created, self.made_lock = Path(run), None, False, False

    def acquire(self) -> "RunLock":
        try:
            import fcntl
        except ImportError:                     # no advisory locks here
            return self
        self.created = not self.run.exists()
        self.run.mkdir(parents=True, exist_ok=True)
        path = self.run / self.NAME
        for _ in range(5):                      # again if a releasing holder unlinked the file under us
            try:
                fd, self.made_lock = open_own(path, os.O_RDWR | os.O_CREAT | os.O_EXCL), True
            except FileExistsError:
                try:
                    fd, self.made_lock = open_own(path, os.O_RDWR), False
                except FileNotFoundError:
                    continue
            try:
                _flock_patiently(fd, fcntl)
            except OSError as e:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise Held(f"{self.run}: another tbp process (pid {holder}) is writing this run; "
                               f"wait for it or stop it first") from None
                raise
            with contextlib.suppress(FileNotFoundError):
                if os.lstat(path).st_ino == os.fstat(fd).st_ino:
                    break
            os.close(fd)
        else:
            raise TbpError(f"{path}: the lock file keeps changing; is another tbp starting here?")
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd
        return self

    def release(self, remove_if_alone: bool = False) -> None:
        """Drop the lock; with ``remove_if_alone``, also take away what acquiring made when the
        lock file is all the folder holds: the lock file, and the folder if this process made it
        (a refused --out, or a run that failed before writing anything, leaves nothing behind;
        one whose first save failed half-way keeps its lock, the mark of an unfinished run)."""
        if self.fd is None:
            return
        if remove_if_alone and self.made_lock and [p.name for p in self.run.iterdir()] == [self.NAME]:
            with contextlib.suppress(OSError):
                os.unlink(self.run / self.NAME)
                if self.created:
                    self.run.rmdir()
        os.close(self.fd)                       # closing drops the lock
        self.fd = None

    def __del__(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


def lock_state(path: Path) -> bool | None:
    """Whether a live process holds the flock on the file ``path``: True, False, or None where
    there is no such file (or no flock). Looks only: opens the file read-only and tries a shared
    lock, which no other looker's shared lock blocks."""
    try:
        import fcntl
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except (ImportError, OSError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)                            # also drops the shared lock, if it was taken


def is_held(run: Path) -> bool:
    """True if a live process holds ``run``'s RunLock (a training is writing it); creates nothing."""
    return lock_state(Path(run) / RunLock.NAME) is True
