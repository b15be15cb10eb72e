"""Encoding a stream of text in pieces whose ids are those of the whole text encoded at once.

A byte-level BPE tokenizer (GPT-2's scheme) first splits text into pre-tokens with a regular
expression, then merges within each pre-token; so text may be cut only where that expression
always splits, whatever comes before or after. Two places are such *safe cuts*:

- just after a newline that stands between two letters or digits (``x\\ny``): the newline is a
  pre-token of its own (``\\s+`` cannot join it to ``y``, and `` ?\\p{L}+`` takes a space, not
  a newline), and ``x``'s run ends at it;
- just before a space, tab or line break that follows a character that is not whitespace
  (``ab cd``, ``。\\n中``): no alternative of the expression takes whitespace after what it
  matched, and what follows is matched from there whatever came before.

A whitespace run holding a newline is not safe (``" \\n "`` is one pre-token or two depending
on what follows). A char tokenizer has no pre-tokenizer: every character boundary is safe, and
its ids are a table lookup of code points (:class:`CharCodes`), a hundred times faster than the
library's per-token records.

Where a stretch of :data:`SEAM_CHARS` holds no safe cut (a megabyte of letters without a space
or a line break), it is cut at a character boundary anyway, so that memory stays bounded; such
*seams* are counted (meta.json's ``seams``): the tokens next to one may differ from those of
encoding the whole text at once. Text with a space or a line break at least every 2 M
characters has none.
"""
from __future__ import annotations

import re
from typing import Callable

import numpy as np

from ..errors import TbpError
from .tokenizer import Tokenizer

PIECE_CHARS = 1 << 17          # characters per piece given to the library
BATCH_PIECES = 8               # pieces per library call: its threads take them in parallel
SEAM_CHARS = 1 << 21           # the longest piece: past it without a safe cut, a seam
_BREAKS = re.compile("[ \t\n\r]")


def _safe_at(text: str, p: int) -> bool:
    """Whether position p (0 < p < len) is a safe cut."""
    a, b = text[p - 1], text[p]
    if a == "\n":
        return p >= 2 and text[p - 2].isalnum() and b.isalnum()
    # whitespace after a character that is not: no alternative of the expression takes
    # whitespace after what it matched (str.isspace is wider than the regex's \s: the safe side)
    return b in " \t\n\r" and not a.isspace()


def _candidates(text: str, lo: int, hi: int):
    """Positions in [lo, hi] where a safe cut may be: at a space, tab or line break, or just
    after a newline; in increasing order."""
    for m in _BREAKS.finditer(text, max(lo - 1, 0), min(hi + 1, len(text))):
        p = m.start()
        for q in ((p, p + 1) if m.group() == "\n" else (p,)):
            if lo <= q <= hi and 0 < q < len(text):
                yield q


def first_safe_cut(text: str, lo: int, hi: int) -> int:
    """The first safe cut p with lo <= p <= hi, or -1."""
    return next((q for q in _candidates(text, lo, hi) if _safe_at(text, q)), -1)


def safe_cut(text: str, lo: int, hi: int) -> int:
    """The last safe cut p with lo < p <= hi (see the module docstring), or -1 if there is none."""
    p = hi
    while p > lo:                                   # back from hi, a window at a time
        start = max(lo + 1, p - 4096)
        last = max((q for q in _candidates(text, start, p) if _safe_at(text, q)), default=-1)
        if last > 0:
            return last
        p = start - 1
    return -1


