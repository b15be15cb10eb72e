"""Text -> token files, and the batch sampler that reads them.

A prepared dataset is a folder (``data/<name>/``)::

    tokenizer.json  train.bin  val.bin  meta.json

``train.bin``/``val.bin`` are flat arrays of token ids (uint16 when the vocabulary fits,
uint32 otherwise), read back through ``np.memmap`` so a corpus larger than memory trains
just the same. The validation split is the *last* fraction of the text, cut at a line
boundary; decoding train then val gives back exactly the source text.
"""
from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from . import __version__
from .errors import TbpError
from . import schema
from .jsonio import strip_bom
from .fsutil import atomic_write_json, atomic_write_text, claim_output, staged_dir, write_raw
from .tokenizer import KINDS, Tokenizer, token_dtype, train_bpe, train_char

TEXT_SUFFIXES = {".txt", ".text", ".md", ".rst", ".tex", ".org", ".py", ".c", ".h", ".js", ".html",
                 ".csv", ".json", ".xml", ".yaml", ".yml", ".toml", ".ini", ".cfg"}
BUILTIN = "pydoc"
CHUNK_CHARS = 1 << 20          # encode in ~1 MB batches of whole lines
META_VERSION = 1


# --- reading text ---------------------------------------------------------------------------
def builtin_corpus() -> str:
    """The Python reference documentation that ships inside CPython (~460 KB of English)."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k].strip("\n") + "\n" for k in sorted(topics))


def _decode(raw: bytes, where: str, encoding: str) -> str:
    try:
        return strip_bom(raw.decode(encoding))        # a byte-order mark is not a character of the text
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise TbpError(f"{where}: byte 0x{raw[e.start]:02x} at offset {e.start} (line {line}) is not "
                       f"valid {encoding}; pass --encoding (for example latin-1) if the file uses another")
    except LookupError:
        raise TbpError(f"unknown --encoding {encoding!r}") from None


def read_file(path: str, encoding: str = "utf-8", what: str = "file") -> tuple[str, str, str]:
    """(text, where, name) of one file, or of stdin for '-': examples (pairs, conversations)
    come one file at a time. ``what`` names it in the error for a folder."""
    if path == "-":
        return _decode(sys.stdin.buffer.read(), "stdin", encoding), "stdin", "stdin"
    p = Path(path)
    if not p.is_file():
        raise TbpError(f"{p}: {f'a folder; give one {what}' if p.is_dir() else 'no such file'}")
    return _decode(p.read_bytes(), str(p), encoding), str(p), p.stem


def read_corpus(path: str | None, encoding: str = "utf-8") -> tuple[str, str, str]:
    """(text, name, source) for a file, a folder of text files, '-' (stdin) or None (built-in)."""
    if path is None:
        return builtin_corpus(), BUILTIN, "builtin:pydoc_data.topics"
    if path == "-":
        return _decode(sys.stdin.buffer.read(), "stdin", encoding), "stdin", "stdin"
    p = Path(path)
    if not p.exists():
        raise TbpError(f"{p}: no such file or directory")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES
                       and not any(part.startswith(".") for part in f.relative_to(p).parts))
        if not files:
            raise TbpError(f"{p}: folder has no text files ({', '.join(sorted(TEXT_SUFFIXES)[:6])}, ...)")
        parts = []
        for f in files:
            t = _decode(f.read_bytes(), str(f), encoding)
            parts.append(t if t.endswith("\n") or not t else t + "\n")
        return "".join(parts), p.resolve().name, str(p)
    return _decode(p.read_bytes(), str(p), encoding), p.stem, str(p)


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    """Cut the last ``val_fraction`` of the text off as validation, just after a newline."""
    if val_fraction == 0:
        return text, ""
    cut = int(len(text) * (1 - val_fraction))
    nl = text.rfind("\n", 0, cut)
    if nl >= 0 and nl + 1 < len(text):
        cut = nl + 1
    return text[:cut], text[cut:]


def _chunks(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """Whole-line pieces of about ``size`` characters (a line longer than that is one piece)."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", min(start + size, len(text)) - 1)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end
    return out


