"""`tbp chat`: a conversation with a model trained on a chat dataset."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import numpy as np

from ..data.chat import read_conversations
from ..generate.conversation import Conversation
from ..errors import TbpError
from ..generate.sampling import Sampling
from .common import console, the_run, load_run
from .options import FiniteFloat
from .speculation import speculation_options


@click.command()
@click.option("--checkpoint", "run", type=click.Path(path_type=Path), default=None,
              help="Run directory. Default: TBP_CHECKPOINT, else the newest chat run under checkpoints/ that did not abort (tbp runs).")
@click.option("--system", default=None, help="A system message: the instruction the model keeps to.")
@click.option("--messages", "messages_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Non-interactive: a JSON-lines file of conversations; each one's user messages are "
                   "answered in turn and the conversations, replies filled in, printed as JSON lines.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Longest reply (at most half the context).")
@click.option("--temperature", type=FiniteFloat(min=0), default=0.8, show_default=True,
              help="Softmax temperature; 0 is greedy.")
@click.option("--top-k", type=click.IntRange(min=1), default=None, help="Sample from the k most likely tokens only.")
@click.option("--top-p", type=FiniteFloat(0, 1, min_open=True), default=None,
              help="Nucleus sampling: the smallest set with mass p.")
@click.option("--min-p", type=FiniteFloat(0, 1), default=None,
              help="Only tokens at least p times as likely as the likeliest (llama.cpp's min-p, before the "
                   "temperature).")
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help="Make the replies repeatable (each conversation starts from this seed).")
@click.option("--best", is_flag=True, help="Use the weights with the best validation loss.")
@speculation_options
def chat(run, system, messages_file, max_new_tokens, temperature, top_k, top_p, min_p, seed, best, speculation=None):
    """Talk with a model trained on conversations (tbp prepare --format chat).

    Each line on stdin is a user message; the reply streams to stdout. The KV cache is kept
    across turns, so the history is never re-read; when the context fills up, the oldest
    turns are dropped (the system message is kept) and the cache refilled. Ctrl-D ends.

    \b
    Examples:
      tbp chat --checkpoint checkpoints/dialogue --system "Reply in upper case."
      printf 'hello\\nwhat is the sky?\\n' | tbp chat --seed 1
      tbp chat --messages held-out.jsonl --temperature 0 > replies.jsonl
    """
    run = the_run(run, ("chat",))
    model, tok, _ = load_run(run, best=best)
    sampling = Sampling(temperature, top_k, top_p, min_p=min_p)
    drafter = speculation.drafter(model, tok, run) if speculation is not None else None
    if messages_file is not None:
        _answer_file(model, tok, messages_file, system, sampling, seed, max_new_tokens, drafter)
        return
    talk = Conversation(model, tok, system, sampling, np.random.default_rng(seed), max_new_tokens, drafter)
    interactive = sys.stdin.isatty()
    if interactive:
        console.print(f"[dim]{run} · Ctrl-D to end[/]")
    out, refused, n = sys.stdout, 0, 0
    while True:
        if interactive:
            print("you> ", end="", file=sys.stderr, flush=True)
        raw = sys.stdin.buffer.readline()     # bytes: an undecodable one is named, not a traceback
        if not raw:
            break
        n += 1
        text = raw.decode("utf-8", errors="surrogateescape").rstrip("\r\n")
        if not text.strip():
            continue
        refills = talk.refills
        try:
            for piece in talk.reply(text, "message" if interactive else f"stdin:{n}"):
                out.write(piece)
                out.flush()
        except TbpError as e:                 # the message was not taken; the conversation is kept
            refused += 1
            console.print(f"[red]{e}[/] [dim](not sent; the conversation goes on)[/]")
            continue
        out.write("\n")
        out.flush()
        if talk.refills > refills:
            console.print("[dim]the context filled up: the oldest turns were dropped[/]")
    if interactive:
        print(file=sys.stderr)
    if drafter is not None and talk.tally.forwards:
        console.print(f"[dim]{drafter.describe()}: {talk.tally.summary()}[/]")
    if not interactive and refused:
        raise TbpError(f"stdin: {refused} message(s) refused (named above); the others were answered")


def _answer_file(model, tok, path, system, sampling, seed, max_new_tokens, drafter=None) -> None:
    """--messages: every conversation checked first (each refusal names the file and line), then
    each one's user messages answered in turn, printed as JSON lines."""
    convs, _, where, lines = read_conversations(path, need_reply=False)
    for conv, n in zip(convs, lines):
        for k, m in enumerate(conv, 1):
            if m["role"] != "assistant":                 # replies are the model's, made anew
                tok.check(m["content"], f"{where}:{n}: message {k}")
    for conv, n in zip(convs, lines):
        has_system = conv[0]["role"] == "system"
        try:
            talk = Conversation(model, tok, conv[0]["content"] if has_system else system, sampling,
                                np.random.default_rng(seed), max_new_tokens,
                                drafter.fresh() if drafter is not None else None)
        except TbpError as e:
            raise TbpError(f"{where}:{n}: {e}") from None
        for k, m in enumerate(conv[1:] if has_system else conv, 1 + has_system):
            if m["role"] == "user":
                for _ in talk.reply(m["content"], f"{where}:{n}: message {k}"):
                    pass
        click.echo(json.dumps({"messages": talk.messages}, ensure_ascii=False))
