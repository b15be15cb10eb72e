"""`tbp train`: options, the progress bar, Ctrl-C, and the summary."""
from __future__ import annotations

import math
import signal
import sys
import time
from pathlib import Path

import click
from tqdm import tqdm

from ..errors import TbpError
from ..train import distributed, ranks, launch
from ..runs.disk import read_metrics
from ..nn.config import ModelConfig
from ..train.config import TrainConfig
from ..nn.lora import LORA_TARGETS
from ..data.pieces import UNKNOWN
from ..data.tokenizer import TOKENIZERS
from ..train.tensorboard import TensorBoard
from ..train.tensorboard import inside as tensorboard_inside
from ..train.loop import Callbacks, Several
from .common import console, fmt_count, fmt_duration, fmt_loss, kv_table, split_figure
from .options import FiniteFloat, config_options, given, load_config_file
from .prepare import PrepareBar


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
        meta = trainer.data.meta
        if trainer.data.kind == "pairs":
            arch = trainer.model.collation.describe
            what += f" ({arch}) · {meta['train_examples']:,} training pairs"
        elif trainer.data.kind == "chat":
            what += f" · {meta['train_examples']:,} training conversations (loss: {meta['loss']})"
        else:
            what += f" · {meta['train_tokens']:,} train tokens"
        workers = trainer.workers
        world = distributed.current()
        where = f"{world.size} ranks × {workers.workers} thread(s)" if world.size > 1 else f"{workers.workers} thread(s)"
        tqdm.write(f"{what} · vocabulary {V} · {where}, products by {workers.gemm.name} · run {trainer.run}",
                   file=sys.stderr)
        if workers.gemm.precision != "fp32":             # what bf16 costs or saves here, measured
            tqdm.write(f"precision {workers.gemm.precision}: {workers.gemm.reason}", file=sys.stderr)
        if trainer.state.step:
            tqdm.write(f"resuming from step {trainer.state.step:,} of {trainer.cfg.max_iters:,}", file=sys.stderr)
        # the loss a fresh model starts at; a fine-tuned or resumed one starts wherever it was
        self.fresh = not trainer.state.step and not trainer.config_record.get("init_from")
        if not cfg.max_time:           # with a clock, the steps it allows are known once the pace is
            self.overfit_note(trainer, cfg.max_iters - trainer.state.step)
        self.clock = (trainer.state.step, time.perf_counter())

    def overfit_note(self, trainer, steps: float) -> None:
        passes = _passes(trainer, steps)
        if passes is not None and passes >= PASSES_WARN:
            tqdm.write(f"note: {steps:,.0f} steps read this training data about {passes:,.0f} times over: expect "
                       f"the validation loss to turn back up. The best weights are kept (--best reads them); "
                       f"--early-stop N stops once N evaluations bring no lower loss", file=sys.stderr)

    def estimate(self, trainer):
        """After the first few steps: how long the rest will take at this pace, said once."""
        first, t0 = self.clock
        done = trainer.state.step - first
        if done != ESTIMATE_AFTER:
            return
        cfg = trainer.cfg
        per_step = (time.perf_counter() - t0) / done
        left = cfg.max_iters - trainer.state.step
        evals = left // cfg.eval_interval
        line = (f"about {fmt_duration(per_step * left)} for the {left:,} steps to go at this pace"
                + (f", besides {evals} evaluation{'s' * (evals != 1)}" if evals else ""))
        if cfg.max_time:
            line += f"; --max-time stops it at {fmt_duration(cfg.max_time)}"
        tqdm.write(line, file=sys.stderr)
        if cfg.max_time:
            self.overfit_note(trainer, min(left, cfg.max_time / per_step))

    def evaluating(self, trainer):
        if self.bar is not None:
            self.bar.set_description("eval", refresh=True)

    def evaluating_split(self, trainer):
        if self.bar is not None:             # the longest evaluation: say what the bar waits for
            self.bar.set_description("final eval over the whole validation split", refresh=True)

    def step(self, trainer, m):
        self.estimate(trainer)
        if self.bar is not None and "val_loss" in m:
            self.bar.set_description("train", refresh=False)
        if self.first and trainer.state.step == 1:
            at_init = f" (expected at init: ln V = {self.expected:.4f})" if self.fresh else ""
            tqdm.write(f"step 1: loss {fmt_loss(m['train_loss'])}{at_init}", file=sys.stderr)
        self.first = False
        post = {"loss": fmt_loss(m['train_loss']), "lr": f"{m['lr']:.2e}"}
        if "tokens_per_s" in m:
            self.tok_s = m["tokens_per_s"]
        if getattr(self, "tok_s", None):
            post["tok/s"] = fmt_count(self.tok_s)
        post.update(self.goals(trainer))
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)
        if "val_loss" in m:
            speed = f" · {fmt_count(m['tokens_per_s'])} tok/s" if "tokens_per_s" in m else ""     # not at a stop
            reached = (f" · target {trainer.cfg.target_loss:g} reached after {fmt_duration(m['target_s'])}"
                       if "target_s" in m else "")
            tqdm.write(f"step {m['step']}: train {fmt_loss(m['eval_train_loss'])} · val {fmt_loss(m['val_loss'])} "
                       f"({m['val_bpb']:.3f} bits/byte) · lr {m['lr']:.2e}{speed}{reached}", file=sys.stderr)

    def goals(self, trainer) -> dict:
        """The bar's figures for a run with a goal: the target loss (until an evaluation reaches
        it, then when it did) and the time --max-time leaves."""
        cfg, st, post = trainer.cfg, trainer.state, {}
        if cfg.target_loss:
            post["target"] = (f"{cfg.target_loss:g} at {fmt_duration(st.target_s)}" if st.target_step is not None
                              else f"{cfg.target_loss:g}")
        if cfg.max_time:
            post["left"] = fmt_duration(cfg.max_time - (time.perf_counter() - self.clock[1]))
        return post

    def close(self):
        if self.bar is not None:
            self.bar.close()


