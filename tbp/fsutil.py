"""Atomic file output: a reader sees the old file or the new one, never half of either."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path


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
    """Temp file in the same directory, fsync, os.replace, fsync the directory."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