def encode(tok: Tokenizer, text: str, progress: Callable[[int], None] | None = None) -> np.ndarray:
    """Token ids of ``text`` as one flat int64 array, encoded in batches of whole lines."""
    pieces = []
    chunks = _chunks(text)
    for i in range(0, len(chunks), 8):
        batch = chunks[i:i + 8]
        pieces += tok.encode_batch(batch)
        if progress:
            progress(sum(len(c) for c in batch))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


# --- preparing ------------------------------------------------------------------------------
DEFAULT_BPE_VOCAB = 1024
DATASET_FILES = ("meta.json", "tokenizer.json", "train.bin", "val.bin",     # what --force may replace
                 "train.idx", "val.idx", "train.mask", "val.mask", ".owner")


class PrepareReport:
    """What a front end may observe while text becomes a dataset; every method is optional."""

    def start(self, name: str, characters: int) -> None: ...
    def advance(self, characters: int) -> None: ...      # this many more characters encoded
    def done(self, meta: dict) -> None: ...


def default_out(name: str) -> Path:
    return Path("data") / name


def dataset_name(name: str, kind: str = "char", vocab_size: int | None = None,
                 tokenizer: Tokenizer | None = None) -> str:
    """The folder name a corpus called ``name`` is prepared under: the name itself for a char
    tokenizer, ``name-bpeN`` for BPE, ``name-tokXXXXXXXX`` when encoded with a given tokenizer."""
    if tokenizer is not None:
        return f"{name}-tok{tokenizer.sha256()[:8]}"
    return name if kind == "char" else f"{name}-bpe{vocab_size or DEFAULT_BPE_VOCAB}"


def prepare_corpus(path: str | None, out: str | Path | None = None, kind: str = "char",
                   vocab_size: int | None = None, val_fraction: float = 0.1, force: bool = False,
                   encoding: str = "utf-8", report: PrepareReport | None = None) -> dict:
    """Read a corpus (file, folder, '-' or None for the built-in one) and prepare it into
    ``out`` (default data/<dataset_name>); returns the meta dict, with its "path"."""
    text, name, source = read_corpus(path, encoding)
    out = Path(out) if out else default_out(dataset_name(name, kind, vocab_size))
    return prepare(text, name, source, out, kind, vocab_size, val_fraction, force, report=report)


def prepare(text: str, name: str, source: str, out: str | Path, kind: str = "char",
            vocab_size: int | None = None, val_fraction: float = 0.1, force: bool = False,
            tokenizer: Tokenizer | None = None, report: PrepareReport | None = None) -> dict:
    """Train (or reuse) a tokenizer, encode both splits, write the dataset folder atomically.

    Returns the dataset's meta dict (with its "path"). ``tokenizer`` reuses an existing
    tokenizer (a checkpoint's when resuming or fine-tuning) instead of training one.
    """
    report = report or PrepareReport()
    out = Path(out)
    claim_output(out, force, DATASET_FILES, "meta.json", "a tbp dataset",
                 inputs=(source,) if Path(source).exists() else ())
    if kind not in KINDS:
        raise TbpError(f"unknown tokenizer {kind!r}; choose from {', '.join(KINDS)}")
    if not text.strip():
        raise TbpError(f"{source}: corpus is empty")
    if not 0 < val_fraction < 1:        # every trainer evaluates: a dataset without val is of no use
        raise TbpError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    t0 = time.perf_counter()
    train_text, val_text = split_text(text, val_fraction)
    if tokenizer is None:
        if kind == "char":
            tokenizer = train_char(text)
            if vocab_size is not None and vocab_size < tokenizer.vocab_size:
                raise TbpError(f"--vocab-size {vocab_size} is below the corpus alphabet: "
                               f"it has {tokenizer.vocab_size} distinct characters")
        else:
            tokenizer = train_bpe(_chunks(train_text or text), vocab_size or DEFAULT_BPE_VOCAB)
    else:
        tokenizer.check(text, source)
    dtype = token_dtype(tokenizer.vocab_size)
    report.start(name, len(text))
    train_ids = encode(tokenizer, train_text, report.advance).astype(dtype)
    val_ids = encode(tokenizer, val_text, report.advance).astype(dtype)
    raw_bytes = len(text.encode("utf-8"))
    meta = {
        "format": META_VERSION,
        "tokenizer": tokenizer.kind,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "dtype": dtype.name,
        "train_tokens": int(train_ids.size),
        "val_tokens": int(val_ids.size),
        "train_bytes": len(train_text.encode("utf-8")),
        "val_bytes": len(val_text.encode("utf-8")),
        "characters": len(text),
        "bytes_per_token": raw_bytes / max(1, train_ids.size + val_ids.size),
        "val_fraction": val_fraction,
        "source": source,
        "source_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "tokenizer_sha256": tokenizer.sha256(),
        "name": name,
        "versions": _versions(),
        "seconds": 0.0,
    }
    return write_dataset(out, force, tokenizer, {"train.bin": train_ids, "val.bin": val_ids}, meta, t0, report)