PASSES_WARN = 20          # reading the training data this many times over warns before the run
ESTIMATE_AFTER = 5        # steps timed before the run's time is estimated


def _passes(trainer, steps: float | None = None) -> float | None:
    """How many times over ``steps`` (default: the steps still to run) read the training data
    (sequences, pairs or conversations drawn per step against those there are); None where it
    cannot be told."""
    cfg, meta = trainer.cfg, trainer.data.meta
    drawn = cfg.batch_size * cfg.grad_accum * (cfg.max_iters - trainer.state.step if steps is None else steps)
    if trainer.data.kind == "text":
        windows = meta["train_tokens"] / trainer.model.config.n_ctx
        return drawn / max(windows, 1)
    examples = meta.get("train_examples")
    return drawn / examples if examples else None


class _Silent(Callbacks):
    def close(self):
        pass


class Stopper:
    """Ctrl-C and SIGTERM (how timeout, systemd, docker, Slurm and Kubernetes stop a job): the
    first finishes the step, saves and stops; a second Ctrl-C quits at once (once a save in
    progress is complete), from the last checkpoint; a repeated SIGTERM (MPI launchers send it
    to each rank twice) waits for the save. ``code`` is the exit status: 130 or 143."""

    def __init__(self, trainer, announce: bool = True):
        self.trainer, self.code, self.announce = trainer, 130, announce
        self.previous = {sig: signal.signal(sig, self.handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(self, signum, frame):
        trainer = self.trainer
        distributed.current().stopping(signum)   # a rank then waits for the others a short while only
        if not trainer.stop_requested:
            trainer.stop_requested = True
            self.code = 143 if signum == signal.SIGTERM else 130
            what = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C (press again to quit at once)"
            if self.announce:
                tqdm.write(f"{what}: finishing this step and saving", file=sys.stderr)
        elif signum == signal.SIGTERM:
            pass                              # already stopping (launchers send it twice): let the save finish
        elif trainer.saving:
            trainer.hard_stop = True          # quit as soon as the files being written are complete
        else:
            raise KeyboardInterrupt

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _summary(trainer, state, interrupted: bool):
    stopped = state.stopped and not interrupted
    t = kv_table("interrupted: saved, resume with --resume" if interrupted else
                 f"stopped: {state.stopped}" if stopped else "training finished")
    t.add_row("steps", f"{state.step:,} / {trainer.cfg.max_iters:,}")
    last = _last_eval(trainer.run)
    if last and "val_split_loss" in last:
        t.add_row("final val loss", split_figure(last))
    if last:
        t.add_row("val estimate", f"{fmt_loss(last['val_loss'])} ({last['val_bpb']:.3f} bits/byte) at step "
                                  f"{last['step']}, on the {trainer.cfg.eval_batches} fixed batch{'es' * (trainer.cfg.eval_batches != 1)} of "
                                  f"every eval")
    if state.best_val_loss is not None:
        t.add_row("best (estimate)", f"{fmt_loss(state.best_val_loss)} at step {state.best_step}")
    if trainer.cfg.target_loss:
        t.add_row("target", f"{trainer.cfg.target_loss:g}: " + (
            f"reached at step {state.target_step:,}, {fmt_duration(state.target_s)} into the run (its clock, "
            f"evaluations included)" if state.target_step is not None else "not reached by an evaluation"))
    t.add_row("tokens seen", f"{state.tokens_seen:,}")
    t.add_row("time", f"{state.elapsed_s:.1f}s ({fmt_count(state.tokens_seen / max(state.elapsed_s, 1e-9))} tok/s)")
    t.add_row("checkpoint", str(trainer.run))
    follow = {"pairs": "tbp eval", "chat": "tbp chat"}.get(trainer.data.kind, "tbp generate") \
        + f" --checkpoint {trainer.run}"
    if stopped and state.best_step is not None and state.best_step != state.step:
        follow += " --best"                  # the weights the early stop or the clock kept as best
    t.add_row("next", follow if not interrupted else f"tbp train --out {trainer.run} --resume")
    console.print(t)


def _last_eval(run: Path):
    evals = [m for m in read_metrics(run) if "val_loss" in m]
    return evals[-1] if evals else None


@click.command()
@click.option("--config", type=click.Path(exists=True, dir_okay=False), callback=load_config_file,
              is_eager=True, expose_value=False, help="JSON file of option values (a run's config.json works).")
@click.option("--data", default=None, metavar="DIR|FILE",
              help="A prepared dataset folder, or text (file or folder) prepared on the fly. "
                   "Default: the built-in corpus.")
@click.option("--tokenizer", type=click.Choice(TOKENIZERS), default="char", show_default=True,
              help="Tokenizer for text prepared on the fly (new runs only).")
@click.option("--vocab-size", type=click.IntRange(min=1), default=None,
              help="BPE vocabulary for text prepared on the fly (default 1024).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Run directory. Default: checkpoints/<dataset name>.")
@click.option("--resume", is_flag=True, help="Continue the run in --out exactly where it stopped.")
@click.option("--init-from", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Start from another run's weights (fine-tuning; see --lora-rank). With --attention gqa "
                   "--n-kv-head K, its key/value heads mean-pooled into K (uptraining).")
@click.option("--force", is_flag=True, help="Replace an existing run in --out.")
@click.option("--unknown-chars", type=click.Choice(UNKNOWN), default="refuse", show_default=True,
              help="Text encoded with the --init-from (or resumed) run's char tokenizer: refuse characters it "
                   "lacks (naming them all), drop them, or put a space for each.")
@config_options(ModelConfig)
@config_options(TrainConfig)
@click.option("--lora-rank", type=click.IntRange(min=1), default=None,
              help="With --init-from: train rank-R LoRA adapters only; the base stays frozen.")
@click.option("--lora-alpha", type=FiniteFloat(min=0, min_open=True), default=None,
              help="LoRA scale numerator: updates are scaled by alpha / rank (default: alpha = rank).")
@click.option("--lora-targets", default="all", show_default=True,
              help=f"Comma-separated layers to adapt: {', '.join(LORA_TARGETS)}, or attn, mlp, all.")
@click.option("--tensorboard", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also write the run's scalars (losses, learning rate, per-layer statistics) as TensorBoard "
                   "event files into DIR/<run name>/ (pip install 'tbp[tensorboard]'); a second training of that "
                   "name at the same time takes DIR/<run name>-2/.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.pass_context
def train(ctx, data, tokenizer, vocab_size, out, resume, init_from, force, unknown_chars, lora_rank,
          lora_alpha, lora_targets, tensorboard, quiet, **opts):
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
      tbp train --tensorboard runs/tb              # also TensorBoard event files (pip install 'tbp[tensorboard]')
      mpiexec -n 2 tbp train --data input.txt     # data-parallel over MPI ranks (pip install 'tbp[mpi]')
    """
    lora = None
    if lora_rank is not None:
        lora = launch.LoraSpec(lora_rank, lora_alpha or float(lora_rank), launch.lora_targets(lora_targets))
    request = launch.RunRequest(out=out, data=data, tokenizer=tokenizer, vocab_size=vocab_size, resume=resume,
                              init_from=init_from, force=force, lora=lora, unknown_chars=unknown_chars,
                              model=given(ctx, ModelConfig), train=given(ctx, TrainConfig))
    if tensorboard is not None and out is not None and tensorboard_inside(tensorboard, out):
        raise click.UsageError(f"--tensorboard {tensorboard}: inside --out {out}, where only the run's own files may be; "
                               f"choose a folder outside it")
    world = distributed.world()            # several ranks under mpiexec; else a world of one
    asked = [f"--{k.replace('_', '-')}" for k in ("shard_optimizer", "overlap") if request.train.get(k)]
    if asked and world.size == 1:          # an option that would silently do nothing
        raise click.UsageError(f"{' and '.join(asked)} share work among MPI ranks; this is one process "
                               f"(run it under mpiexec -n N, or leave {'them' if len(asked) > 1 else 'it'} out)")
    progress = Progress(quiet) if world.is_root else _Silent()     # rank 0 speaks for the job
    board = TensorBoard(tensorboard) if tensorboard is not None and world.is_root else None
    callbacks = Several(progress, board)
    trainer = ranks.start_ranks(request, callbacks, PrepareBar(), world) if world.size > 1 \
        else launch.start(request, callbacks, PrepareBar())
    stopper = Stopper(trainer, announce=world.is_root)
    try:
        state = trainer.run_loop()
    except KeyboardInterrupt:              # a second Ctrl-C: out at once, saying what is kept
        progress.close()
        if world.is_root:
            kept = trainer.last_saved_step
            console.print(f"stopped at once: {trainer.run} keeps its checkpoint of step {kept:,}; continue with "
                          f"tbp train --out {trainer.run} --resume" if kept is not None else
                          "stopped at once, before the first checkpoint: nothing was saved")
        raise
    finally:
        stopper.restore()
        progress.close()
        if board is not None:
            board.close()
    if trainer.last_saved_step is None:      # a fresh run stopped by the clock before its first step ended
        raise TbpError(f"--max-time {trainer.cfg.max_time:g} s: no step finished in that time, so nothing was "
                       f"saved and {trainer.run} holds no run; give it more time")
    if world.is_root:
        _summary(trainer, state, trainer.interrupted)
    if trainer.interrupted:                # every rank stopped after the same step and saved
        world.finish()
        sys.exit(stopper.code)
