"""The prepare pipeline every dataset kind shares: read a file, claim the output folder,
check the split, name the folder, write the arrays, the tokenizer and meta.json as one.

A dataset kind (text: datasets.py and texts.py; pairs: pairs.py; chat: chat.py) is a
:class:`Kind`: how it prepares, which files it adds, how it checks its meta and loads a split.
``data.Dataset.load`` asks the kind named in meta.json (data.KINDS); no kind imports another,
and this module imports none of them.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import TbpError
from ..files.atomic import atomic_write_json, atomic_write_text, claim_output, write_raw
from ..files.jsonio import strip_bom
from ..files.staging import staged_dir
from .tokenizer import Tokenizer
from ..version import __version__


# --- reading a file of examples -------------------------------------------------------------
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


# --- the pipeline ----------------------------------------------------------------------------
DEFAULT_BPE_VOCAB = 1024
DATASET_FILES = ("meta.json", "tokenizer.json", "train.bin", "val.bin",     # what --force may replace
                 "train.idx", "val.idx", "train.mask", "val.mask", ".owner")


class PrepareReport:
    """What a front end may observe while text becomes a dataset; every method is optional.
    A text corpus is read in passes, each a ``phase`` over its input bytes; pairs and chats
    ``start`` one over their characters. ``advance`` counts the same unit."""

    def start(self, name: str, characters: int) -> None: ...
    def phase(self, what: str, total_bytes: int) -> None: ...
    def advance(self, amount: int) -> None: ...
    def done(self, meta: dict) -> None: ...


def default_out(name: str) -> Path:
    return Path("data") / name


def dataset_name(name: str, tokenizer_kind: str = "char", vocab_size: int | None = None,
                 tokenizer: Tokenizer | None = None) -> str:
    """The folder name a corpus called ``name`` is prepared under: the name itself for a char
    tokenizer, ``name-bpeN`` for BPE, ``name-tokXXXXXXXX`` when encoded with a given tokenizer."""
    if tokenizer is not None:
        return f"{name}-tok{tokenizer.sha256()[:8]}"
    return name if tokenizer_kind == "char" else f"{name}-bpe{vocab_size or DEFAULT_BPE_VOCAB}"


@dataclass(frozen=True)
class Kind:
    """A dataset kind. ``files``: the arrays it adds beside tokenizer.json, train.bin, val.bin;
    ``check_meta(meta, where)``: refuse a meta.json it cannot read; ``load_split(path, split,
    tokens, meta)``: a split from its flat token array (text: the array itself)."""
    name: str
    files: tuple[str, ...] = ()
    check_meta: Callable | None = None
    load_split: Callable | None = None


def claim(out: Path, force: bool, inputs: tuple, val_fraction: float) -> None:
    """The first step of every prepare: ``out`` is new, or a dataset ``--force`` may replace
    (never one of the ``inputs``); the validation split is a proper fraction."""
    claim_output(out, force, DATASET_FILES, "meta.json", "a tbp dataset", inputs=inputs)
    if not 0 < val_fraction < 1:        # every trainer evaluates: a dataset without val is of no use
        raise TbpError(f"--val-fraction must be in (0, 1), got {val_fraction}")


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


def versions() -> dict:
    """The versions a dataset was prepared with (meta.json's \"versions\")."""
    import tokenizers
    return {"tbp": __version__, "tokenizers": tokenizers.__version__, "numpy": np.__version__,
            "python": sys.version.split()[0]}
