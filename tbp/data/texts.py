"""A text dataset from a corpus of any size, in bounded memory, in a few passes over it.

The corpus is a stream of text blocks (:mod:`tbp.data.corpus`), read again for each pass:

1. **read**: its characters N, the SHA-256 of its text (meta.json's ``source_sha256``), its
   UTF-8 bytes, and (char tokenizer) its alphabet;
2. **cut**: validation is the last ``val_fraction`` of the characters, from just after the last
   newline before character int(N (1 - f)) (the whole corpus if it has none there) -- the same
   cut :func:`tbp.data.datasets.split_text` makes in memory; the prefix up to that point is read again
   to find the newline;
3. **sample** (BPE only): the tokenizer trains on the training split's whole-line chunks of
   about 1 M characters, every k-th of them, k = ceil(training characters / ``sample``): all of
   a corpus up to the sample size, an evenly spread sample of a larger one;
4. **encode**: the training split, then the validation split, each through a
   :class:`tbp.data.pieces.PieceEncoder` (ids equal to encoding the split at once), straight into
   the staged ``train.bin`` and ``val.bin``.

Memory is bounded by the blocks and pieces in flight, whatever the corpus size. The output is
written into a staging folder renamed into place only when complete (:func:`staging.staged_dir`):
Ctrl-C, SIGTERM, a full disk or ``kill -9`` leave no dataset that could be trained on, and a
re-run starts clean -- a resume would have to prove the input unchanged, which is another full
read, and encoding is the cheap part of a corpus that takes minutes to read twice anyway.
"""
from __future__ import annotations

import hashlib
import math
import os
import time
from pathlib import Path

import numpy as np

from .corpus import Corpus
from ..errors import TbpError
from ..files.atomic import atomic_write_json, atomic_write_text
from .pieces import PieceEncoder, check_encodable
from ..files.staging import staged_dir
from .tokenizer import Tokenizer, check_unicode, token_dtype, train_bpe, train_char

CHUNK_CHARS = 1 << 20               # the tokenizer trainer's chunks: whole lines, about 1 M characters
DEFAULT_SAMPLE = 256 << 20          # characters a BPE tokenizer trains on at most (--tokenizer-sample)


READ_SLICE = 1 << 20             # characters the reading pass encodes and counts at once


def _read(corpus: Corpus, report, char: bool) -> dict:
    """Pass 1: characters, bytes, SHA-256, non-blank, alphabet (for a char tokenizer)."""
    h, n, nbytes, blank, seen = hashlib.sha256(), 0, 0, True, np.zeros(0, np.int64)
    report.phase("reading", corpus.size())
    for block in corpus.blocks(report.advance):
        check_unicode(block, corpus.source)         # text given in memory may hold a lone surrogate
        # a slice at a time: one block can be a whole JSON-lines record of 64 Mi characters, and
        # its encodings and counts would cost many times that
        for i in range(0, len(block), READ_SLICE):
            b = block[i:i + READ_SLICE] if len(block) > READ_SLICE else block
            raw = b.encode("utf-8")
            h.update(raw)
            n, nbytes = n + len(b), nbytes + len(raw)
            blank = blank and (not b or b.isspace())
            if char:                                # the code points present: a count per code point
                counts = np.bincount(np.frombuffer(b.encode("utf-32-le", "surrogatepass"), np.uint32))
                seen = np.pad(seen, (0, max(0, counts.size - seen.size)))
                seen[:counts.size] += counts
    alphabet = {chr(c) for c in np.flatnonzero(seen)}
    return {"characters": n, "bytes": nbytes, "sha256": h.hexdigest(), "blank": blank, "alphabet": alphabet,
            "counts": {chr(c): int(seen[c]) for c in np.flatnonzero(seen)}}


def lacking(counts: dict[str, int], tok: Tokenizer) -> dict[str, int]:
    """The characters of a corpus (with their counts) a char tokenizer has no token for, most
    frequent first."""
    vocab = tok.hf.get_vocab()
    return dict(sorted(((c, k) for c, k in counts.items() if c not in vocab), key=lambda ck: -ck[1]))


