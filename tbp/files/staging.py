"""A folder written whole: its files go into a hidden sibling, renamed into place only when
complete, so a reader sees the old folder or the new one, never a part; a writer killed
half-way leaves a staging folder the next writer of the same name sweeps (a live writer's, held
by its OWNER lock, is left alone)."""
from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path

from .atomic import UMASK, fsync_dir
from .locks import lock_state


OWNER = ".owner"                        # inside a staging folder: flocked while its writer lives


@contextlib.contextmanager
def _stops_held():
    """Hold SIGINT and SIGTERM until the block ends (then they arrive as usual): a stop that
    landed between making a folder and naming it would leave one that no sweep may touch."""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None:                             # not on Windows: no stop signals to hold there
        yield
        return
    before = mask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        mask(signal.SIG_SETMASK, before)


def _owned_dir(parent: Path, prefix: str, suffix: str) -> tuple[Path, int]:
    """A new hidden folder under ``parent`` holding a flocked OWNER file: (folder, descriptor).
    A folder that cannot be made there (read-only, full) is reported as ``parent``'s problem: the
    temporary name means nothing to the person reading the error."""
    with _stops_held():
        return _make_owned_dir(parent, prefix, suffix)


def _make_owned_dir(parent: Path, prefix: str, suffix: str) -> tuple[Path, int]:
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
    return lock_state(folder / OWNER) is False


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
        os.chmod(tmp, 0o777 & ~UMASK)
        fsync_dir(tmp)
        if out.exists():
            if not force:
                raise FileExistsError(f"{out} already exists (use --force to replace it)")
            old, old_owner = _owned_dir(out.parent, f".{out.name}.", ".old")
            os.replace(out, old / "x")
        os.replace(tmp, out)
        os.unlink(out / OWNER)                  # the lock stays on the open descriptor
        fsync_dir(out.parent)
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
