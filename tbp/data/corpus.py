"""Corpora as streams of text: read in blocks, never whole, in the formats corpora come in.

A :class:`Corpus` yields its text as a sequence of blocks (``str``, a few MiB each) and can be
read again from the start (preparing a dataset reads it two or three times: to count, to
sample a tokenizer's training text, to encode). Blocks never split a character: bytes are
decoded with an incremental decoder, which holds a character's first bytes back until the
rest arrive.

What it reads (by name, or by what ``--data`` points at):

- a text file, or a folder of them (sorted, hidden ones skipped; each file's text ends with a
  newline, one is added where it does not), or ``-`` for stdin;
- any of these compressed: ``.gz``, ``.bz2``, ``.xz``/``.lzma`` (the standard library), ``.zst``
  (the ``zstd`` extra, ``zstandard``);
- JSON lines (``.jsonl``, ``.ndjson``, compressed or not): one document per line, its text in
  the field ``text_field`` (default "text"), each document ending with a newline as files do;
- Parquet (``.parquet``, the ``parquet`` extra, ``pyarrow``): the column ``text_field``, one
  document per row.

A leading byte-order mark of each file is dropped. A malformed record is one TbpError naming
the file and line (or row); nothing is written before a corpus has been read through once.
"""
from __future__ import annotations

import codecs
import glob
import hashlib
import os
import socket
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from ..files import jsonio
from .compressed import layers, open_raw
from ..errors import TbpError
from .tokenizer import check_unicode

TEXT_SUFFIXES = {".txt", ".text", ".md", ".rst", ".tex", ".org", ".py", ".c", ".h", ".js", ".html",
                 ".csv", ".json", ".xml", ".yaml", ".yml", ".toml", ".ini", ".cfg"}
RECORD_SUFFIXES = {".jsonl", ".ndjson"}
PARQUET_SUFFIXES = {".parquet"}
READ_BYTES = 4 << 20                  # raw bytes read at a time
MAX_RECORD = 64 << 20                 # characters of one JSON-lines record (parsing one costs ~10x that)
BUILTIN = "pydoc"