def lacking_message(source: str, missing: dict[str, int], tok: Tokenizer) -> str:
    shown = ", ".join(f"{c!r} (U+{ord(c):04X}) x{k:,}" for c, k in list(missing.items())[:12])
    more = f" and {len(missing) - 12} more" if len(missing) > 12 else ""
    return (f"{source}: {len(missing)} character(s), {sum(missing.values()):,} in all, are not in this char "
            f"tokenizer's vocabulary of {tok.vocab_size}: {shown}{more}. To encode the text anyway pass "
            f"--unknown-chars drop (leave them out) or --unknown-chars space (a space for each); or fine-tune a "
            f"BPE base, which encodes any text: tbp train --tokenizer bpe --out checkpoints/pydoc-bpe trains one "
            f"on the built-in corpus")


def _cut(corpus: Corpus, n: int, val_fraction: float, report) -> int:
    """Pass 2: where validation starts (split_text's rule, by streaming the prefix)."""
    c = int(n * (1 - val_fraction))
    start, last_nl = 0, -1
    report.phase("finding the validation split", corpus.size())
    for b in corpus.blocks(report.advance):
        end = start + len(b)
        nl = b.rfind("\n", 0, max(0, c - start))
        if nl >= 0:
            last_nl = start + nl
        if end >= c:
            break
        start = end
    return last_nl + 1 if last_nl >= 0 and last_nl + 1 < n else c


def _split_blocks(corpus: Corpus, cut: int, progress):
    """("train" | "val", text) blocks, the one holding the cut split in two."""
    start = 0
    for b in corpus.blocks(progress):
        end = start + len(b)
        if end <= cut:
            yield "train", b
        elif start >= cut:
            yield "val", b
        else:
            yield "train", b[:cut - start]
            yield "val", b[cut - start:]
        start = end


def _train_chunks(corpus: Corpus, cut: int, every: int, progress):
    """Pass 3's text: the training split in whole-line chunks of about CHUNK_CHARS (the last
    piece to the cut), every ``every``-th of them."""
    buf, i = "", 0
    for split, b in _split_blocks(corpus, cut, progress):
        if split != "train":
            break
        buf += b
        while len(buf) >= CHUNK_CHARS:
            e = buf.find("\n", CHUNK_CHARS - 1)
            if e < 0:
                if len(buf) < 2 * CHUNK_CHARS:
                    break
                e = CHUNK_CHARS - 1          # a line of millions: a sample need not keep it whole
            if i % every == 0:
                yield buf[:e + 1]
            buf, i = buf[e + 1:], i + 1
    if buf and i % every == 0:
        yield buf


