"""Safe file output: atomic writes (a reader sees the old file or the new one, never half of
either), one writer per run (a lock), and the rule for --force: replace only what tbp wrote,
never the command's own input."""
from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import shutil
import tempfile
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


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Temp file in the same directory, fsync, os.replace, fsync the directory.

    A failure (a full disk, a file-size limit) removes the temporary file, leaves ``path`` as
    it was, and raises an OSError that names ``path``, not the temporary file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        raise
    _fsync_dir(path.parent)


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


def append_line(path: str | Path, line: str) -> None:
    """Append one line and fsync: a crash loses at most the line being written."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(line.rstrip("\n") + "\n")
        f.flush()
        os.fsync(f.fileno())


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
    if not out.exists():
        return
    if not out.is_dir():
        raise TbpError(f"{out}: is a file, not a folder; refusing to replace it")
    here = out.resolve()
    for given in inputs:
        if given is None:
            continue
        src = Path(given).resolve()
        if here == src or here in src.parents or src in here.parents:
            raise TbpError(f"{out}: is (or holds, or lies inside) this command's own input {given}; "
                           f"choose another --out")
    names = [str(p.relative_to(out)) for p in out.rglob("*")]
    if not names:
        return
    foreign = [n for n in names if not any(fnmatch.fnmatch(n, pat) for pat in patterns)]
    if foreign:
        raise TbpError(f"{out}: holds files tbp did not write ({', '.join(sorted(foreign)[:3])}); "
                       f"refusing to replace it, even with --force")
    if marker not in names:
        raise TbpError(f"{out}: is not {what} (no {marker}); refusing to replace it, even with --force")


class RunLock:
    """One writer per run directory: an exclusive lock on ``RUN/.lock`` (fcntl.flock), held while
    the process lives; a second writer is refused with the holder's pid. Where flock does not
    exist (Windows) it does nothing."""

    NAME = ".lock"

    def __init__(self, run: Path):
        self.run, self.fd, self.created = Path(run), None, False

    def acquire(self) -> "RunLock":
        try:
            import fcntl
        except ImportError:                     # no advisory locks here
            return self
        self.created = not self.run.exists()
        self.run.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.run / self.NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise TbpError(f"{self.run}: another tbp process (pid {holder}) is writing this run; "
                               f"wait for it or stop it first") from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd
        return self

    def release(self, remove_if_alone: bool = False) -> None:
        """Drop the lock; with ``remove_if_alone``, also remove the run directory if the lock
        file is all it holds (a run that failed before its first save leaves nothing)."""
        if self.fd is None:
            return
        if remove_if_alone and self.created and [p.name for p in self.run.iterdir()] == [self.NAME]:
            with contextlib.suppress(OSError):
                os.unlink(self.run / self.NAME)
                self.run.rmdir()
        os.close(self.fd)                       # closing drops the lock
        self.fd = None

    def __del__(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


def sweep_temporaries(folder: Path) -> None:
    """Remove the temporary files a killed writer left behind (.NAME.XXXX.tmp)."""
    for p in Path(folder).glob(f".*{TMP_SUFFIX}"):
        with contextlib.suppress(OSError):
            p.unlink()


@contextlib.contextmanager
def staged_dir(out: str | Path, force: bool = False):
    """Yield a temporary sibling folder; on success it replaces ``out`` in one rename.

    On any failure (or Ctrl-C) the temporary folder is removed and ``out`` is untouched.
    With ``force`` an existing ``out`` is moved aside first and deleted after the swap.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        yield tmp
        _fsync_dir(tmp)
        old = None
        if out.exists():
            if not force:
                raise FileExistsError(f"{out} already exists (use --force to replace it)")
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))
            os.replace(out, old / "x")
        os.replace(tmp, out)
        _fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, FileExistsError):
            # name the folder being written, not the temporary one that is gone now
            raise OSError(e.errno, e.strerror or str(e), str(out)) from None
        raise
