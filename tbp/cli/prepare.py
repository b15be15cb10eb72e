"""`tbp prepare`: text -> tokenizer -> train.bin / val.bin."""
from __future__ import annotations

import sys
from pathlib import Path

import click
from tqdm import tqdm

from ..data import datasets
from ..data.chat import LOSSES, prepare_chat, read_conversations
from ..data.pairs import (MAX_TASK_EXAMPLES, MAX_TASK_LEN, TASK_EXAMPLES, TASK_VAL_FRACTION, TASKS, make_task,
                          prepare_pairs, read_pairs)
from ..data.tokenizer import TOKENIZERS, Tokenizer
from .common import console, fmt_bytes, fmt_count, kv_table
from click.core import ParameterSource

from ..data.texts import DEFAULT_SAMPLE
from .options import ByteSize, FiniteFloat, refuse_unused, text_encoding


class PrepareBar(datasets.PrepareReport):
    """A tqdm bar for each pass over the input (bytes, with rate and ETA), then the summary."""

    def __init__(self):
        self.bar = None

    def _open(self, **kw):
        if self.bar is not None:
            self.bar.close()
        self.bar = tqdm(leave=False, disable=None, file=sys.stderr, unit_scale=True, **kw)

    def start(self, name, characters):
        self._open(total=characters, unit="char", desc=f"encoding {name}")

    def phase(self, what, total_bytes):
        self._open(total=total_bytes, unit="B", unit_divisor=1024, desc=what)

    def advance(self, amount):
        if self.bar is not None:
            self.bar.update(amount)

    def done(self, meta):
        if self.bar is not None:
            self.bar.close()
        summary(meta)


def vocabulary(meta: dict) -> str:
    """"vocabulary N", and why where a BPE's training stopped short of the size asked."""
    got, asked = meta["vocab_size"], meta.get("vocab_size_asked")
    if asked is not None and got < asked:
        return (f"vocabulary {got:,} of the {asked:,} asked: the text has no pair of tokens left to merge "
                f"(more text, or a smaller --vocab-size)")
    return f"vocabulary {got:,}"


def summary(meta: dict) -> None:
    if meta.get("kind") == "pairs":
        return pairs_summary(meta)
    if meta.get("kind") == "chat":
        return chat_summary(meta)
    t = kv_table(f"prepared {meta['path']}")
    t.add_row("source", meta["source"])
    t.add_row("characters", f"{meta['characters']:,} ({fmt_bytes(meta['train_bytes'] + meta['val_bytes'])})")
    t.add_row("tokenizer", f"{meta['tokenizer']}, {vocabulary(meta)}")
    t.add_row("tokens", f"train {meta['train_tokens']:,} · val {meta['val_tokens']:,} ({meta['dtype']})")
    t.add_row("bytes per token", f"{meta['bytes_per_token']:.2f}")
    if meta.get("tokenizer_sample", {}).get("every", 1) > 1:
        sample = meta["tokenizer_sample"]
        t.add_row("tokenizer sample", f"1 chunk of {sample['chunk_characters']:,} characters in {sample['every']} "
                                      f"of the training split (--tokenizer-sample)")
    if meta.get("seams"):
        t.add_row("seams", f"{meta['seams']} (stretches of 2 M characters with no line break or space)")
    t.add_row("time", f"{meta['seconds']:.2f}s ({fmt_count(meta['characters'] / max(meta['seconds'], 1e-9))} chars/s)")
    console.print(t)


def pairs_rows(t, meta: dict) -> None:
    """The rows that describe a pairs dataset (prepare's summary and tbp info)."""
    task = meta.get("task")
    if task:
        t.add_row("task", f"{task['name']}: digit strings of length {task['min_len']}..{task['max_len']}, "
                          f"seed {task['seed']}")
    else:
        t.add_row("source", meta["source"])
    t.add_row("examples", f"train {meta['train_examples']:,} · val {meta['val_examples']:,} (kept whole)")
    t.add_row("longest", f"source {meta['max_source_tokens']} · target {meta['max_target_tokens']} · "
                         f"both {meta['max_example_tokens']} tokens")
    t.add_row("tokenizer", f"{meta['tokenizer']}, {vocabulary(meta)} (with <|sep|> "
                           f"{meta['sep_id']}, <|endoftext|> {meta['eot_id']}, <|pad|> {meta['pad_id']})")


