"""Safe file output: atomic writes (a reader sees the old file or the new one, never half of
either), files opened refusing planted links, and the rule for --force: replace only what tbp
wrote, never the command's own input. A run's lock is ``locks.py``; a folder written whole,
``staging.py``."""
from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import re
import stat
import tempfile
from pathlib import Path

from ..errors import TbpError

TMP_SUFFIX = ".tmp"
TMP_MARK = "tbp-"                       # in atomic_file's temporary names: a user's own never match
UMASK = os.umask(0o022)
os.umask(UMASK)                         # read once: mkstemp makes 0600 files, tbp's follow the umask


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in the folder ``path`` durable (where the OS allows it)."""
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
    ``path`` as it was, and an OSError names ``path``, not the temporary file. A writer killed
    with ``kill -9`` cannot: its temporary file, flocked while it lived, is removed by the next
    writer of ``path`` (:func:`sweep_stale`), and only then (another writer's, alive, stays)."""
    path = Path(path)
    sweep_stale(path)
    try:
        held, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{TMP_MARK}", suffix=TMP_SUFFIX)
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None
    _hold(held)                                # released when the process ends, however it ends
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~UMASK)
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
    finally:
        os.close(held)
    fsync_dir(path.parent)


def not_a_file(path: Path) -> str | None:
    """Why ``path`` is not a regular file to read (following links), in words -- "missing", "a
    FIFO, not a file", "a character device, not a file" (a link to /dev/zero) -- or None if it is one."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken link" if os.path.islink(path) else "missing"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((f"{name}, not a file" for test, name in kinds if test(mode)), "not a regular file")


def require_files(folder: Path, names: tuple, what: str) -> None:
    """TbpError naming the first of ``names`` in ``folder`` that is not a regular file to read:
    missing (``what`` then says which files such a folder has), or why not (a FIFO, a folder)."""
    for name in names:
        why = not_a_file(folder / name)
        if why == "missing":
            raise TbpError(f"{folder}: missing {name} ({what} has {', '.join(names)})")
        if why is not None:
            raise TbpError(f"{folder / name}: {why}")


def _hold(fd: int) -> None:
    """Lock the temporary file open at ``fd`` while this writer lives (where flock exists)."""
    with contextlib.suppress(ImportError, OSError):
        import fcntl
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def sweep_stale(path: Path) -> None:
    """Remove the temporary files of ``path`` that a killed writer left (``.NAME.tbp-XXXXXXXX.tmp``,
    exactly the names :func:`atomic_file` makes, plain files only), each only if no live
    writer holds its lock."""
    try:
        import fcntl
    except ImportError:                        # no flock: no way to tell a live writer's apart
        return
    mine = re.compile(rf"\.{re.escape(path.name)}\.{TMP_MARK}[a-z0-9_]{{8}}{re.escape(TMP_SUFFIX)}")
    try:
        candidates = [p for p in path.parent.iterdir() if mine.fullmatch(p.name)]
    except OSError:                            # the folder cannot be read: mkstemp will say why
        return
    for p in candidates:
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue                       # its writer lives
            with contextlib.suppress(OSError):
                os.unlink(p)
        finally:
            os.close(fd)


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
        fd = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666 & ~UMASK)
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
    """Append one line and fsync: a crash loses at most the line being written; a full disk
    is an OSError naming ``path`` (a write's own error names no file)."""
    fd = open_own(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        with os.fdopen(fd, "ab") as f:
            f.write((line.rstrip("\n") + "\n").encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


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
    """The entries under ``folder`` (relative names) that tbp did not write there: tbp writes
    plain files at the top of its folders only, so a file is tbp's when it sits there and its
    name matches one of ``patterns`` (fnmatch, one path component: a ``*`` never crosses a
    "/"); any folder, and anything inside one, is not -- a user's ``.notes.tmp/`` included."""
    folder = Path(folder)
    return [str(p.relative_to(folder)) for p in folder.rglob("*")
            if p.parent != folder or p.is_dir() or not any(fnmatch.fnmatchcase(p.name, pat) for pat in patterns)]


def sweep_temporaries(folder: Path) -> None:
    """Remove the temporary files a killed writer left behind (.NAME.XXXX.tmp)."""
    for p in Path(folder).glob(f".*{TMP_SUFFIX}"):
        with contextlib.suppress(OSError):
            p.unlink()


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
