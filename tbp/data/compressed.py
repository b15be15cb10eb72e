"""A file's bytes through its compression, named by its last suffix: gzip, bzip2 and xz by the
standard library, zstd by ``zstandard`` (the ``zstd`` extra). corpus.py reads every corpus file
through here."""
from __future__ import annotations

import bz2
import gzip
import lzma
from pathlib import Path

from ..errors import TbpError

COMPRESSED = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".lzma": "xz", ".zst": "zstd", ".zstd": "zstd"}


def layers(path: Path) -> tuple[str | None, str]:
    """(compression or None, the suffix of what is inside): a.jsonl.gz -> ("gzip", ".jsonl")."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSED:
        return COMPRESSED[suffixes[-1]], suffixes[-2] if len(suffixes) > 1 else ""
    return None, suffixes[-1] if suffixes else ""


def open_raw(path: Path, compression: str | None):
    """(binary stream of the file's contents, the underlying file: its tell() is the progress)."""
    raw = open(path, "rb")
    if compression is None:
        return raw, raw
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw), raw
    if compression == "bzip2":
        return bz2.BZ2File(raw), raw
    if compression == "xz":
        return lzma.LZMAFile(raw), raw
    try:
        import zstandard
    except ImportError:
        raw.close()
        raise TbpError(f"{path}: reading .zst needs zstandard: pip install 'tbp[zstd]'") from None
    return _Zstd(raw, zstandard, path), raw


class _Zstd:
    """A .zst file's bytes, frame after frame; a file that ends inside a frame is damage
    (the library's stream reader would end quietly there)."""

    def __init__(self, raw, zstandard, path):
        self.raw, self.zstd, self.path = raw, zstandard, path
        self.obj, self.started = zstandard.ZstdDecompressor().decompressobj(), False

    def read(self, n: int) -> bytes:
        while True:
            data = self.raw.read(n)
            if not data:
                if self.started and not self.obj.eof:
                    raise EOFError("the file ends inside a frame")
                return b""
            out = bytearray()
            while data:
                self.started = True
                out += self.obj.decompress(data)
                data = self.obj.unused_data if self.obj.eof else b""
                if self.obj.eof:
                    self.obj, self.started = self.zstd.ZstdDecompressor().decompressobj(), bool(data)
            if out:
                return bytes(out)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None
