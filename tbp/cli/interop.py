"""`tbp export` and `tbp import`: Hugging Face GPT-2 and Llama folders, and GGUF files out."""
from __future__ import annotations

from pathlib import Path

import click

from ..interop import gguf, hf
from ..runs import disk
from ..errors import TbpError
from .common import console, one_run, load_run


@click.command("export")
@click.argument("run", type=click.Path(exists=True, file_okay=False, path_type=Path), required=False)
@click.option("--checkpoint", "run_opt", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="The run, as the other commands take it; the same as RUN.")
@click.option("--format", "fmt", type=click.Choice(["hf", "gguf"]), default="hf", show_default=True,
              help="hf: a Hugging Face folder (config.json, model.safetensors, tokenizer.json), GPT-2's or, "
                   "for a model of Llama blocks, LlamaForCausalLM's; "
                   "gguf: one file llama.cpp runs (and Ollama, LM Studio), its tokenizer inside.")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="Output folder (hf), or file ending in .gguf (gguf).")
@click.option("--type", "kind", type=click.Choice(list(gguf.TYPES)), default="f32", show_default=True,
              help="gguf: how matrices are stored: f32 (exact), f16, or q8_0 (8-bit blocks of 32; "
                   "norms and biases stay f32).")
@click.option("--force", is_flag=True, help="Replace an existing --out that tbp wrote.")
@click.option("--best", is_flag=True, help="Export the best-validation weights.")
def export(run, run_opt, fmt, out, kind, force, best):
    """Write a run as a Hugging Face folder or a GGUF file.

    hf: a model of Llama blocks (--norm rms --mlp swiglu --positions rope --no-bias, an
    untied head without bias or a tied one) is written as LlamaForCausalLM; any other as
    GPT-2, which transformers.GPT2LMHeadModel.from_pretrained(OUT) loads. Models neither
    represents (ReLU, d_qk != d_v, an untied head with bias, rotary positions with a layer
    norm, the other designs) are refused.

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
        model, tok, _ = load_run(run, best=best)
        info = gguf.export_gguf(model, tok, out, kind, name=Path(run).resolve().name, force=force, inputs=(run,))
        console.print(f"exported {run} ({model.num_params():,} parameters) to {out}: llama.cpp architecture "
                      f"{info['architecture']}, {kind}, tokenizer {info['tokenizer']}, "
                      f"{info['bytes'] / 2**20:.1f} MiB")
        return
    model, tok, _ = load_run(run, best=best)
    family = hf.export_folder(model, tok, out, force, inputs=(run,))
    console.print(f"exported {run} ({model.num_params():,} parameters) to {out} as {family}")


@click.command("import")
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Run directory to create.")
@click.option("--force", is_flag=True, help="Replace an existing --out.")
def import_(src, out, force):
    """Read a local Hugging Face GPT-2 or Llama-family folder into a tbp checkpoint (no network).

    The folder needs config.json, model.safetensors and tokenizer.json. GPT-2: names with or
    without the "transformer." prefix. Llama (LlamaForCausalLM: SmolLM2, TinyLlama, Llama
    3.2): RMSNorm, SwiGLU, rotary positions, grouped-query attention; bfloat16 and float16
    weights widen to float32 exactly; rope scaling and sliding windows are refused. The result
    works with tbp generate and with tbp train --init-from (full or LoRA fine-tuning).

    \b
    Example:
      tbp import ~/models/gpt2 --out checkpoints/gpt2
      tbp generate --checkpoint checkpoints/gpt2 --prompt "Hello" --top-k 40
    """
    model, _, family = hf.import_folder(src, out, force)
    c = model.config
    console.print(f"imported {src} ({family}): {c.n_layer} layers, {c.n_head} heads, d_model {c.d_model}, context {c.n_ctx}, "
                  f"vocabulary {c.vocab_size} ({model.num_params():,} parameters) into {out}")