def check_encodable(tok: Tokenizer) -> None:
    """TbpError unless ``tok`` is what the piece encoder's cuts assume: tbp's char tokenizer
    (one token per character: a BPE model with no merges, nothing before or after it) or a
    byte-level BPE with GPT-2's expression and no prefix space, no normalizer, no template."""
    import json
    d = json.loads(tok.to_str())
    pre, post, model = d.get("pre_tokenizer"), d.get("post_processor"), d.get("model") or {}
    if tok.kind == "char":
        ok = model.get("type") == "BPE" and not model.get("merges") and pre is None and post is None
    else:
        ok = (pre or {}).get("type") == "ByteLevel" and not pre.get("add_prefix_space") and \
            pre.get("use_regex", True) and (post is None or post.get("type") == "ByteLevel")
    if not ok or d.get("normalizer") is not None:
        raise TbpError("this tokenizer is not one tbp can encode a corpus with in pieces (tbp's char tokenizer, "
                       "or a byte-level BPE without prefix space, normalizer or template, as GPT-2's); "
                       "prepare the data with a tokenizer tbp trained")


UNKNOWN = ("refuse", "drop", "space")      # what a char tokenizer does with a character it lacks


class CharCodes:
    """A char tokenizer's ids as a lookup table over code points: id = table[ord(c)].
    ``unknown``: a character the tokenizer lacks is refused (``tok.check`` names them all), left
    out ("drop"), or encoded as a space ("space"); ``unknown_count`` counts them."""

    def __init__(self, tok: Tokenizer, unknown: str = "refuse"):
        singles = {t: i for t, i in tok.hf.get_vocab().items() if len(t) == 1}
        # one entry past the largest code point: -1, where every code point beyond it is looked up
        self.table = np.full(max(map(ord, singles), default=0) + 2, -1, dtype=np.int64)
        for t, i in singles.items():
            self.table[ord(t)] = i
        if unknown not in UNKNOWN:
            raise ValueError(f"unknown characters are refused, dropped or spaced, not {unknown!r}")
        if unknown == "space" and " " not in singles:
            raise TbpError("--unknown-chars space: this char tokenizer has no space to put in their place")
        self.unknown, self.space, self.unknown_count = unknown, singles.get(" ", -1), 0
        self.byte_change = 0                  # UTF-8 bytes the ids encode, less those of the text

    def ids(self, text: str, tok: Tokenizer, where: str) -> np.ndarray | None:
        """The ids of ``text``, or None after ``tok.check`` has raised naming what it lacks."""
        try:
            codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        except UnicodeEncodeError:                  # a lone surrogate: the tokenizer names it
            tok.check(text, where)
            raise
        out = self.table[np.minimum(codes, self.table.size - 1)]
        if out.size and out.min() < 0:
            if self.unknown == "refuse":
                tok.check(text, where)              # raises, naming every missing character
            lacking = out < 0
            n = int(np.count_nonzero(lacking))
            cp = codes[lacking]
            utf8 = n + int(np.count_nonzero(cp >= 0x80) + np.count_nonzero(cp >= 0x800) + np.count_nonzero(cp >= 0x10000))
            self.unknown_count += n
            self.byte_change += (n if self.unknown == "space" else 0) - utf8
            out = out[~lacking] if self.unknown == "drop" else np.where(lacking, self.space, out)
        return out


class PieceEncoder:
    """Feed text in any blocks; ``write`` receives the ids, in order, as arrays of ``dtype``.
    The ids equal ``tok.encode(whole text)`` (but at counted seams, see the module docstring)."""

    def __init__(self, tok: Tokenizer, dtype, write: Callable[[np.ndarray], None], where: str = "text",
                 unknown: str = "refuse"):
        self.tok, self.dtype, self.write, self.where = tok, np.dtype(dtype), write, where
        self.codes = CharCodes(tok, unknown) if tok.kind == "char" else None
        self.pending = ""
        self.tokens = self.seams = 0

    def feed(self, text: str) -> None:
        # a long text (one record of a JSON-lines file can be 64 Mi characters) is taken a
        # slice at a time: what the library and the lookups hold follows the slice, not the text
        step = PIECE_CHARS * BATCH_PIECES
        for i in range(0, len(text), step):
            part = text[i:i + step] if len(text) > step else text
            if self.codes is not None:              # every boundary is safe
                self._emit(self.codes.ids(part, self.tok, self.where))
                continue
            self.pending += part
            if len(self.pending) >= step:
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
