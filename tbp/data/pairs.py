"""Paired datasets: examples of a source and its target, kept whole.

A pairs dataset is a folder like a text one (``tbp prepare --format pairs``), whose
``meta.json`` says ``"kind": "pairs"``::

    tokenizer.json  meta.json
    train.bin  val.bin     token ids: each example's source, then its target, back to back
    train.idx  val.idx     int64 (n, 2): each example's source and target lengths in tokens

The tokenizer has three special tokens besides the text's: <|sep|> between a source and its
target (the encoder-decoder's start token), <|endoftext|> after a target (so a model learns
where to stop) and <|pad|>, which fills a batch's shorter examples and is never predicted.
Validation is the last ``val_fraction`` of the examples. Built-in tasks (``--task``) make
digit-string pairs with distinct sources, so no validation source is ever seen in training.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..files import jsonio, schema
from .prepare import (DEFAULT_BPE_VOCAB, Kind, PrepareReport, claim, dataset_name, default_out, read_file,
                      row_starts, versions, write_dataset)
from ..errors import TbpError
from ..nn.config import N_CTX_MAX
from .tokenizer import EOT, PAD, PAIR_SPECIALS, SEP, Tokenizer, token_dtype, train_bpe, train_char

TASKS = {
    "reverse": lambda s: s[::-1],
    "sort": lambda s: "".join(sorted(s)),
    "copy": lambda s: s,
}
TASK_EXAMPLES = 20000
MAX_TASK_LEN = (N_CTX_MAX - 2) // 2     # a source and its target (and two specials) in the longest context
MAX_TASK_CHARS = 1 << 28                 # digits a task makes at most (its strings are held in memory)
MAX_TASK_EXAMPLES = MAX_TASK_CHARS
TASK_VAL_FRACTION = 0.05          # 1,000 of the default 20,000 held out
PAIRS_META = {"train_examples": int, "val_examples": int, "sep_id": int, "pad_id": int, "eot_id": int,
              "max_source_tokens": int, "max_target_tokens": int, "max_example_tokens": int,
              "val_target_tokens": int, "val_target_bytes": int}


def _as_chat(tokenizer: Tokenizer) -> str:
    """The other road for a tokenizer that has a chat template (an imported chat model's): each
    pair a one-turn conversation, the loss on the target alone."""
    from .chat import template
    try:
        template(tokenizer)
    except TbpError:
        return ""
    return ("; with this tokenizer, write each pair as a conversation, {\"messages\": [{\"role\": \"user\", "
            "\"content\": SOURCE}, {\"role\": \"assistant\", \"content\": TARGET}]}, and prepare it with "
            "--format chat (the loss is on the target)")


# --- reading ----------------------------------------------------------------------------------
def read_pairs(path: str, encoding: str = "utf-8") -> tuple[list[tuple[str, str]], str, str, list[int]]:
    """(pairs, name, source, line numbers) from a TSV file (``source<TAB>target`` per line) or
    JSON lines (``{"source": ..., "target": ...}``), or '-' for stdin. Blank lines are skipped;
    any other line that is not a pair is refused, naming the file and line."""
    text, where, name = read_file(path, encoding, "file of pairs")
    jsonl = where.endswith((".jsonl", ".ndjson", ".json")) or \
        (not where.endswith((".tsv", ".tab")) and text.lstrip().startswith("{"))
    pairs, numbers = [], []
    for n, line in jsonio.lines(text):
        if not line.strip():
            continue
        src, tgt = _json_pair(line, where, n) if jsonl else _tsv_pair(line, where, n)
        if not src:
            raise TbpError(f"{where}:{n}: empty source")
        pairs.append((src, tgt))
        numbers.append(n)
    if not pairs:
        raise TbpError(f"{where}: no pairs (expected source<TAB>target lines or JSON lines)")
    return pairs, name, where, numbers


def _where(lines: list[int] | None, i: int) -> str:
    return f"line {lines[i]}" if lines else f"example {i + 1}"


def _tsv_pair(line: str, where: str, n: int) -> tuple[str, str]:
    parts = line.split("\t")
    if len(parts) != 2:
        found = "no tab" if len(parts) == 1 else f"{len(parts) - 1} tabs"
        raise TbpError(f"{where}:{n}: expected source<TAB>target, found {found}")
    return parts[0], parts[1]


def _json_pair(line: str, where: str, n: int) -> tuple[str, str]:
    obj = jsonio.parse(line, f"{where}:{n}")
    if not isinstance(obj, dict) or not isinstance(obj.get("source"), str) or not isinstance(obj.get("target"), str):
        raise TbpError(f'{where}:{n}: expected {{"source": "...", "target": "..."}} with string values')
    return obj["source"], obj["target"]


def make_task(task: str, examples: int = TASK_EXAMPLES, min_len: int = 1, max_len: int = 12,
              seed: int = 0) -> list[tuple[str, str]]:
    """``examples`` pairs of a built-in task on digit strings with distinct sources, lengths
    uniform in [min_len, max_len] (while a length has strings left). reverse: the digits
    backwards; sort: in ascending order; copy: unchanged."""
    if task not in TASKS:
        raise TbpError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if not 1 <= min_len <= max_len <= MAX_TASK_LEN:
        raise TbpError(f"task lengths must satisfy 1 <= min ({min_len}) <= max ({max_len}) <= {MAX_TASK_LEN}")
    if examples * (min_len + max_len) // 2 > MAX_TASK_CHARS:
        raise TbpError(f"{examples:,} strings of {min_len}..{max_len} digits are about "
                       f"{examples * (min_len + max_len) // 2:,} characters, more than the {MAX_TASK_CHARS:,} "
                       f"a built-in task makes; ask for fewer or shorter")
    if max_len < 20:                                  # past that, 10^20 strings: never half taken
        space = (10 ** (max_len + 1) - 10 ** min_len) // 9
        if examples > space // 2:
            raise TbpError(f"{examples} distinct digit strings of length {min_len}..{max_len} would be more "
                           f"than half of the {space:,} there are; ask for fewer, or longer strings")
    rng = np.random.default_rng(seed)
    seen: dict[str, None] = {}                        # insertion-ordered set
    rows = max(1, (1 << 22) // max_len)               # digits drawn a block of rows at a time: bounded memory,
    while len(seen) < examples:                       # the same stream as one draw of every row
        lengths = rng.integers(min_len, max_len + 1, examples)
        for a in range(0, examples, rows):
            digits = rng.integers(0, 10, (min(rows, examples - a), max_len))
            for n, row in zip(lengths[a:a + rows], digits):
                seen.setdefault((row[:n] + 48).astype(np.uint8).tobytes().decode("ascii"))
                if len(seen) == examples:
                    break
            if len(seen) == examples:
                break
    fn = TASKS[task]
    return [(s, fn(s)) for s in seen]


# --- preparing --------------------------------------------------------------------------------
def prepare_pairs(pairs: list[tuple[str, str]], name: str, source: str, out: str | Path | None = None,
                  tokenizer_kind: str = "char", vocab_size: int | None = None, val_fraction: float = 0.1,
                  force: bool = False, tokenizer: Tokenizer | None = None,
                  report: PrepareReport | None = None, origin: dict | None = None,
                  lines: list[int] | None = None) -> dict:
    """Tokenize ``pairs`` and write a pairs dataset folder atomically; returns its meta (with
    "path"). ``origin`` (a task's parameters) is recorded in the meta; ``lines`` (each pair's
    line in its file) names a refused pair."""
    report = report or PrepareReport()
    out = Path(out) if out else default_out(dataset_name(name, tokenizer_kind, vocab_size))
    claim(out, force, (source,) if Path(source).exists() else (), val_fraction)
    n_val = max(1, round(len(pairs) * val_fraction))
    if len(pairs) - n_val < 1:
        raise TbpError(f"{source}: {len(pairs)} pair(s) leave nothing to train on after the validation split")
    t0 = time.perf_counter()
    sides = [side for pair in pairs for side in pair]
    text = "".join(sides)
    if tokenizer is None:
        if tokenizer_kind == "char":
            tokenizer = train_char(text, PAIR_SPECIALS)
        else:
            tokenizer = train_bpe(sides, vocab_size or DEFAULT_BPE_VOCAB, PAIR_SPECIALS)
    else:
        missing = [s for s in PAIR_SPECIALS if s not in tokenizer.hf.get_vocab()]
        if missing:
            raise TbpError(f"the tokenizer has no {', '.join(missing)}: paired data needs its own "
                           f"(prepare it without a given tokenizer)" + _as_chat(tokenizer))
        tokenizer.check(text, source)
    for i, (s, t) in enumerate(pairs):
        if tokenizer.min_tokens(s) + tokenizer.min_tokens(t) + 2 > N_CTX_MAX:
            raise TbpError(f"{source}: {_where(lines, i)} is at least {tokenizer.min_tokens(s) + tokenizer.min_tokens(t)} "
                           f"tokens, more than any model's context ({N_CTX_MAX}) can hold")
    report.start(name, len(text) + len(pairs))
    splits = {"train": pairs[:len(pairs) - n_val], "val": pairs[len(pairs) - n_val:]}
    dtype = token_dtype(tokenizer.vocab_size)
    encoded = {}
    for split, items in splits.items():
        # source, target, source, target ...: the ids come out in the file's order
        ids, lengths = tokenizer.encode_flat([side for pair in items for side in pair], source, dtype)
        report.advance(sum(len(s) + len(t) + 1 for s, t in items))
        encoded[split] = ids, lengths.reshape(-1, 2)
    all_lengths = np.concatenate([encoded["train"][1], encoded["val"][1]])
    val_targets = splits["val"]
    vocab = tokenizer.hf.get_vocab()
    meta = {
        "format": 1, "kind": "pairs",
        "tokenizer": tokenizer.kind, "vocab_size": tokenizer.vocab_size, "vocab_size_asked": tokenizer.asked, "dtype": dtype.name,
        "eot_id": vocab[EOT], "sep_id": vocab[SEP], "pad_id": vocab[PAD],
        "train_examples": len(splits["train"]), "val_examples": len(splits["val"]),
        "train_tokens": int(encoded["train"][0].size), "val_tokens": int(encoded["val"][0].size),
        "train_bytes": sum(len((s + t).encode("utf-8")) for s, t in splits["train"]),
        "val_bytes": sum(len((s + t).encode("utf-8")) for s, t in val_targets),
        # bits per byte are of what the loss is on: the targets, each with its <|endoftext|>
        "val_target_tokens": int(encoded["val"][1][:, 1].sum() + len(val_targets)),
        "val_target_bytes": sum(len(t.encode("utf-8")) for _, t in val_targets),
        "max_source_tokens": int(all_lengths[:, 0].max()), "max_target_tokens": int(all_lengths[:, 1].max()),
        "max_example_tokens": int(all_lengths.sum(1).max()),
        "characters": len(text), "val_fraction": val_fraction, "source": source,
        "source_sha256": hashlib.sha256(json.dumps(pairs).encode("utf-8")).hexdigest(),
        "tokenizer_sha256": tokenizer.sha256(), "name": name, "versions": versions(), "seconds": 0.0,
    }
    if origin:
        meta["task"] = origin
    arrays = {f"{split}.{ext}": a for split, (ids, lengths) in encoded.items()
              for ext, a in (("bin", ids), ("idx", lengths))}
    return write_dataset(out, force, tokenizer, arrays, meta, t0, report)


# --- loading ----------------------------------------------------------------------------------
@dataclass
class PairSplit:
    """One split's examples: example i is tokens[start[i]:][:src_len[i]] then its target."""
    tokens: np.ndarray          # (total,) memmapped ids
    src_len: np.ndarray         # (n,)
    tgt_len: np.ndarray         # (n,)
    start: np.ndarray           # (n,) offset of each source

    def __len__(self) -> int:
        return len(self.src_len)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a = int(self.start[i])
        b = a + int(self.src_len[i])
        return np.asarray(self.tokens[a:b], np.int64), np.asarray(self.tokens[b:b + int(self.tgt_len[i])], np.int64)


def load_split(path: Path, split: str, tokens: np.ndarray, meta: dict) -> PairSplit:
    """A split's lengths from ``<split>.idx``, checked against its tokens and meta.json."""
    f = path / f"{split}.idx"
    n = meta[f"{split}_examples"]
    size = f.stat().st_size
    if size != n * 16:
        raise TbpError(f"{f}: {size} bytes, meta.json says {n} examples ({n * 16} bytes); the file is damaged")
    lengths = np.fromfile(f, dtype=np.int64).reshape(n, 2)
    bound = min(tokens.size, meta.get("max_example_tokens", tokens.size))
    if (lengths < 0).any() or (lengths[:, 0] < 1).any() or (lengths > bound).any():
        raise TbpError(f"{f}: an example length is out of range (0 .. {bound}); the file is damaged")
    start = row_starts(lengths.sum(1), tokens.size, f, split, "example")
    return PairSplit(tokens, lengths[:, 0].copy(), lengths[:, 1].copy(), start)


def check_meta(meta: dict, where: str) -> None:
    schema.check(meta, PAIRS_META, where)


KIND = Kind("pairs", ("train.idx", "val.idx"), check_meta, load_split)
