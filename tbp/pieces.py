"""Encoding a stream of text in pieces whose ids are those of the whole text encoded at once.

A byte-level BPE tokenizer (GPT-2's scheme) first splits text into pre-tokens with a regular
expression, then merges within each pre-token; so text may be cut only where that expression
always splits, whatever comes before or after. Two places are such *safe cuts*:

- just after a newline that stands between two letters or digits (``x\\ny``): the newline is a
  pre-token of its own (``\\s+`` cannot join it to ``y``, and `` ?\\p{L}+`` takes a space, not
  a newline), and ``x``'s run ends at it;
- just before a space that stands between two letters (``ab cd``): ``ab`` ends there and the
  space starts `` cd``.

A whitespace run holding a newline is not safe (``" \\n "`` is one pre-token or two depending
on what follows). A char tokenizer has no pre-tokenizer: every character boundary is safe, and
its ids are a table lookup of code points (:class:`CharCodes`), a hundred times faster than the
library's per-token records.

Where a stretch of :data:`SEAM_CHARS` holds no safe cut (a megabyte of letters without a space
or a line break), it is cut at a character boundary anyway, so that memory stays bounded; such
*seams* are counted (meta.json's ``seams``): the tokens next to one may differ from those of
encoding the whole text at once. Natural text has none.
"""
from __future__ import annotations

import re
from typing import Callable

import numpy as np

from .tokenizer import Tokenizer

PIECE_CHARS = 1 << 17          # characters per piece given to the library
BATCH_PIECES = 8               # pieces per library call: its threads take them in parallel
SEAM_CHARS = 1 << 21           # the longest piece: past it without a safe cut, a seam
_BREAKS = re.compile("[\n ]")


def _safe_at(text: str, p: int) -> bool:
    """Whether position p (0 < p < len) is a safe cut."""
    a, b = text[p - 1], text[p]
    if a == "\n":
        return p >= 2 and text[p - 2].isalnum() and b.isalnum()
    return b == " " and p + 1 < len(text) and a.isalpha() and text[p + 1].isalpha()


def first_safe_cut(text: str, lo: int, hi: int) -> int:
    """The first safe cut p with lo <= p < hi, or -1."""
    for m in _BREAKS.finditer(text, max(lo - 1, 0), hi):
        p = m.start() + 1 if m.group() == "\n" else m.start()
        if lo <= p < len(text) and p > 0 and _safe_at(text, p):
            return p
    return -1


def safe_cut(text: str, lo: int, hi: int) -> int:
    """The last safe cut p with lo < p <= hi (see the module docstring), or -1 if there is none."""
    p = hi
    while True:                                     # just after "\n" between two alphanumerics
        nl = text.rfind("\n", lo + 1, p)
        if nl < 0:
            break
        if nl + 1 < len(text) and text[nl - 1].isalnum() and text[nl + 1].isalnum():
            return nl + 1
        p = nl
    p = hi
    while True:                                     # just before " " between two letters
        sp = text.rfind(" ", lo + 1, p)
        if sp < 0:
            return -1
        if sp + 1 < len(text) and text[sp - 1].isalpha() and text[sp + 1].isalpha():
            return sp
        p = sp


class CharCodes:
    """A char tokenizer's ids as a lookup table over code points: id = table[ord(c)]."""

    def __init__(self, tok: Tokenizer):
        singles = {t: i for t, i in tok.hf.get_vocab().items() if len(t) == 1}
        # one entry past the largest code point: -1, where every code point beyond it is looked up
        self.table = np.full(max(map(ord, singles), default=0) + 2, -1, dtype=np.int64)
        for t, i in singles.items():
            self.table[ord(t)] = i

    def ids(self, text: str, tok: Tokenizer, where: str) -> np.ndarray | None:
        """The ids of ``text``, or None after ``tok.check`` has raised naming what it lacks."""
        try:
            codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        except UnicodeEncodeError:                  # a lone surrogate: the tokenizer names it
            tok.check(text, where)
            raise
        out = self.table[np.minimum(codes, self.table.size - 1)]
        if out.size and out.min() < 0:
            tok.check(text, where)                  # raises, naming every missing character
        return out


class PieceEncoder:
    """Feed text in any blocks; ``write`` receives the ids, in order, as arrays of ``dtype``.
    The ids equal ``tok.encode(whole text)`` (but at counted seams, see the module docstring)."""

    def __init__(self, tok: Tokenizer, dtype, write: Callable[[np.ndarray], None], where: str = "text"):
        self.tok, self.dtype, self.write, self.where = tok, np.dtype(dtype), write, where
        self.codes = CharCodes(tok) if tok.kind == "char" else None
        self.pending = ""
        self.tokens = self.seams = 0

    def feed(self, text: str) -> None:
        if self.codes is not None:                  # every boundary is safe
            self._emit(self.codes.ids(text, self.tok, self.where))
            return
        self.pending += text
        if len(self.pending) >= PIECE_CHARS * BATCH_PIECES:
            self._encode(self._pieces())

    def finish(self) -> None:
        if self.pending:
            self._encode([self.pending])
            self.pending = ""

    def _pieces(self) -> list[str]:
        """Whole pieces off the front of ``pending`` (the rest waits for more text)."""
        out, start, text = [], 0, self.pending
        while len(text) - start >= PIECE_CHARS:
            cut = safe_cut(text, start, min(start + PIECE_CHARS, len(text) - 1))
            if cut < 0:                             # a long stretch: the first safe cut past it
                cut = first_safe_cut(text, start + PIECE_CHARS, min(start + SEAM_CHARS, len(text) - 1))
            if cut < 0:
                if len(text) - start <= SEAM_CHARS:
                    break                           # wait: the next block may bring a safe cut
                cut, self.seams = start + SEAM_CHARS, self.seams + 1
            out.append(text[start:cut])
            start = cut
        self.pending = text[start:]
        return out

    def _encode(self, pieces: list[str]) -> None:
        if not pieces:
            return
        for p in pieces:
            self.tok.check(p, self.where)
        fast = getattr(self.tok.hf, "encode_batch_fast", self.tok.hf.encode_batch)     # no offsets
        for e in fast(pieces):
            self._emit(np.asarray(e.ids, dtype=np.int64))

    def _emit(self, ids: np.ndarray) -> None:
        if ids.size:
            self.write(ids.astype(self.dtype))
            self.tokens += ids.size


def encode_all(tok: Tokenizer, text: str, dtype=np.int64, where: str = "text") -> np.ndarray:
    """``text``'s ids through a PieceEncoder, in memory (tests, small inputs)."""
    parts: list[np.ndarray] = []
    enc = PieceEncoder(tok, dtype, parts.append, where)
    enc.feed(text)
    enc.finish()
    return np.concatenate(parts) if parts else np.zeros(0, dtype)