def write_dataset(out: Path, force: bool, tokenizer: Tokenizer, arrays: dict[str, np.ndarray], meta: dict,
                  t0: float, report: PrepareReport) -> dict:
    """Write a dataset folder as one: the tokenizer, each array raw under its file name, and
    meta.json (with the seconds since ``t0``) go into a temporary sibling renamed into place.
    Returns ``meta`` with the folder's "path"; text, pairs and chat datasets all end here."""
    with staged_dir(out, force) as tmp:
        atomic_write_text(tmp / "tokenizer.json", tokenizer.to_str())
        for name, a in arrays.items():
            write_raw(tmp / name, a)
        meta["seconds"] = round(time.perf_counter() - t0, 3)
        atomic_write_json(tmp / "meta.json", meta)
    meta["path"] = str(out)
    report.done(meta)
    return meta


def row_starts(totals: np.ndarray, size: int, where: Path, split: str, what: str) -> np.ndarray:
    """Each row's first token in a split of ``size`` tokens, from the rows' lengths (each in
    0 .. size, checked by the caller), which must add up to ``size``. The running sum is
    checked at every row, so lengths crafted to wrap int64 around are caught before they do."""
    ends = np.cumsum(totals, dtype=np.int64)
    if ends.size == 0 and size == 0:
        return np.zeros(0, np.int64)
    if ends.size == 0 or (ends > size).any() or ends[-1] != size:
        raise TbpError(f"{where}: {what} lengths do not add up to the {size} tokens of {split}.bin; "
                       f"the file is damaged")
    return np.concatenate([[0], ends[:-1]]).astype(np.int64)


def _versions() -> dict:
    import tokenizers
    return {"tbp": __version__, "tokenizers": tokenizers.__version__, "numpy": np.__version__,
            "python": sys.version.split()[0]}


