"""`tbp export` and `tbp import`: Hugging Face GPT-2 folders, and GGUF files out."""
from __future__ import annotations

from pathlib import Path

import click

from ..interop import gguf, hf
from ..runs import disk
from ..errors import TbpError
from .common import console, one_run


@click.command("export")
@click.argument("run", type=click.Path(exists=True, file_okay=False, path_type=Path), required=False)
@click.option("--checkpoint", "run_opt", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="The run, as the other commands take it; the same as RUN.")
@click.option("--format", "fmt", type=click.Choice(["hf", "gguf"]), default="hf", show_default=True,
              help="hf: a Hugging Face GPT-2 folder (config.json, model.safetensors, tokenizer.json); "
                   "gguf: one file llama.cpp runs (and Ollama, LM Studio), its tokenizer inside.")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="Output folder (hf), or file ending in .gguf (gguf).")
@click.option("--type", "kind", type=click.Choice(list(gguf.TYPES)), default="f32", show_default=True,
              help="gguf: how matrices are stored: f32 (exact), f16, or q8_0 (8-bit blocks of 32; "
                   "norms and biases stay f32).")
@click.option("--force", is_flag=True, help="Replace an existing --out that tbp wrote.")
@click.option("--best", is_flag=True, help="Export the best-validation weights.")
def export(run, run_opt, fmt, out, kind, force, best):
    """Write a run as a Hugging Face GPT-2 folder or a GGUF file.

    hf: transformers.GPT2LMHeadModel.from_pretrained(OUT) loads it, and so does anything
    that reads GPT-2 safetensors. Models GPT-2 cannot represent (ReLU, d_qk != d_v, an
    untied head with bias, no biases, rotary positions, the designs) are refused.

    gguf: llama.cpp's gpt2 architecture (learned positions) or gptneox (rotary positions),
    grouped-query attention included; models no llama.cpp architecture computes exactly (ReLU,
    an untied head with bias, Multi-Token Attention, Attention Residuals, the encoder-decoder)
    are refused.

    \b
    Examples:
      tbp export checkpoints/pydoc --format hf --out export/pydoc-gpt2
      tbp export checkpoints/pydoc --format gguf --type q8_0 --out export/pydoc.gguf
    """
    if fmt == "hf" and kind != "f32":
        raise click.UsageError("--type is for --format gguf (a Hugging Face folder holds float32)")
    run = one_run(run, run_opt)
    if disk.read_config(run).get("lora"):
        raise TbpError(f"{run} is a LoRA run: fold it first with tbp merge {run} --out DIR, then export that")
    if fmt == "gguf":
        gguf.claim(out, force, inputs=(run,))
        model, tok, _ = disk.load_model(run, best=best)
        info = gguf.export_gguf(model, tok, out, kind, name=Path(run).resolve().name, force=force, inputs=(run,))
        console.print(f"exported {run} ({model.num_params():,} parameters) to {out}: llama.cpp architecture "
                      f"{info['architecture']}, {kind}, tokenizer {info['tokenizer']}, "
                      f"{info['bytes'] / 2**20:.1f} MiB")
        return
    hf.claim_export_output(out, force, inputs=(run,))
    model, tok, _ = disk.load_model(run, best=best)
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
