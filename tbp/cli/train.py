"""`tbp train`: options, the progress bar, Ctrl-C, and the summary."""
from __future__ import annotations

import json
import math
import signal
import sys
from pathlib import Path

import click
from click.core import ParameterSource
from rich.table import Table
from tqdm import tqdm

from .. import runs
from ..checkpoint import read_config
from ..config import ModelConfig, TrainConfig
from ..nn import LORA_TARGETS
from ..tokenizer import KINDS, Tokenizer
from ..train import Callbacks
from .common import console, fmt_count
from .prepare import run_prepare

MODEL_KEYS = ("n_layer", "n_head", "d_model", "n_ctx", "d_qk", "bias", "activation", "tie_head", "ln_eps")
TRAIN_KEYS = tuple(TrainConfig.__dataclass_fields__)
DEFAULT_MODEL = dict(n_layer=4, n_head=4, d_model=128, n_ctx=128)


def _load_config_file(ctx, param, value):
    """--config FILE: a JSON object of option values (nested "model"/"train" objects allowed,
    so a run's own config.json works); options on the command line still win."""
    if value is None:
        return None
    try:
        obj = json.loads(Path(value).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise click.BadParameter(f"{value}: {e}", ctx, param) from None
    flat = {}
    for k, v in obj.items():
        if k in ("model", "train") and isinstance(v, dict):
            flat.update(v)
        elif k not in ("format", "data", "lora", "base", "init_from"):
            flat[k] = v
    names = {p.name for p in ctx.command.params}
    derived = ("vocab_size", "causal")      # set by the data and the engine, not by options
    unknown = [k for k in flat if k.replace("-", "_") not in names and k not in derived]
    if unknown:
        raise click.BadParameter(f"{value}: unknown keys {', '.join(unknown)}", ctx, param)
    ctx.default_map = {**(ctx.default_map or {}),
                       **{k.replace("-", "_"): v for k, v in flat.items() if k not in derived}}
    return value


def _given(ctx, name: str) -> bool:
    return ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT,
                                              ParameterSource.DEFAULT_MAP)


class Progress(Callbacks):
    """A tqdm bar on stderr plus one line per eval."""

    def __init__(self, quiet: bool = False):
        self.bar = None
        self.quiet = quiet
        self.first = True

    def start(self, trainer):
        cfg = trainer.cfg
        self.bar = tqdm(total=cfg.max_iters, initial=trainer.state.step, unit="step", file=sys.stderr,
                        dynamic_ncols=True, disable=self.quiet or None, desc="train")
        V = trainer.model.config.vocab_size
        self.expected = math.log(V)
        n = trainer.model.num_params()
        ntrain = sum(trainer.model.params[k].size for k in trainer.model.grads)
        what = f"{fmt_count(n)} parameters" + (f", {fmt_count(ntrain)} trainable (LoRA)" if trainer.adapter else "")
        tqdm.write(f"{what} · {trainer.data.meta['train_tokens']:,} train tokens · vocabulary {V} · "
                   f"run {trainer.run}", file=sys.stderr)

    def step(self, trainer, m):
        if self.first and trainer.state.step == 1:
            tqdm.write(f"step 1: loss {m['train_loss']:.4f} (expected at init: ln V = {self.expected:.4f})",
                       file=sys.stderr)
        self.first = False
        post = {"loss": f"{m['train_loss']:.4f}", "lr": f"{m['lr']:.2e}"}
        if "tokens_per_s" in m:
            self.tok_s = m["tokens_per_s"]
        if getattr(self, "tok_s", None):
            post["tok/s"] = fmt_count(self.tok_s)
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)
        if "val_loss" in m:
            tqdm.write(f"step {m['step']}: train {m['eval_train_loss']:.4f} · val {m['val_loss']:.4f} "
                       f"({m['val_bpb']:.3f} bits/byte) · lr {m['lr']:.2e} · {fmt_count(m['tokens_per_s'])} tok/s",
                       file=sys.stderr)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _install_sigint(trainer):
    def handler(signum, frame):
        if not trainer.stop_requested:
            trainer.stop_requested = True
            tqdm.write("Ctrl-C: finishing this step and saving (press again to quit at once)", file=sys.stderr)
        elif trainer.saving:
            trainer.hard_stop = True          # quit as soon as the files being written are complete
        else:
            raise KeyboardInterrupt
    return signal.signal(signal.SIGINT, handler)


