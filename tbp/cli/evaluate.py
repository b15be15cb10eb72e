"""`tbp eval`: a run's loss on a dataset's validation split, and exact match on pairs."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import click

from ..machine import memory
from ..data.datasets import Dataset
from ..errors import TbpError
from ..train.evaluate import evaluate
from .common import console, fmt_loss, kv_table, the_run, load_run
from .options import refuse_unused


@click.command("eval")
@click.option("--checkpoint", "run", type=click.Path(path_type=Path), default=None,
              help="Run directory. Default: TBP_CHECKPOINT, else the newest run under checkpoints/ that did not abort (tbp runs).")
@click.option("--data", "data_dir", type=click.Path(path_type=Path), default=None,
              help="A prepared dataset folder. Default: the one the run trained on.")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Exact match on the first N validation examples only (pairs).")
@click.option("--best", is_flag=True, help="Use the weights with the best validation loss.")
@click.option("--zero-encoder", is_flag=True,
              help="Encoder-decoder: zero the encoder's output first (an ablation: a decoder that "
                   "reads its source falls to chance).")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Sequences per forward. Default: the run's training batch size, so that the figure is the one "
                   "training reported and the memory within what training needed.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object on stdout.")
def evaluate_cmd(run, data_dir, limit, best, zero_encoder, batch_size, as_json):
    """Evaluate a run on the validation split of a dataset.

    Loss per token and bits per byte over the whole split (every window of a text dataset;
    every example of a pairs dataset, on its target tokens), and for pairs the exact-match
    accuracy of greedy completions with the KV cache.

    \b
    Examples:
      tbp eval --checkpoint checkpoints/reverse
      tbp eval --checkpoint checkpoints/reverse --zero-encoder --json
    """
    run = the_run(run)
    model, tok, cfg = load_run(run, best=best)
    if data_dir is None:
        if not cfg.get("data"):
            raise TbpError(f"{run / 'config.json'}: names no dataset; pass --data")
        data_dir = Path(cfg["data"])
    ds = Dataset.load(data_dir)
    if ds.kind != "pairs":
        refuse_unused(click.get_current_context(), ("limit",), "a pairs dataset (exact match on its examples)")
    if ds.tokenizer.sha256() != tok.sha256():
        raise TbpError(f"{ds.path}: its tokenizer differs from the one {run} was trained with")
    if zero_encoder:
        if not model.reads_source:
            raise click.UsageError("--zero-encoder is for an encoder-decoder run")
        model.source_scale = 0.0
    batch_size = batch_size or (cfg.get("train") or {}).get("batch_size") or 32
    memory.check_fits(memory.eval_bytes(model.config, batch_size, model.dtype),
                      f"evaluating {run} at --batch-size {batch_size}")
    t0 = time.perf_counter()
    with console.status(f"evaluating {run} on the validation split of {ds.path}..."):
        out = evaluate(model, ds, limit, batch_size)
    if not math.isfinite(out["val_loss"]):
        # the weights load finite, but the forward overflows float32 somewhere: say so, not NaN
        raise TbpError(f"{run}: the model's loss on {ds.path} is {out['val_loss']} (its forward overflows "
                       f"float32: the weights are damaged or far out of range)")
    out.update(checkpoint=str(run), data=str(ds.path), split="val", seconds=round(time.perf_counter() - t0, 3),
               zero_encoder=zero_encoder)
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    t = kv_table(f"{run} on {ds.path} (validation)" + (", encoder zeroed" if zero_encoder else ""))
    t.add_row("loss", f"{fmt_loss(out['val_loss'])} per token over {out['val_tokens']:,} tokens "
                      f"({out['val_bpb']:.3f} bits/byte)")
    if "token_accuracy" in out:
        t.add_row("next token", f"{100 * out['token_accuracy']:.1f}% of target tokens ranked first "
                                f"(given the true ones before; chance is 1/{model.config.vocab_size})")
    if "exact_match" in out:
        t.add_row("exact match", f"{100 * out['exact_match']:.1f}% of {out['examples']:,} examples "
                                 f"(greedy, to <|endoftext|>)")
    t.add_row("time", f"{out['seconds']:.2f}s")
    console.print(t)
