"""Safe file output: atomic writes (a reader sees the old file or the new one, never half of
either), one writer per run (a lock), and the rule for --force: replace only what tbp wrote,
never the command's own input."""
from __future__ import annotations

import contextlib
import errno
import re
import fnmatch
import glob
import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from .errors import TbpError

TMP_SUFFIX = ".tmp"
_UMASK = os.umask(0o022)
os.umask(_UMASK)                         # read once: mkstemp makes 0600 files, tbp's follow the umask


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | Path):
    """Yield a temporary path in ``path``'s folder for the caller (or a library) to write whole;
    then fsync it, os.replace it onto ``path`` and fsync the folder.

    ``os.replace`` puts a new file where the old name was: a symlink planted at ``path`` is
    replaced, never written through.

    A failure (a full disk, a file-size limit, Ctrl-C) removes the temporary file, leaves
    ``path`` as it was, and an OSError names ``path``, not the temporary file."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """``data`` as the whole of ``path``, atomically (:func:`atomic_file`)."""
    with atomic_file(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


def link_or_copy(src: Path, dst: Path) -> None:
    """dst becomes a second name for src's bytes (a hard link), or an atomic copy where the
    file system has no hard links."""
    tmp = dst.with_name(f".{dst.name}.link{TMP_SUFFIX}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    try:
        os.link(src, tmp)
    except OSError:
        atomic_write_bytes(dst, Path(src).read_bytes())
        return
    os.replace(tmp, dst)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def open_own(path: str | Path, flags: int) -> int:
    """``os.open`` of a file tbp writes in place (a lock, a log it appends to), refusing a
    symlink or a hard link planted there: tbp never writes through a name it did not make.
    Returns the descriptor of a regular file with one link."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666 & ~_UMASK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise TbpError(f"{path}: is a symbolic link; tbp writes only files it made, remove it") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise TbpError(f"{path}: is not a plain file of its own (a device, a folder or a hard link); "
                       f"tbp writes only files it made, remove it")
    return fd


