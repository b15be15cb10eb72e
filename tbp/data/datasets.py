"""Text -> token files, and the batch sampler that reads them.

A prepared dataset is a folder (``data/<name>/``)::

    tokenizer.json  train.bin  val.bin  meta.json

``train.bin``/``val.bin`` are flat arrays of token ids (uint16 when the vocabulary fits,
uint32 otherwise), read back through ``np.memmap`` so a corpus larger than memory trains
just the same. The validation split is the *last* fraction of the text, cut at a line
boundary (:func:`split_text`); decoding train then val gives back exactly the source text.
Corpora are read as streams (tbp.data.corpus) and prepared in bounded memory (tbp.data.texts).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError, TbpError
from ..files import schema
from ..files.jsonio import read_json
from .corpus import Corpus, in_memory, open_corpus
from .prepare import DEFAULT_BPE_VOCAB, Kind, PrepareReport, claim, dataset_name, default_out, versions
from .texts import DEFAULT_SAMPLE, prepare_text
from .tokenizer import TOKENIZERS, Tokenizer
from . import chat, pairs



# --- reading text ---------------------------------------------------------------------------
def read_corpus(path: str | None, encoding: str = "utf-8") -> tuple[str, str, str]:
    """(text, name, source) of a corpus (corpus.open_corpus), in memory: for small ones."""
    with open_corpus(path, encoding) as c:
        return c.text(), c.name, c.source


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    """Cut the last ``val_fraction`` of the text off as validation, just after a newline."""
    if val_fraction == 0:
        return text, ""
    cut = int(len(text) * (1 - val_fraction))
    nl = text.rfind("\n", 0, cut)
    if nl >= 0 and nl + 1 < len(text):
        cut = nl + 1
    return text[:cut], text[cut:]


# --- preparing ------------------------------------------------------------------------------
def prepare_corpus(path: str | None, out: str | Path | None = None, tokenizer_kind: str = "char",
                   vocab_size: int | None = None, val_fraction: float = 0.1, force: bool = False,
                   encoding: str = "utf-8", report: PrepareReport | None = None, text_field: str | None = None,
                   tokenizer_sample: int = DEFAULT_SAMPLE) -> dict:
    """Read a corpus (file, folder, '-' or None for the built-in one: corpus.open_corpus) and
    prepare it into ``out`` (default data/<dataset_name>); returns the meta dict, with its "path"."""
    out = Path(out) if out else None
    with open_corpus(path, encoding, text_field or "text", spool_dir=(out.parent if out else Path("data"))) as corpus:
        if text_field is not None and not any(s.format in ("records", "parquet") for s in corpus.sources):
            raise ConfigError(f"--text-field is for JSON lines and Parquet; {corpus.source} is plain text")
        out = out or default_out(dataset_name(corpus.name, tokenizer_kind, vocab_size))
        return prepare_from(corpus, out, tokenizer_kind, vocab_size, val_fraction, force, report=report,
                            tokenizer_sample=tokenizer_sample)


def prepare(text: str, name: str, source: str, out: str | Path, tokenizer_kind: str = "char",
            vocab_size: int | None = None, val_fraction: float = 0.1, force: bool = False,
            tokenizer: Tokenizer | None = None, report: PrepareReport | None = None) -> dict:
    """:func:`prepare_from` for text in memory."""
    return prepare_from(in_memory(text, name, source), Path(out), tokenizer_kind, vocab_size, val_fraction, force,
                        tokenizer, report)


def prepare_from(corpus: Corpus, out: Path, tokenizer_kind: str = "char", vocab_size: int | None = None,
                 val_fraction: float = 0.1, force: bool = False, tokenizer: Tokenizer | None = None,
                 report: PrepareReport | None = None, tokenizer_sample: int = DEFAULT_SAMPLE,
                 unknown: str = "refuse") -> dict:
    """Train (or reuse) a tokenizer, encode both splits, write the dataset folder atomically,
    streaming the corpus in bounded memory (tbp.data.texts).

    Returns the dataset's meta dict (with its "path"). ``tokenizer`` reuses an existing
    tokenizer (a checkpoint's when resuming or fine-tuning) instead of training one; ``unknown``
    says what becomes of characters a given char tokenizer lacks (refuse, drop, space).
    """
    report = report or PrepareReport()
    out = Path(out)
    claim(out, force, (corpus.source,) if corpus.spool is None and Path(corpus.source).exists() else (),
          val_fraction)
    if tokenizer_kind not in TOKENIZERS:
        raise TbpError(f"unknown tokenizer {tokenizer_kind!r}; choose from {', '.join(TOKENIZERS)}")
    meta = prepare_text(corpus, out, tokenizer_kind, vocab_size, val_fraction, force, tokenizer, report, versions(),
                        tokenizer_sample, DEFAULT_BPE_VOCAB, unknown)
    meta["path"] = str(out)
    report.done(meta)
    return meta


# --- a run's data -----------------------------------------------------------------------------
def resolve_dataset(arg: str | None, tokenizer: Tokenizer | None = None, tokenizer_kind: str = "char",
                    vocab_size: int | None = None, report: PrepareReport | None = None,
                    unknown: str = "refuse") -> Dataset:
    """A prepared folder as is; a text file (or folder of text) prepared on the fly; None -> the
    built-in corpus. With ``tokenizer`` (resume / fine-tune) the text is encoded with it."""
    prepared = arg is not None and Path(arg).is_dir() and (Path(arg) / "meta.json").is_file()
    if unknown != "refuse" and (prepared or tokenizer is None or tokenizer.kind != "char"):
        raise ConfigError("--unknown-chars applies to text prepared on the fly with another run's char tokenizer"
                          + ("; this --data is a prepared dataset" if prepared else
                             "; a BPE tokenizer encodes any text" if tokenizer is not None else ""))
    if prepared:
        ds = Dataset.load(arg)
    else:
        if arg is not None and not Path(arg).exists():
            raise TbpError(f"{arg}: no such file or directory")
        with open_corpus(arg, spool_dir=Path("data")) as corpus:
            sha = corpus.sha256()                # a stream: the corpus is never held in memory
            out = default_out(dataset_name(corpus.name, tokenizer_kind, vocab_size, tokenizer)
                              + ("" if unknown == "refuse" else f"-{unknown}"))
            ds = _reuse(out, sha, tokenizer)
            if ds is None and _holds_other_text(out, sha):
                # two corpora with the same file name: never prepare one over the other's dataset
                out = out.with_name(f"{out.name}-{sha[:8]}")
                ds = _reuse(out, sha, tokenizer)
            if ds is None:
                prepare_from(corpus, out, tokenizer_kind, vocab_size, force=out.exists(), tokenizer=tokenizer,
                             report=report, unknown=unknown)
                ds = Dataset.load(out)
    if tokenizer is not None and ds.tokenizer.sha256() != tokenizer.sha256():
        why = (f"{ds.path}: its tokenizer differs from the checkpoint's "
               f"(SHA-256 {ds.tokenizer.sha256()[:12]} vs {tokenizer.sha256()[:12]}); ")
        if ds.kind == "text":
            raise TbpError(why + "pass the raw text file instead and it will be encoded with the checkpoint's")
        source = ds.meta.get("source") or "FILE"
        raise TbpError(why + f"prepare the {ds.kind} again with the checkpoint's tokenizer (tbp prepare --format "
                             f"{ds.kind} --data {source} --tokenizer-from RUN --out DIR) and pass that folder")
    return ds


def _holds_other_text(out: Path, sha: str) -> bool:
    """Whether ``out`` is a dataset prepared from some other text (whatever its state)."""
    try:
        recorded = read_json(out / "meta.json").get("source_sha256")
    except TbpError:
        return out.exists()            # damaged or foreign: not ours to overwrite either
    return recorded != sha


def _reuse(out: Path, sha: str, tokenizer: Tokenizer | None) -> Dataset | None:
    """The dataset already prepared at ``out`` from the text with SHA-256 ``sha``, if there is one."""
    if not (out / "meta.json").is_file():
        return None
    try:
        ds = Dataset.load(out)
    except TbpError:
        return None
    if ds.meta.get("source_sha256") != sha:
        return None
    if tokenizer is not None and ds.tokenizer.sha256() != tokenizer.sha256():
        return None
    return ds


# --- loading --------------------------------------------------------------------------------
@dataclass
class Dataset:
    """A prepared folder: memmapped splits, the tokenizer and meta.json. A text dataset's
    splits are flat token arrays; a pairs dataset's are ``tbp.data.pairs.PairSplit`` objects."""
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
        meta = schema.check(read_json(where), schema.DATASET_META, str(where))
        kind = KINDS.get(meta.get("kind", "text"))
        if kind is None:
            raise TbpError(f"{where}: kind {meta['kind']!r} is not one this tbp reads ({', '.join(KINDS)})")
        for f in ("tokenizer.json", "train.bin", "val.bin") + kind.files:
            if not (path / f).is_file():
                raise TbpError(f"{path}: missing {f}; prepare it again with tbp prepare --force")
        if meta["dtype"] not in ("uint16", "uint32"):
            raise TbpError(f"{where}: dtype {meta['dtype']!r} is not a token dtype (uint16 or uint32)")
        dtype = np.dtype(meta["dtype"])
        tok = Tokenizer.load(path / "tokenizer.json")
        if tok.vocab_size != meta["vocab_size"]:
            raise TbpError(f"{path}: tokenizer has {tok.vocab_size} tokens, meta.json says {meta['vocab_size']}")
        # a text split prepare checked, unchanged since (size, mtime): not scanned again at every
        # start of a multi-gigabyte run; its batches are checked as they are drawn (tbp.data.batches)
        checked = meta.get("checked") if kind is TEXT and isinstance(meta.get("checked"), dict) else {}
        splits = [_read_tokens(path / f"{split}.bin", dtype, meta[f"{split}_tokens"], tok.vocab_size,
                               checked.get(f"{split}.bin")) for split in ("train", "val")]
        if kind.check_meta is not None:
            kind.check_meta(meta, str(where))
        if kind.load_split is not None:
            splits = [kind.load_split(path, split, ids, meta) for split, ids in zip(("train", "val"), splits)]
        return cls(path, meta, tok, *splits)


TEXT = Kind("text")              # flat token arrays: the splits are the arrays themselves
KINDS = {"text": TEXT, "pairs": pairs.KIND, "chat": chat.KIND}


def _read_tokens(f: Path, dtype: np.dtype, count: int, vocab_size: int, stamp=None) -> np.ndarray:
    """A split's token ids, memory-mapped, after checking its size and that every id is in the
    vocabulary (a scan in chunks: a bad id is named here, not at a random training step) --
    unless ``stamp`` (meta.json's [size, mtime_ns] of the file as prepare wrote it) still holds."""
    size = f.stat().st_size
    if size % dtype.itemsize:
        raise TbpError(f"{f}: {size} bytes is not a whole number of {dtype.name} token ids; the file is damaged")
    n = size // dtype.itemsize
    if n != count:
        raise TbpError(f"{f}: holds {n} tokens, meta.json says {count}")
    if not n:
        return np.zeros(0, dtype)
    ids = np.memmap(f, dtype=dtype, mode="r")
    st = f.stat()
    if stamp == [st.st_size, st.st_mtime_ns]:
        return ids
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