def builtin_text() -> str:
    """The Python reference documentation that ships inside CPython (~460 KB of English)."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k].strip("\n") + "\n" for k in sorted(topics))


@dataclass
class Source:
    """One file (or stdin, or text in memory) of a corpus, read as text blocks."""
    path: Path | None                 # None: ``text`` (the built-in corpus, text given in memory)
    format: str = "text"              # "text", "records" (JSON lines) or "parquet"
    compression: str | None = None
    text: str | None = None
    ends_with_newline: bool = False   # a folder's files (and every record) end with a newline
    label: str | None = None          # how errors name it (stdin's copy: "stdin")

    @property
    def where(self) -> str:
        return self.label or (str(self.path) if self.path is not None else "text")

    def size(self) -> int:
        if self.path is None:
            return len(self.text)                    # characters: progress only
        return self.path.stat().st_size

    def blocks(self, encoding: str, text_field: str, progress: Callable[[int], None]) -> Iterator[str]:
        if self.path is None:
            for i in range(0, len(self.text), READ_BYTES):
                yield self.text[i:i + READ_BYTES]
            progress(self.size())
            return
        if self.format == "parquet":
            yield from self._parquet(text_field, progress)
            return
        lines = self._lines if self.format == "records" else None
        text = self._decoded(encoding, progress)
        yield from (lines(text, text_field) if lines else self._ended(text))

    def _decoded(self, encoding: str, progress) -> Iterator[str]:
        """The file's text in blocks, its byte-order mark dropped; an undecodable byte named."""
        stream, raw = open_raw(self.path, self.compression)
        decoder = codecs.getincrementaldecoder(encoding)()
        offset = lines = 0
        first, reported = True, 0
        with stream, raw:
            while True:
                try:
                    data = stream.read(READ_BYTES)
                except Exception as e:       # OSError, EOFError, lzma.LZMAError, zstandard.ZstdError
                    raise TbpError(f"{self.where}: damaged {self.compression} data ({e})") from None
                held = len(decoder.getstate()[0])
                try:
                    text = decoder.decode(data, final=not data)
                except UnicodeDecodeError as e:
                    at = offset - held + e.start
                    line = lines + e.object[:e.start].count(b"\n") + 1
                    raise TbpError(f"{self.where}: byte 0x{e.object[e.start]:02x} at offset {at} (line {line}) "
                                   f"is not valid {encoding}; pass --encoding (for example latin-1) if the "
                                   f"file uses another") from None
                offset += len(data)
                lines += data.count(b"\n")
                now = raw.tell()
                progress(now - reported)
                reported = now
                if first and text:
                    text, first = jsonio.strip_bom(text), False
                if text:
                    yield text
                if not data:
                    return

    def _ended(self, blocks: Iterator[str]) -> Iterator[str]:
        last = ""
        for b in blocks:
            last = b
            yield b
        if self.ends_with_newline and last and not last.endswith("\n"):
            yield "\n"

    def _lines(self, blocks: Iterator[str], text_field: str) -> Iterator[str]:
        """JSON lines: each record's text field, ending with a newline. A record is parsed whole,
        and parsing costs many times its size in memory, so one longer than MAX_RECORD characters
        is refused, named by its line, before it is held (a small compressed file can hold one)."""
        parts, n, held = [], 0, 0
        for b in blocks:
            if "\n" not in b:                      # inside one long record: no re-splitting
                parts.append(b)
                held += len(b)
                if held > MAX_RECORD:
                    raise TbpError(f"{self.where}:{n + 1}: a record longer than {MAX_RECORD >> 20} Mi characters; "
                                   f"split its text into several records")
                continue
            first, *whole = b.split("\n")
            if held + len(first) > MAX_RECORD:
                raise TbpError(f"{self.where}:{n + 1}: a record longer than {MAX_RECORD >> 20} Mi characters; "
                               f"split its text into several records")
            whole[:0] = ["".join(parts) + first]
            parts = [whole.pop()]
            held = len(parts[0])
            for k, line in enumerate(whole):       # a whole record inside one block: the same limit
                if len(line) > MAX_RECORD:
                    raise TbpError(f"{self.where}:{n + k + 1}: a record longer than {MAX_RECORD >> 20} Mi "
                                   f"characters; split its text into several records")
            out = []
            for line in whole:
                n += 1
                out.append(self._record(line, n, text_field))
            if out:
                yield "".join(out)
        if "".join(parts):
            yield self._record("".join(parts), n + 1, text_field)

    def _record(self, line: str, n: int, text_field: str) -> str:
        line = line[:-1] if line.endswith("\r") else line
        if not line.strip():
            return ""
        obj = jsonio.parse(line, f"{self.where}:{n}")
        value = obj.get(text_field) if isinstance(obj, dict) else None
        if not isinstance(value, str):
            raise TbpError(f"{self.where}:{n}: expected a JSON object with a string {text_field!r} field "
                           f"(pass --text-field NAME for another)")
        return value if value.endswith("\n") or not value else value + "\n"

    def _parquet(self, text_field: str, progress) -> Iterator[str]:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise TbpError(f"{self.path}: reading Parquet needs pyarrow: pip install 'tbp[parquet]'") from None
        try:
            f = pq.ParquetFile(self.path)
        except Exception as e:                       # pyarrow's own error types
            raise TbpError(f"{self.path}: not a Parquet file ({' '.join(str(e).split())[:100]})") from None
        if text_field not in f.schema_arrow.names:
            raise TbpError(f"{self.path}: no column {text_field!r} (it has {', '.join(f.schema_arrow.names[:6])}); "
                           f"pass --text-field NAME")
        row, per_row = 0, self.size() / max(1, f.metadata.num_rows)
        batches = f.iter_batches(batch_size=4096, columns=[text_field])
        while True:
            try:
                batch = next(batches, None)
                values = batch.column(0).to_pylist() if batch is not None else None
            except Exception as e:                   # pyarrow's errors, bad UTF-8 in a string column
                raise TbpError(f"{self.where}: damaged Parquet after row {row} "
                               f"({' '.join(str(e).split())[:100]})") from None
            if values is None:
                return
            out = []
            for value in values:
                row += 1
                if not isinstance(value, str):
                    raise TbpError(f"{self.where}: row {row}: {text_field!r} is not a string ({value!r:.40})")
                check_unicode(value, f"{self.where}: row {row}")
                out.append(value if value.endswith("\n") or not value else value + "\n")
            progress(int(per_row * len(out)))
            yield "".join(out)


@dataclass
class Corpus:
    """The text of one or more sources, in order. ``name`` names the dataset folder;
    ``source`` is what meta.json records."""
    name: str
    source: str
    sources: list[Source]
    encoding: str = "utf-8"
    text_field: str = "text"
    spool: Path | None = field(default=None, repr=False)      # stdin's copy, removed by close()

    def size(self) -> int:
        """Input bytes (compressed bytes for compressed files): what progress counts."""
        return sum(s.size() for s in self.sources)

    def fingerprint(self) -> list:
        """Each file's size and modification time: a corpus that changes between two reads of
        it shows here."""
        out = []
        for s in self.sources:
            if s.path is not None:
                st = s.path.stat()
                out.append((str(s.path), st.st_size, st.st_mtime_ns))
        return out

    def blocks(self, progress: Callable[[int], None] = lambda n: None) -> Iterator[str]:
        for s in self.sources:
            yield from s.blocks(self.encoding, self.text_field, progress)

    def text(self) -> str:
        """All of it in memory (small corpora, tests)."""
        return "".join(self.blocks())

    def sha256(self) -> str:
        """SHA-256 of the text as UTF-8: what meta.json records as source_sha256."""
        h = hashlib.sha256()
        for b in self.blocks():
            h.update(b.encode("utf-8"))
        return h.hexdigest()

    def close(self) -> None:
        if self.spool is not None:
            self.spool.unlink(missing_ok=True)
            self.spool = None

    def __enter__(self) -> "Corpus":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def in_memory(text: str, name: str, source: str) -> Corpus:
    return Corpus(name, source, [Source(None, text=text)])


