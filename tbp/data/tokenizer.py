"""Tokenizers built with the `tokenizers` library: char-level or byte-level BPE.

Both are lossless on the text they accept: ``decode(encode(s)) == s``. The byte-level BPE
accepts any text (every byte is in its alphabet, nothing is ever unknown); the char-level
tokenizer accepts the characters of the corpus it was built from and names any other.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ..errors import TbpError

EOT = "<|endoftext|>"
SEP = "<|sep|>"            # paired data: between a source and its target (the decoder's start token)
PAD = "<|pad|>"            # paired data: fills a batch's shorter examples; never predicted
PAIR_SPECIALS = (EOT, SEP, PAD)
# the chat template: each message is <|role|> content <|end|>
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
CHAT_SPECIALS = (EOT, PAD, SYSTEM, USER, ASSISTANT, END)
TOKENIZERS = ("char", "bpe")          # the kinds of tokenizer: a character per id, or byte-level BPE
ENCODE_SLICE = 1 << 20          # characters encoded in one call of the library (encode_flat)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what tbp needs: its kind, end-of-text id, strict checks.

    Text is encoded with special-token matching off (``encode_special_tokens``): a literal
    ``<|end|>`` typed by a user, or found in a corpus, is those seven characters, never the
    reserved id. Reserved ids enter a sequence only by id (the chat template, a pair's
    separator), so no text can forge a role or end a document."""

    def __init__(self, hf: HFTokenizer):
        hf.encode_special_tokens = True         # not part of to_str(): the file and its hash are unchanged
        self.hf = hf
        vocab = hf.get_vocab()
        self.kind = "bpe" if _open_vocabulary(hf) else "char"
        self.eot_id = vocab.get(EOT)
        self.sep_id, self.pad_id = vocab.get(SEP), vocab.get(PAD)
        self._alphabet = None if self.kind == "bpe" else frozenset(vocab)
        self._max_chars = None
        # the vocabulary its training was asked for, where it was trained here: BPE stops short of
        # it when the text has no pair of tokens left to merge (train_bpe)
        self.asked: int | None = None

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def check(self, text: str, where: str = "text") -> None:
        """Raise TbpError if ``text`` cannot be encoded: it is not valid Unicode (a lone surrogate,
        how Python carries undecodable bytes of argv or stdin), or it holds characters a char
        tokenizer has never seen (all of them named, with counts, in one line)."""
        check_unicode(text, where)
        if self._alphabet is None or set(text) <= self._alphabet:
            return
        missing = sorted(set(text) - self._alphabet, key=lambda c: (-text.count(c), text.index(c)))
        first = min(text.index(c) for c in missing)
        shown = ", ".join(f"{c!r} (U+{ord(c):04X}) x{text.count(c)}" for c in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise TbpError(f"{where}: {len(missing)} character(s) not in this char tokenizer's vocabulary of "
                       f"{self.vocab_size}, first on line {text.count(chr(10), 0, first) + 1}: {shown}{more}; "
                       f"use a bpe tokenizer for open-ended text (tbp prepare --tokenizer bpe)")

    def encode(self, text: str, where: str = "text") -> list[int]:
        self.check(text, where)
        return self.hf.encode(text).ids

    def encode_batch(self, texts: list[str], where: str = "text") -> list[np.ndarray]:
        for t in texts:
            self.check(t, where)
        return [np.asarray(e.ids, dtype=np.int64) for e in self.hf.encode_batch(texts)]

    def encode_flat(self, texts: list[str], where: str = "text", dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
        """(ids, lengths): the texts' ids back to back and each one's count. Encoded in slices of
        about ENCODE_SLICE characters, so the library's per-token records (offsets, strings) of
        only one slice are alive at a time: memory follows the ids, not the text times 200."""
        pieces, lengths, i = [], [], 0
        while i < len(texts):
            j, size = i, 0
            while j < len(texts) and (j == i or size + len(texts[j]) <= ENCODE_SLICE):
                size += len(texts[j])
                j += 1
            encoded = self.encode_batch(texts[i:j], where)
            lengths += [e.size for e in encoded]
            pieces.append(np.concatenate(encoded).astype(dtype, copy=False) if encoded else np.zeros(0, dtype))
            i = j
        ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
        return ids, np.array(lengths, dtype=np.int64)

    @property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for (1 for char; BPE: its longest merge)."""
        if self._max_chars is None:
            specials = {t.content for t in self.hf.get_added_tokens_decoder().values()}
            if self.kind == "char":
                self._max_chars = 1
            else:                      # a byte-level token's symbols are bytes: one byte is at most one char
                self._max_chars = max((len(t) for t in self.hf.get_vocab() if t not in specials), default=1)
        return self._max_chars

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), without encoding it (a bound to refuse text that
        no model's context could hold before the library spends gigabytes on it)."""
        return -(-len(text) // self.max_token_chars)

    def decode(self, ids) -> str:
        # keep special tokens: a literal "<|endoftext|>" in the text must survive the round trip
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_str(self) -> str:
        return self.hf.to_str()

    def sha256(self) -> str:
        return hashlib.sha256(self.to_str().encode()).hexdigest()

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_str(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        if not path.is_file():
            raise TbpError(f"{path}: no tokenizer here")
        try:
            return cls(HFTokenizer.from_str(path.read_text(encoding="utf-8")))
        except Exception as e:   # the library raises plain Exceptions for bad JSON
            raise TbpError(f"{path}: not a valid tokenizer.json ({' '.join(str(e).split())[:120]})") from None

    @classmethod
    def from_str(cls, s: str) -> "Tokenizer":
        return cls(HFTokenizer.from_str(s))


def _open_vocabulary(hf: HFTokenizer) -> bool:
    """Whether any text encodes: a byte-level pre-tokenizer (alone, as tbp's BPE has it, or in a
    sequence, as SmolLM2's splits digits first), or a model that falls back to byte tokens
    (Llama 2's and TinyLlama's). Otherwise the tokens are an alphabet (tbp's char tokenizer)."""
    if isinstance(hf.pre_tokenizer, pre_tokenizers.ByteLevel):
        return True
    spec = json.loads(hf.to_str())
    return '"ByteLevel"' in json.dumps(spec.get("pre_tokenizer")) or bool((spec.get("model") or {}).get("byte_fallback"))


def check_unicode(text: str, where: str) -> None:
    """TbpError naming the first code point UTF-8 cannot carry: a lone surrogate, which is how
    Python holds an undecodable byte (U+DC80..U+DCFF) or a JSON escape like "\\ud800"."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        cp = ord(text[e.start])
        what = f"byte 0x{cp - 0xDC00:02x}" if 0xDC80 <= cp <= 0xDCFF else f"lone surrogate U+{cp:04X}"
        line = text.count("\n", 0, e.start) + 1
        raise TbpError(f"{where}: {what} at character {e.start} (line {line}) is not valid UTF-8 text") from None


def train_char(text: str, specials: tuple[str, ...] = ()) -> Tokenizer:
    """One token per distinct character, ids in sorted character order (nanoGPT's shakespeare_char),
    then ``specials`` (paired data's <|endoftext|>, <|sep|>, <|pad|>), if any.

    Built as a BPE model with no merges: every character is its own token, and the Fuse
    decoder joins tokens back with nothing in between.
    """
    chars = sorted(set(text))
    if not chars:
        raise TbpError("cannot build a char tokenizer from empty text")
    hf = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    hf.decoder = decoders.Fuse()
    if specials:
        hf.add_special_tokens(list(specials))
    return Tokenizer(hf)


def train_bpe(texts: Iterable[str], vocab_size: int, specials: tuple[str, ...] = (EOT,)) -> Tokenizer:
    """Byte-level BPE (GPT-2's scheme) trained to ``vocab_size`` tokens, including ``specials``
    (<|endoftext|>; paired data adds <|sep|> and <|pad|>).

    The 256 byte symbols are the initial alphabet, so any text encodes with no unknown token.
    """
    floor = len(pre_tokenizers.ByteLevel.alphabet()) + len(specials)
    if vocab_size < floor:
        raise TbpError(f"--vocab-size {vocab_size} is below the byte-level alphabet: "
                       f"a bpe tokenizer needs at least {floor} (256 bytes + {', '.join(specials)})")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(_bounded_words(texts), trainer)
    tok = Tokenizer(hf)
    tok.asked = vocab_size
    return tok


LONGEST_WORD = 1024          # characters of one whitespace-free run that BPE training counts as one word
_LONG_RUN = re.compile(r"\S{%d,}" % (LONGEST_WORD + 1))


def _bounded_words(texts: Iterable[str]) -> Iterator[str]:
    """The texts with every whitespace-free run longer than LONGEST_WORD cut into pieces of that
    length (a newline between them). The trainer's cost grows with the square of a word's length
    (every merge rescans it): one 300 KB line of a single letter took minutes, and SIGTERM waited
    for it. Only such runs change (base64, minified code), and only the pairs across a cut are lost
    from the counts; encoding is untouched."""
    def cut(m: re.Match) -> str:
        run = m.group(0)
        return "\n".join(run[i:i + LONGEST_WORD] for i in range(0, len(run), LONGEST_WORD))
    for text in texts:
        yield _LONG_RUN.sub(cut, text) if len(text) > LONGEST_WORD else text


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2 ** 16 else np.dtype(np.uint32)