# --- loading --------------------------------------------------------------------------------
@dataclass
class Dataset:
    """A prepared folder: memmapped splits, the tokenizer and meta.json. A text dataset's
    splits are flat token arrays; a pairs dataset's are ``tbp.pairs.PairSplit`` objects."""
    path: Path
    meta: dict
    tokenizer: Tokenizer
    train: np.ndarray
    val: np.ndarray

    @property
    def kind(self) -> str:
        """"text", "pairs" or "chat"."""
        return self.meta.get("kind", "text")

    @property
    def bytes_per_loss_token(self) -> float:
        """Validation bytes per token the loss is on: every token of text; a pair's target
        tokens and its <|endoftext|>. Converts a loss in nats per token to bits per byte."""
        if self.kind != "text":
            return max(1, self.meta["val_target_bytes"]) / max(1, self.meta["val_target_tokens"])
        return self.meta["val_bytes"] / max(1, self.meta["val_tokens"])

    @classmethod
    def load(cls, path: str | Path) -> "Dataset":
        path = Path(path)
        if not path.is_dir():
            raise TbpError(f"{path}: not a prepared dataset folder (run tbp prepare)")
        where = path / "meta.json"
        if not where.is_file():
            raise TbpError(f"{path}: missing meta.json; prepare it again with tbp prepare --force")
        meta = schema.check(schema.read_json(where), schema.DATASET_META, str(where))
        kind = meta.get("kind", "text")
        if kind not in ("text", "pairs", "chat"):
            raise TbpError(f"{where}: kind {kind!r} is not one this tbp reads (text, pairs, chat)")
        extra = {"text": (), "pairs": ("train.idx", "val.idx"),
                 "chat": ("train.idx", "val.idx", "train.mask", "val.mask")}[kind]
        for f in ("tokenizer.json", "train.bin", "val.bin") + extra:
            if not (path / f).is_file():
                raise TbpError(f"{path}: missing {f}; prepare it again with tbp prepare --force")
        if meta["dtype"] not in ("uint16", "uint32"):
            raise TbpError(f"{where}: dtype {meta['dtype']!r} is not a token dtype (uint16 or uint32)")
        dtype = np.dtype(meta["dtype"])
        tok = Tokenizer.load(path / "tokenizer.json")
        if tok.vocab_size != meta["vocab_size"]:
            raise TbpError(f"{path}: tokenizer has {tok.vocab_size} tokens, meta.json says {meta['vocab_size']}")
        splits = [_read_tokens(path / f"{split}.bin", dtype, meta[f"{split}_tokens"], tok.vocab_size)
                  for split in ("train", "val")]
        if kind != "text":
            from . import chat, pairs
            rows = pairs if kind == "pairs" else chat
            rows.check_meta(meta, str(where))
            splits = [rows.load_split(path, split, ids, meta) for split, ids in zip(("train", "val"), splits)]
        return cls(path, meta, tok, *splits)


def _read_tokens(f: Path, dtype: np.dtype, count: int, vocab_size: int) -> np.ndarray:
    """A split's token ids, memory-mapped, after checking its size and that every id is in the
    vocabulary (a scan in chunks: a bad id is named here, not at a random training step)."""
    size = f.stat().st_size
    if size % dtype.itemsize:
        raise TbpError(f"{f}: {size} bytes is not a whole number of {dtype.name} token ids; the file is damaged")
    n = size // dtype.itemsize
    if n != count:
        raise TbpError(f"{f}: holds {n} tokens, meta.json says {count}")
    if not n:
        return np.zeros(0, dtype)
    ids = np.memmap(f, dtype=dtype, mode="r")
    step = 1 << 24
    for start in range(0, n, step):
        chunk = ids[start:start + step]
        if int(chunk.max()) >= vocab_size:
            at = start + int(np.argmax(chunk >= vocab_size))
            raise TbpError(f"{f}: token id {int(ids[at])} at position {at} is outside the vocabulary "
                           f"({vocab_size}); the file is damaged or belongs to another tokenizer")
    return ids


def get_batch(data: np.ndarray, batch_size: int, n_ctx: int,
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """B random windows: x (B, T) and y (B, T) with y[:, t] == x[:, t + 1], int64.

    Starts are drawn from ``rng`` only, so the same generator state gives the same batch.
    """
    if data.size < n_ctx + 1:
        raise TbpError(f"split has {data.size} tokens, fewer than one block of {n_ctx} + 1")
    starts = rng.integers(0, data.size - n_ctx, batch_size)                     # (B,)
    rows = starts[:, None] + np.arange(n_ctx + 1)[None, :]                      # (B, T + 1)
    window = np.asarray(data[rows], dtype=np.int64)
    return window[:, :-1], window[:, 1:]