def append_line(path: str | Path, line: str) -> None:
    """Append one line and fsync: a crash loses at most the line being written."""
    fd = open_own(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with os.fdopen(fd, "ab") as f:
        f.write((line.rstrip("\n") + "\n").encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


def write_raw(path: Path, a) -> None:
    """Write an array's bytes to a new file and fsync it. Unlike ``ndarray.tofile``, a full
    disk raises OSError(ENOSPC) naming ``path``."""
    import numpy as np
    try:
        with open(path, "xb") as f:
            f.write(memoryview(np.ascontiguousarray(a)).cast("B"))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


def claim_output(out: Path, force: bool, patterns: tuple[str, ...], marker: str, what: str,
                 inputs: tuple = ()) -> None:
    """The one rule for a command's --out folder: refuse an existing one without --force, and
    with --force refuse anything but what tbp wrote (see :func:`check_replaceable`)."""
    if Path(out).exists() and not force:
        raise TbpError(f"{out} already exists (use --force to replace it)")
    check_replaceable(out, patterns, marker, what, inputs)


def check_replaceable(out: Path, patterns: tuple[str, ...], marker: str, what: str,
                      inputs: tuple = ()) -> None:
    """Raise TbpError unless ``out`` may be replaced with --force: it does not exist, is empty,
    or holds only files tbp writes there (``patterns``, fnmatch, with ``marker`` among them), and
    it is not, does not contain and does not lie inside any of the command's ``inputs``."""
    out = Path(out)
    refuse_inputs(out, inputs, "folder")
    if not out.exists():
        return
    if not out.is_dir():
        raise TbpError(f"{out}: is a file, not a folder; refusing to replace it")
    names = [str(p.relative_to(out)) for p in out.rglob("*")]
    if not names:
        return
    foreign = foreign_files(out, patterns)
    if foreign:
        raise TbpError(f"{out}: holds files tbp did not write ({', '.join(sorted(foreign)[:3])}); "
                       f"refusing to replace it, even with --force")
    if marker not in names:
        raise TbpError(f"{out}: is not {what} (no {marker}); refusing to replace it, even with --force")


def refuse_inputs(out: Path, inputs: tuple, kind: str) -> None:
    """Raise TbpError if the output ``out`` is, holds or lies inside any of the command's
    ``inputs`` (resolved: also for an output not made yet)."""
    here = Path(out).resolve()
    for given in inputs:
        if given is None:
            continue
        src = Path(given).resolve()
        if here == src or here in src.parents or src in here.parents:
            raise TbpError(f"{out}: is (or holds, or lies inside) this command's own input {given}; "
                           f"choose another output {kind}")


def foreign_files(folder: Path, patterns: tuple[str, ...]) -> list[str]:
    """The files under ``folder`` (relative names) that match none of ``patterns`` (fnmatch):
    what tbp did not write there."""
    folder = Path(folder)
    names = (str(p.relative_to(folder)) for p in folder.rglob("*"))
    return [n for n in names if not any(fnmatch.fnmatch(n, pat) for pat in patterns)]


class Held(TbpError):
    """A RunLock another live process holds."""


def _flock_patiently(fd: int, fcntl, tries: int = 20) -> None:
    """Take the exclusive lock, waiting out a looker's brief shared one (:func:`_lock_state`,
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


def _lock_state(path: Path) -> bool | None:
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
    return _lock_state(Path(run) / RunLock.NAME) is True


def sweep_temporaries(folder: Path) -> None:
    """Remove the temporary files a killed writer left behind (.NAME.XXXX.tmp)."""
    for p in Path(folder).glob(f".*{TMP_SUFFIX}"):
        with contextlib.suppress(OSError):
            p.unlink()


OWNER = ".owner"                        # inside a staging folder: flocked while its writer lives


def _owned_dir(parent: Path, prefix: str, suffix: str) -> tuple[Path, int]:
    """A new hidden folder under ``parent`` holding a flocked OWNER file: (folder, descriptor).
    A folder that cannot be made there (read-only, full) is reported as ``parent``'s problem: the
    temporary name means nothing to the person reading the error."""
    try:
        new = Path(tempfile.mkdtemp(dir=parent, prefix=prefix, suffix=".new"))  # a name no sweep matches
    except OSError as e:
        raise OSError(e.errno, f"cannot write here ({e.strerror})", str(parent)) from None
    fd = os.open(new / OWNER, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with contextlib.suppress(ImportError):
        import fcntl
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    folder = new.with_name(new.name[:-len(".new")] + suffix)
    os.rename(new, folder)                       # only now, locked, may a sweep look at it
    return folder, fd


def _owner_gone(folder: Path) -> bool:
    """True if ``folder`` has an OWNER file whose lock no live process holds (no owner file: not
    ours, or its writer is finishing)."""
    return _lock_state(folder / OWNER) is False


def sweep_staging(out: Path) -> None:
    """Remove the staging folders of ``out`` that a killed writer left (``.OUT.XXXX.tmp``), and
    put back a previous ``out`` that a writer killed mid-swap had moved aside (``.OUT.XXXX.old``).
    Only folders whose OWNER lock is free are touched: a live writer's are left alone. (A
    writer killed between its rename and its last unlink leaves OWNER in ``out``: removed too.)"""
    if _owner_gone(out):
        with contextlib.suppress(OSError):
            os.unlink(out / OWNER)
    own = re.compile(re.escape(f".{out.name}.") + r"[a-z0-9_]{8}\.(tmp|old)")     # mkdtemp's names, exactly
    for p in sorted(out.parent.glob(f".{glob.escape(out.name)}.*")):
        if not own.fullmatch(p.name) or not p.is_dir() or p.is_symlink() or not _owner_gone(p):
            continue
        if p.suffix == ".old" and (p / "x").is_dir() and not os.path.lexists(out):
            os.replace(p / "x", out)
        shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(out: str | Path, force: bool = False):
    """Yield a temporary sibling folder; on success it replaces ``out`` in one rename.

    On any failure (or Ctrl-C) the temporary folder is removed and ``out`` is untouched.
    With ``force`` an existing ``out`` is moved aside first and deleted after the swap. What a
    writer killed with SIGKILL leaves is swept by the next writer of ``out`` (:func:`sweep_staging`).
    The folder is private while it is written and follows the umask once it is ``out``.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_staging(out)
    if out.exists() and not force:                # a swept .old may have put it back
        raise FileExistsError(f"{out} already exists (use --force to replace it)")
    tmp, owner = _owned_dir(out.parent, f".{out.name}.", ".tmp")
    old = old_owner = None
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_UMASK)
        _fsync_dir(tmp)
        if out.exists():
            if not force:
                raise FileExistsError(f"{out} already exists (use --force to replace it)")
            old, old_owner = _owned_dir(out.parent, f".{out.name}.", ".old")
            os.replace(out, old / "x")
        os.replace(tmp, out)
        os.unlink(out / OWNER)                  # the lock stays on the open descriptor
        _fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        if old is not None and (old / "x").exists() and not os.path.lexists(out):
            os.replace(old / "x", out)           # failed between the two renames: the old one back
            shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, FileExistsError) and _names_inside(e, tmp):
            # name the folder being written, not the temporary one that is gone now; an error about
            # anything else (the input, deleted while it was read) keeps its own name
            raise OSError(e.errno, e.strerror or str(e), str(out)) from None
        raise
    finally:
        for fd in (owner, old_owner):
            if fd is not None:
                os.close(fd)


def _names_inside(e: OSError, folder: Path) -> bool:
    """Whether an OSError is about ``folder`` or a path in it (or names no path at all)."""
    names = [n for n in (e.filename, e.filename2) if n is not None]
    if not names:
        return True
    inside = str(Path(folder))
    return any(str(n) == inside or str(n).startswith(inside + os.sep) for n in names)


def portable_path(path: Path, start: Path) -> str:
    """``path`` as a file written in ``start`` records it: relative when it sits beside
    ``start`` (``../pydoc``: the two move together), else absolute (a path elsewhere stays
    found when ``start`` alone moves; another drive has no relative path)."""
    try:
        rel = os.path.relpath(Path(path).resolve(), Path(start).resolve())
    except ValueError:
        return str(Path(path).resolve())
    return rel if rel.split(os.sep).count("..") <= 1 else str(Path(path).resolve())


def from_recorded(start: Path, recorded: str) -> Path:
    """The path ``portable_path`` recorded in ``start`` (an absolute one as it is)."""
    path = Path(recorded)
    return path if path.is_absolute() else Path(start) / path