def chat_summary(meta: dict) -> None:
    t = kv_table(f"prepared {meta['path']} (conversations)")
    t.add_row("source", meta["source"])
    t.add_row("conversations", f"train {meta['train_examples']:,} · val {meta['val_examples']:,} (one per row)")
    loss = {"assistant": "every assistant reply", "last": "the last reply only", "all": "every token"}[meta["loss"]]
    t.add_row("loss", loss + (" · Ghost Attention: the instruction once, at the start" if meta["ghost_attention"] else ""))
    longest = f"{meta['max_example_tokens']} tokens"
    if meta.get("max_tokens"):
        longest += f" (--max-tokens {meta['max_tokens']}: {meta['cut']} cut after a whole reply, {meta['dropped']} dropped)"
    t.add_row("longest", longest)
    specials = ("ChatML's <|im_start|> <|im_end|>" if meta.get("template") == "chatml" else
                "<|system|> <|user|> <|assistant|> <|end|> <|endoftext|> <|pad|>")
    t.add_row("tokenizer", f"{meta['tokenizer']}, {vocabulary(meta)} (with {specials})")
    t.add_row("time", f"{meta['seconds']:.2f}s")
    console.print(t)


def pairs_summary(meta: dict) -> None:
    t = kv_table(f"prepared {meta['path']} (pairs)")
    pairs_rows(t, meta)
    t.add_row("time", f"{meta['seconds']:.2f}s")
    console.print(t)


@click.command()
@click.option("--data", "path", type=str, default=None, metavar="PATH",
              help="A text file, a folder of text files, or - for stdin; with --format pairs, one file "
                   "of source<TAB>target lines or JSON lines {\"source\": ..., \"target\": ...}. "
                   "Default: the Python reference documentation shipped with CPython.")
@click.option("--format", "fmt", type=click.Choice(("text", "pairs", "chat")), default="text", show_default=True,
              help="text: one corpus, cut into windows; pairs: source -> target examples, kept whole, "
                   "the loss on the targets; chat: conversations (JSON lines of {\"messages\": [...]}), "
                   "one per row, the loss on the replies.")
@click.option("--loss", type=click.Choice(LOSSES), default=None,
              help="Chat: the tokens the loss is on: every assistant reply (default), the last reply "
                   "only (the default with --ghost-attention), or all tokens.")
@click.option("--ghost-attention", is_flag=True,
              help="Chat: Llama 2's Ghost Attention data -- the system instruction once, at the start "
                   "(removed from user messages that still carry it), the loss on the last reply.")
@click.option("--max-tokens", type=click.IntRange(min=4), default=None,
              help="Chat: cut each conversation after its last whole reply that fits in this many "
                   "tokens (never inside a message); one whose first reply does not fit is dropped.")
@click.option("--task", type=click.Choice(tuple(TASKS)), default=None,
              help="A built-in pairs task instead of --data: digit strings and their reversal, sorted "
                   "digits, or a copy.")
@click.option("--examples", type=click.IntRange(2, MAX_TASK_EXAMPLES), default=TASK_EXAMPLES, show_default=True,
              help="With --task: distinct source strings to make.")
