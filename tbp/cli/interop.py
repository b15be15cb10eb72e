"""`tbp export` and `tbp import`: Hugging Face GPT-2 folders."""
from __future__ import annotations

from pathlib import Path

import click

from .. import checkpoint, hf
from ..errors import TbpError
from .common import console


@click.command("export")
@click.argument("run", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["hf"]), default="hf", show_default=True,
              help="hf: a Hugging Face GPT-2 folder (config.json, model.safetensors, tokenizer.json).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Output folder.")
@click.option("--force", is_flag=True, help="Replace an existing --out.")
@click.option("--best", is_flag=True, help="Export the best-validation weights.")
def export(run, fmt, out, force, best):
    """Write a run as a Hugging Face GPT-2 folder.

    transformers.GPT2LMHeadModel.from_pretrained(OUT) loads it, and so does anything that
    reads GPT-2 safetensors. Models GPT-2 cannot represent (ReLU, d_qk != d_v, an untied
    head with bias, no biases) are refused.

    \b
    Example:
      tbp export checkpoints/pydoc --format hf --out export/pydoc-gpt2
    """
    if checkpoint.read_config(run).get("lora"):
        raise TbpError(f"{run} is a LoRA run: fold it first with tbp merge {run} --out DIR, then export that")
    hf.claim_export_output(out, force, inputs=(run,))
    model, tok, _ = checkpoint.load_model(run, best=best)
    hf.export_hf(model, tok, out, force, inputs=(run,))
    console.print(f"exported {run} ({model.num_params():,} parameters) to {out} as GPT-2")


@click.command("import")
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Run directory to create.")
@click.option("--force", is_flag=True, help="Replace an existing --out.")
def import_(src, out, force):
    """Read a local Hugging Face GPT-2 folder into a tbp checkpoint (no network).

    The folder needs config.json, model.safetensors (names with or without the
    "transformer." prefix) and tokenizer.json. The result works with tbp generate and with
    tbp train --init-from (full or LoRA fine-tuning).

    \b
    Example:
      tbp import ~/models/gpt2 --out checkpoints/gpt2
      tbp generate --checkpoint checkpoints/gpt2 --prompt "Hello" --top-k 40
    """
    model, _ = hf.import_hf(src, out, force)
    c = model.config
    console.print(f"imported {src}: {c.n_layer} layers, {c.n_head} heads, d_model {c.d_model}, context {c.n_ctx}, "
                  f"vocabulary {c.vocab_size} ({model.num_params():,} parameters) into {out}")
