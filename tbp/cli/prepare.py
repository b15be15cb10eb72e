"""`tbp prepare`: text -> tokenizer -> train.bin / val.bin."""
from __future__ import annotations

import sys
from pathlib import Path

import click
from tqdm import tqdm

from .. import data
from ..tokenizer import KINDS
from .common import console, fmt_bytes, fmt_count, kv_table
from .options import FiniteFloat


class PrepareBar(data.PrepareReport):
    """A tqdm bar while text is encoded, then the summary table."""

    def __init__(self):
        self.bar = None

    def start(self, name, characters):
        self.bar = tqdm(total=characters, unit="char", unit_scale=True, desc=f"encoding {name}", leave=False,
                        disable=None, file=sys.stderr)

    def advance(self, characters):
        self.bar.update(characters)

    def done(self, meta):
        self.bar.close()
        summary(meta)


def summary(meta: dict) -> None:
    t = kv_table(f"prepared {meta['path']}")
    t.add_row("source", meta["source"])
    t.add_row("characters", f"{meta['characters']:,} ({fmt_bytes(meta['train_bytes'] + meta['val_bytes'])})")
    t.add_row("tokenizer", f"{meta['tokenizer']}, vocabulary {meta['vocab_size']:,}")
    t.add_row("tokens", f"train {meta['train_tokens']:,} · val {meta['val_tokens']:,} ({meta['dtype']})")
    t.add_row("bytes per token", f"{meta['bytes_per_token']:.2f}")
    t.add_row("time", f"{meta['seconds']:.2f}s ({fmt_count(meta['characters'] / max(meta['seconds'], 1e-9))} chars/s)")
    console.print(t)


@click.command()
@click.option("--data", "path", type=str, default=None, metavar="PATH",
              help="A text file, a folder of text files, or - for stdin. "
                   "Default: the Python reference documentation shipped with CPython.")
@click.option("--tokenizer", "kind", type=click.Choice(KINDS), default="char", show_default=True,
              help="char: one token per character; bpe: byte-level BPE, lossless on any text.")
@click.option("--vocab-size", type=click.IntRange(min=1, max=2 ** 32 - 1), default=None,
              help="BPE vocabulary size (default 1024). For char, a floor the alphabet must fit in.")
@click.option("--val-fraction", type=FiniteFloat(0, 1, max_open=True), default=0.1, show_default=True,
              help="Last fraction of the text kept for validation, cut at a line boundary.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output folder. Default: data/<name of the corpus>.")
@click.option("--force", is_flag=True, help="Replace an existing output folder.")
@click.option("--encoding", default="utf-8", show_default=True, help="Text encoding of the input.")
def prepare(path, kind, vocab_size, val_fraction, out, force, encoding):
    """Turn text into a dataset: a trained tokenizer and train/val token files.

    Writes tokenizer.json, train.bin, val.bin and meta.json into a temporary folder, then
    renames it into place: a failure leaves nothing half-written.

    \b
    Examples:
      tbp prepare                                   # built-in corpus -> data/pydoc
      tbp prepare --data input.txt --tokenizer bpe --vocab-size 2048
      cat *.md | tbp prepare --data - --out data/notes
    """
    data.prepare_corpus(path, out, kind, vocab_size, val_fraction, force, encoding, report=PrepareBar())