@click.option("--min-len", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --task: shortest string.")
@click.option("--max-len", type=click.IntRange(1, MAX_TASK_LEN), default=12, show_default=True,
              help="With --task: longest string.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="With --task: the draw.")
@click.option("--tokenizer", "tokenizer_kind", type=click.Choice(TOKENIZERS), default="char", show_default=True,
              help="char: one token per character; bpe: byte-level BPE, lossless on any text.")
@click.option("--vocab-size", type=click.IntRange(min=1, max=2 ** 32 - 1), default=None,
              help="BPE vocabulary size (default 1024). For char, a floor the alphabet must fit in.")
@click.option("--val-fraction", type=FiniteFloat(0, 1, min_open=True, max_open=True), default=None,
              help="Last fraction of the text kept for validation, cut at a line boundary (pairs: of "
                   f"the examples). Default 0.1; {TASK_VAL_FRACTION} with --task.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output folder. Default: data/<name of the corpus>.")
@click.option("--tokenizer-from", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Pairs and chat: reuse the tokenizer of this run or dataset folder (it must have the "
                   "format's special tokens) instead of training one.")
@click.option("--force", is_flag=True, help="Replace an existing output folder.")
@click.option("--text-field", default=None, metavar="NAME",
              help="JSON lines (.jsonl, .ndjson) and Parquet: the field holding each document's text "
                   "[default: text].")
@click.option("--tokenizer-sample", type=ByteSize(), default=None, metavar="SIZE",
              help=f"BPE: train the tokenizer on at most this much of the training text (an evenly "
                   f"spread sample of whole-line chunks), e.g. 64M, 1G [default: "
                   f"{DEFAULT_SAMPLE >> 20}M characters].")
@click.option("--encoding", default="utf-8", show_default=True, callback=text_encoding,
              help="Text encoding of the input (any Python codec name: latin-1, utf-16, cp1252 ...).")
def prepare(path, fmt, loss, ghost_attention, max_tokens, task, examples, min_len, max_len, seed, tokenizer_kind,
            vocab_size, val_fraction, out, tokenizer_from, force, text_field, tokenizer_sample, encoding):
    """Turn text into a dataset: a trained tokenizer and train/val token files.

    Writes tokenizer.json, train.bin, val.bin and meta.json (pairs: also train.idx and
    val.idx, each example's lengths) into a temporary folder, then renames it into place: a
    failure leaves nothing half-written.

    \b
    Examples:
      tbp prepare                                   # built-in corpus -> data/pydoc
      tbp prepare --data input.txt --tokenizer bpe --vocab-size 2048
      cat *.md | tbp prepare --data - --out data/notes
      tbp prepare --format pairs --data questions.tsv
      tbp prepare --task reverse                    # 20,000 digit strings -> data/reverse
    """
    ctx = click.get_current_context()
    tokenizer = None
    if tokenizer_from is not None:
        if task is None and fmt == "text":
            raise click.UsageError("--tokenizer-from is for pairs and conversations (--format pairs|chat, --task)")
        if ctx.get_parameter_source("tokenizer_kind") is not ParameterSource.DEFAULT or vocab_size is not None:
            raise click.UsageError("--tokenizer and --vocab-size choose a tokenizer to train; "
                                   "--tokenizer-from reuses one: give one or the other")
        tokenizer = Tokenizer.load(tokenizer_from / "tokenizer.json")
    if task is None:
        refuse_unused(ctx, ("examples", "min_len", "max_len", "seed"), "--task")
    if task is not None or fmt != "text":
        refuse_unused(ctx, ("text_field", "tokenizer_sample"), "--format text")
    if task is not None or fmt != "chat":
        if loss or ghost_attention or max_tokens:
            raise click.UsageError("--loss, --ghost-attention and --max-tokens are for --format chat")
    if task is not None:
        if path is not None:
            raise click.UsageError("give --data or --task, not both")
        if fmt == "chat" or ctx.get_parameter_source("encoding") is not ParameterSource.DEFAULT:
            raise click.UsageError("--task makes pairs of digit strings: --format chat and --encoding do not apply")
        if min_len > max_len:
            raise click.UsageError(f"--min-len {min_len} is longer than --max-len {max_len}")
        pairs = make_task(task, examples, min_len, max_len, seed)
        origin = {"name": task, "examples": examples, "min_len": min_len, "max_len": max_len, "seed": seed}
        prepare_pairs(pairs, task, f"task:{task}", out, tokenizer_kind, vocab_size,
                      TASK_VAL_FRACTION if val_fraction is None else val_fraction, force,
                      tokenizer=tokenizer, report=PrepareBar(), origin=origin)
        return
    val_fraction = 0.1 if val_fraction is None else val_fraction
    if fmt != "chat" and (loss or ghost_attention or max_tokens):
        raise click.UsageError("--loss, --ghost-attention and --max-tokens are for --format chat")
    if fmt == "chat":
        if path is None:
            raise click.UsageError("--format chat needs --data FILE (JSON lines of conversations)")
        convs, name, source, _ = read_conversations(path, encoding)
        prepare_chat(convs, name, source, out, tokenizer_kind, vocab_size, val_fraction, force, loss, ghost_attention,
                     max_tokens, tokenizer=tokenizer, report=PrepareBar())
        return
    if fmt == "pairs":
        if path is None:
            raise click.UsageError("--format pairs needs --data FILE (or a built-in --task)")
        pairs, name, source, lines = read_pairs(path, encoding)
        prepare_pairs(pairs, name, source, out, tokenizer_kind, vocab_size, val_fraction, force, tokenizer=tokenizer,
                      report=PrepareBar(), lines=lines)
        return
    if tokenizer_kind != "bpe":
        refuse_unused(ctx, ("tokenizer_sample",), "--tokenizer bpe")
    datasets.prepare_corpus(path, out, tokenizer_kind, vocab_size, val_fraction, force, encoding, report=PrepareBar(),
                        text_field=text_field, tokenizer_sample=tokenizer_sample or DEFAULT_SAMPLE)