def prepare_text(corpus: Corpus, out: Path, tokenizer_kind: str, vocab_size: int | None, val_fraction: float,
                 force: bool, tokenizer: Tokenizer | None, report, versions: dict,
                 sample: int = DEFAULT_SAMPLE, default_bpe_vocab: int = 1024, unknown: str = "refuse") -> dict:
    """Prepare ``corpus`` into the folder ``out`` (checked by the caller); returns meta.
    ``unknown``: with a given char tokenizer, what becomes of the characters it lacks (refused,
    all named with their counts, unless "drop" or "space"; pieces.CharCodes)."""
    t0 = time.perf_counter()
    if tokenizer is not None:
        check_encodable(tokenizer)
    given_char = tokenizer is not None and tokenizer.kind == "char"
    fingerprint = corpus.fingerprint()
    info = _read(corpus, report, char=(tokenizer is None and tokenizer_kind == "char") or given_char)
    if info["blank"]:
        raise TbpError(f"{corpus.source}: corpus is empty")
    missing = lacking(info["counts"], tokenizer) if given_char else {}
    if missing and unknown == "refuse":
        raise TbpError(lacking_message(corpus.source, missing, tokenizer))
    n = info["characters"]
    cut = _cut(corpus, n, val_fraction, report)
    sampled = None
    if tokenizer is None:
        if tokenizer_kind == "char":
            tokenizer = train_char("".join(sorted(info["alphabet"])))
            if vocab_size is not None and vocab_size < tokenizer.vocab_size:
                raise TbpError(f"--vocab-size {vocab_size} is below the corpus alphabet: "
                               f"it has {tokenizer.vocab_size} distinct characters")
        else:
            region = cut if cut > 0 else n              # an empty training split: learn from all
            every = max(1, math.ceil(region / max(1, sample)))
            report.phase(f"training the tokenizer ({'all' if every == 1 else f'1 chunk in {every}'})",
                         corpus.size())
            tokenizer = train_bpe(_train_chunks(corpus, region, every, report.advance),
                                  vocab_size or default_bpe_vocab)
            sampled = {"every": every, "of_characters": region, "chunk_characters": CHUNK_CHARS}
    dtype = token_dtype(tokenizer.vocab_size)
    with staged_dir(out, force) as tmp:
        atomic_write_text(tmp / "tokenizer.json", tokenizer.to_str())
        counts = _encode(corpus, tokenizer, dtype, cut, tmp, report, unknown)
        if corpus.fingerprint() != fingerprint or counts["train"]["bytes"] + counts["val"]["bytes"] != info["bytes"]:
            raise TbpError(f"{corpus.source}: changed while it was being prepared (it is read several times); "
                           f"prepare it again once nothing writes to it")
        empty = [split for split in ("train", "val") if not counts[split]["tokens"]]
        if empty:                          # nothing to train on or to measure with: no dataset at all
            raise TbpError(f"{corpus.source}: too little text ({n:,} character(s)) to leave tokens in the "
                           f"{' and '.join(empty)} split{'s' * (len(empty) > 1)}; use more text")
        meta = {
            "format": 1, "tokenizer": tokenizer.kind, "vocab_size": tokenizer.vocab_size, "vocab_size_asked": tokenizer.asked,
            "eot_id": tokenizer.eot_id, "dtype": dtype.name,
            "train_tokens": counts["train"]["tokens"], "val_tokens": counts["val"]["tokens"],
            # of the text the tokens encode (without what --unknown-chars dropped): bits per byte
            "train_bytes": counts["train"]["encoded"], "val_bytes": counts["val"]["encoded"],
            "characters": n,
            "bytes_per_token": (counts["train"]["encoded"] + counts["val"]["encoded"])
            / max(1, counts["train"]["tokens"] + counts["val"]["tokens"]),
            "val_fraction": val_fraction, "source": corpus.source, "source_sha256": info["sha256"],
            "tokenizer_sha256": tokenizer.sha256(), "name": corpus.name, "versions": versions,
            "seams": counts["train"]["seams"] + counts["val"]["seams"],
            # what load need not scan again: each token file as prepare checked it
            "checked": {f"{s}.bin": _stamp(tmp / f"{s}.bin") for s in ("train", "val")},
        }
        if sampled:
            meta["tokenizer_sample"] = sampled
        if missing:                             # what --unknown-chars did, and to which characters
            meta["unknown_chars"] = {"mode": unknown, "count": sum(missing.values()),
                                     "characters": dict(list(missing.items())[:32])}
        meta["seconds"] = round(time.perf_counter() - t0, 3)
        atomic_write_json(tmp / "meta.json", meta)
    return meta


def _encode(corpus: Corpus, tok: Tokenizer, dtype, cut: int, folder: Path, report, unknown: str = "refuse") -> dict:
    """Pass 4: both splits' ids into folder/train.bin and folder/val.bin."""
    report.phase("encoding", corpus.size())
    counts = {}
    files = {s: open(folder / f"{s}.bin", "xb") for s in ("train", "val")}
    try:
        enc = {s: PieceEncoder(tok, dtype, lambda a, f=files[s]: f.write(memoryview(a).cast("B")),
                               f"{corpus.source} ({s} split)", unknown) for s in files}
        nbytes = {"train": 0, "val": 0}
        for split, b in _split_blocks(corpus, cut, report.advance):
            enc[split].feed(b)
            nbytes[split] += len(b.encode("utf-8"))
        for s, e in enc.items():
            e.finish()
            files[s].flush()
            os.fsync(files[s].fileno())
            change = e.codes.byte_change if e.codes is not None else 0    # --unknown-chars drop or space
            counts[s] = {"tokens": e.tokens, "bytes": nbytes[s], "seams": e.seams, "encoded": nbytes[s] + change}
    finally:
        for f in files.values():
            f.close()
    return counts


def _stamp(path: Path) -> list[int]:
    """[size, mtime in ns]: a file as it was when checked (a copy or an edit changes it)."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