def _source(path: Path, in_folder: bool) -> Source:
    compression, inner = layers(path)
    format = "records" if inner in RECORD_SUFFIXES else "parquet" if inner in PARQUET_SUFFIXES else "text"
    return Source(path, format, compression, ends_with_newline=in_folder)


def _readable(path: Path) -> bool:
    compression, inner = layers(path)
    return inner in TEXT_SUFFIXES | RECORD_SUFFIXES | PARQUET_SUFFIXES or (compression is not None and inner == "")


def open_corpus(path: str | None, encoding: str = "utf-8", text_field: str = "text",
                spool_dir: Path | None = None) -> Corpus:
    """The corpus at ``path``: a file, a folder, '-' (stdin, copied to a file in ``spool_dir``
    first, since preparing reads a corpus more than once) or None (the built-in one)."""
    if path is None:
        return in_memory(builtin_text(), BUILTIN, "builtin:pydoc_data.topics")
    if path == "-":
        return _spooled(sys.stdin.buffer, "stdin", encoding, text_field, Path(spool_dir or "."))
    p = Path(path)
    if not p.exists():
        raise TbpError(f"{p}: no such file or directory")
    mode = p.stat().st_mode
    if stat.S_ISFIFO(mode):                # a named pipe, or a shell's <(...): read once, like stdin
        try:
            stream = open(p, "rb")
        except OSError as e:
            raise TbpError(f"{p}: cannot be read ({e.strerror})") from None
        with stream:                       # errors writing the copy name the copy's folder
            return _spooled(stream, str(p), encoding, text_field, Path(spool_dir or "."))
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise TbpError(f"{p}: is a device or a socket, not a file of text (to read a stream, pipe it into "
                       f"--data -)")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and _readable(f)
                       and not any(part.startswith(".") for part in f.relative_to(p).parts))
        if not files:
            raise TbpError(f"{p}: folder has no text files ({', '.join(sorted(TEXT_SUFFIXES)[:6])}, ..., "
                           f".jsonl, .parquet, compressed with .gz .bz2 .xz .zst)")
        return Corpus(p.resolve().name, str(p), [_source(f, True) for f in files], encoding, text_field)
    compression, inner = layers(p)
    name = p.name
    for _ in p.suffixes[-2 if compression else -1:]:
        name = name.rsplit(".", 1)[0] if "." in name else name
    return Corpus(name or p.stem, str(p), [_source(p, False)], encoding, text_field)


def _spool_prefix() -> str:
    """.stdin.HOST-PID. : a copy names the machine and the process that made it (a data folder may
    be shared between machines, where another's process ids mean nothing here)."""
    host = "".join(c if c.isalnum() else "-" for c in socket.gethostname())[:40] or "host"
    return f".stdin.{host}-{os.getpid()}."


def sweep_spools(folder: Path) -> None:
    """Remove the stream copies (.stdin.HOST-PID.XXXX.tmp) of this machine's processes that are
    gone: what a writer killed with SIGKILL, or stopped by a full disk before its cleanup, left."""
    mine = _spool_prefix().rsplit("-", 1)[0] + "-"          # .stdin.HOST-
    for p in Path(folder).glob(f"{glob.escape(mine)}*.tmp"):
        pid = p.name[len(mine):].split(".", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            p.unlink(missing_ok=True)
        except (PermissionError, OverflowError):        # alive under another user; or not a pid
            continue


def _spooled(stream, label: str, encoding: str, text_field: str, spool_dir: Path) -> Corpus:
    """A stream (stdin, a pipe) copied to a file in ``spool_dir`` once, since preparing reads a
    corpus more than once; the copy is the Corpus's, removed by its close() (and on failure here)."""
    import tempfile
    spool_dir.mkdir(parents=True, exist_ok=True)
    sweep_spools(spool_dir)
    fd, name = tempfile.mkstemp(dir=spool_dir, prefix=_spool_prefix(), suffix=".tmp")
    try:
        with open(fd, "wb") as f:
            while True:
                data = stream.read(READ_BYTES)
                if not data:
                    break
                f.write(data)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    # a shell's <(...) is /dev/fd/63: a number is no name for a dataset; a named pipe keeps its name
    stem = "stdin" if label == "stdin" else "pipe" if label.startswith(("/dev/fd/", "/proc/")) else Path(label).name
    return Corpus(stem, label, [Source(Path(name), "text", label=label)], encoding, text_field, spool=Path(name))