def _summary(trainer, state, interrupted: bool):
    t = Table(title="interrupted: saved, resume with --resume" if interrupted else "training finished",
              show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("steps", f"{state.step:,} / {trainer.cfg.max_iters:,}")
    last = _last_eval(trainer.run)
    if last:
        t.add_row("final val loss", f"{last['val_loss']:.4f} ({last['val_bpb']:.3f} bits/byte) at step {last['step']}")
    if state.best_val_loss is not None:
        t.add_row("best val loss", f"{state.best_val_loss:.4f} at step {state.best_step}")
    t.add_row("tokens seen", f"{state.tokens_seen:,}")
    t.add_row("time", f"{state.elapsed_s:.1f}s ({fmt_count(state.tokens_seen / max(state.elapsed_s, 1e-9))} tok/s)")
    t.add_row("checkpoint", str(trainer.run))
    t.add_row("next", f"tbp generate --checkpoint {trainer.run}" if not interrupted
              else f"tbp train --out {trainer.run} --resume")
    console.print(t)


def _last_eval(run: Path):
    last = None
    path = run / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                m = json.loads(line)
            except ValueError:
                continue
            if "val_loss" in m:
                last = m
    return last


def _model_options(f):
    opts = [
        click.option("--n-layer", type=click.IntRange(1, 96), default=DEFAULT_MODEL["n_layer"], show_default=True,
                     help="Transformer blocks."),
        click.option("--n-head", type=click.IntRange(1, 128), default=DEFAULT_MODEL["n_head"], show_default=True,
                     help="Attention heads per block."),
        click.option("--d-model", type=click.IntRange(1, 16384), default=DEFAULT_MODEL["d_model"],
                     show_default=True, help="Width of the residual stream (divisible by --n-head)."),
        click.option("--n-ctx", type=click.IntRange(2, 65536), default=DEFAULT_MODEL["n_ctx"], show_default=True,
                     help="Context length: tokens per training sequence."),
        click.option("--d-qk", type=click.IntRange(1, 4096), default=None,
                     help="Query/key width per head (default d_model / n_head)."),
        click.option("--bias/--no-bias", default=True, show_default=True, help="Biases in linear and norm layers."),
        click.option("--activation", type=click.Choice(["gelu", "relu"]), default="gelu", show_default=True,
                     help="MLP nonlinearity (gelu is GPT-2's tanh approximation)."),
        click.option("--tie-head/--untie-head", default=True, show_default=True,
                     help="Output head tied to the token embedding, or a separate layer with bias."),
        click.option("--ln-eps", type=click.FloatRange(min=0), default=1e-5, show_default=True,
                     help="Layer norm epsilon."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _train_options(f):
    d = TrainConfig()
    opts = [
        click.option("--batch-size", type=click.IntRange(min=1), default=d.batch_size, show_default=True),
        click.option("--grad-accum", type=click.IntRange(min=1), default=d.grad_accum, show_default=True,
                     help="Micro-batches per optimizer step."),
        click.option("--max-iters", type=click.IntRange(min=1), default=d.max_iters, show_default=True,
                     help="Optimizer steps (with --resume: the new total)."),
        click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=d.lr, show_default=True,
                     help="Peak learning rate."),
        click.option("--min-lr", type=click.FloatRange(min=0), default=d.min_lr, show_default=True,
                     help="Learning rate at the end of the cosine decay."),
        click.option("--warmup", type=click.IntRange(min=0), default=d.warmup, show_default=True,
                     help="Linear warmup steps."),
        click.option("--lr-decay-iters", type=click.IntRange(min=1), default=None,
                     help="Steps over which the cosine decays (default: --max-iters)."),
        click.option("--weight-decay", type=click.FloatRange(min=0), default=d.weight_decay, show_default=True,
                     help="AdamW weight decay, applied to matrices only."),
        click.option("--beta1", type=click.FloatRange(0, 1, max_open=True), default=d.beta1, show_default=True),
        click.option("--beta2", type=click.FloatRange(0, 1, max_open=True), default=d.beta2, show_default=True),
        click.option("--grad-clip", type=click.FloatRange(min=0), default=d.grad_clip, show_default=True,
                     help="Clip the global gradient norm to this (0: off)."),
        click.option("--eval-interval", type=click.IntRange(min=1), default=d.eval_interval, show_default=True,
                     help="Steps between evaluations and checkpoints."),
        click.option("--eval-batches", type=click.IntRange(min=1), default=d.eval_batches, show_default=True,
                     help="Fixed batches per split in each evaluation."),
        click.option("--log-interval", type=click.IntRange(min=1), default=d.log_interval, show_default=True,
                     help="Steps between lines of metrics.jsonl."),
        click.option("--seed", type=click.IntRange(min=0), default=d.seed, show_default=True,
                     help="Seeds initialisation, batch order and eval batches."),
        click.option("--dtype", type=click.Choice(["float32", "float64"]), default=d.dtype, show_default=True),
        click.option("--threads", type=click.IntRange(min=0), default=d.threads, show_default=True,
                     help="Threads that each run forward and backward on a share of the batch "
                          "(0: one per core). A run repeats bit for bit at a given count."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@click.command()
@click.option("--config", type=click.Path(exists=True, dir_okay=False), callback=_load_config_file,
              is_eager=True, expose_value=False, help="JSON file of option values (a run's config.json works).")
@click.option("--data", "data_arg", default=None, metavar="DIR|FILE",
              help="A prepared dataset folder, or text (file or folder) prepared on the fly. "
                   "Default: the built-in corpus.")
@click.option("--tokenizer", "kind", type=click.Choice(KINDS), default="char", show_default=True,
              help="Tokenizer for text prepared on the fly (new runs only).")
@click.option("--vocab-size", type=click.IntRange(min=1), default=None,
              help="BPE vocabulary for text prepared on the fly (default 1024).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Run directory. Default: checkpoints/<dataset name>.")
@click.option("--resume", is_flag=True, help="Continue the run in --out exactly where it stopped.")
@click.option("--init-from", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Start from another run's weights (fine-tuning; see --lora-rank).")
@click.option("--force", is_flag=True, help="Replace an existing run in --out.")
@_model_options
@_train_options
@click.option("--lora-rank", type=click.IntRange(min=1), default=None,
              help="With --init-from: train rank-R LoRA adapters only; the base stays frozen.")
@click.option("--lora-alpha", type=click.FloatRange(min=0, min_open=True), default=None,
              help="LoRA scale numerator: updates are scaled by alpha / rank (default: alpha = rank).")
@click.option("--lora-targets", default="all", show_default=True,
              help=f"Comma-separated layers to adapt: {', '.join(LORA_TARGETS)}, or attn, mlp, all.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.pass_context
def train(ctx, data_arg, kind, vocab_size, out, resume, init_from, force, lora_rank, lora_alpha, lora_targets,
          quiet, **opts):
    """Train a GPT with handwritten backprop; checkpoints at every eval, resumable exactly.

    With no options: prepares the built-in corpus (CPython's reference documentation) and
    trains a 4-layer, 128-wide model with a 128-token context for a few minutes.
    Ctrl-C once finishes the step, saves and exits 130; --resume picks it up bit for bit.

    \b
    Examples:
      tbp train
      tbp train --data input.txt --out checkpoints/shakespeare --max-iters 2000 --n-ctx 64
      tbp train --out checkpoints/shakespeare --resume --max-iters 4000
      tbp train --init-from checkpoints/shakespeare --data poems.txt --lora-rank 8 --out checkpoints/poems
    """
    if resume and init_from:
        raise click.UsageError("--resume continues a run; --init-from starts a new one: pick one")
    if resume and out is None:
        raise click.UsageError("--resume needs --out, the run to continue")
    if lora_rank is not None and init_from is None:
        raise click.UsageError("--lora-rank fine-tunes an existing model: give it --init-from RUN")
    model_given = {k: opts[k] for k in MODEL_KEYS if _given(ctx, k)}
    train_given = {k: opts[k] for k in TRAIN_KEYS if _given(ctx, k)}
    progress = Progress(quiet)

    def prepare(path, kind_, vocab, out_, force_, tokenizer):
        return run_prepare(path, kind_, vocab, 0.1, out_, force_, "utf-8", tokenizer=tokenizer)

    if resume:
        ds = None
        if data_arg is not None:
            read_config(out)
            ds = runs.resolve_dataset(data_arg, prepare, Tokenizer.load(out / "tokenizer.json"))
        trainer = runs.resume(out, train_given, model_given, ds, progress)
    else:
        tcfg = TrainConfig(**{k: opts[k] for k in TRAIN_KEYS})
        if init_from is not None:
            ds = runs.resolve_dataset(data_arg, prepare, Tokenizer.load(init_from / "tokenizer.json"))
            lora = None
            if lora_rank is not None:
                lora = runs.LoraSpec(lora_rank, lora_alpha or float(lora_rank), runs.lora_targets(lora_targets))
            out = out or Path("checkpoints") / f"{Path(init_from).name}-{'lora' if lora else 'ft'}"
            trainer = runs.init_from(out, init_from, tcfg, ds, force, lora, model_given, progress)
        else:
            ds = runs.resolve_dataset(data_arg, prepare, None, kind, vocab_size)
            mcfg = ModelConfig(vocab_size=ds.tokenizer.vocab_size, **{k: opts[k] for k in MODEL_KEYS})
            out = out or Path("checkpoints") / ds.path.name
            trainer = runs.new_run(out, mcfg, tcfg, ds, force, progress)

    previous = _install_sigint(trainer)
    try:
        state = trainer.run_loop()
    finally:
        signal.signal(signal.SIGINT, previous)
        progress.close()
    _summary(trainer, state, trainer.interrupted)
    if trainer.interrupted:
        sys.exit(130)
