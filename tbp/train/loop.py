"""The training loop. It reports through callbacks and never prints.

One step: ``grad_accum`` micro-batches of forward + handwritten backward, a finiteness
check, global-norm clipping, one AdamW update at the scheduled learning rate. Every
``eval_interval`` steps (and at the end): train/val loss on fixed batches, then an atomic
checkpoint. Everything random draws from generators seeded by ``TrainConfig.seed``, and
their states are checkpointed, so a resumed run continues bit for bit.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..runs import commit, disk
from .config import ConfigError, TrainConfig
from ..data.batches import batches_for
from ..data.datasets import Dataset
from ..errors import TbpError
from ..files.atomic import append_line, atomic_write_text
from ..nn.gpt import LanguageModel
from .optim import scheduled_lr
from .optimizers import OPTIMIZERS
from .distributed import World
from .gradsync import GradientSync
from .evaluate import fixed_batches_loss, val_split_figures
from .layerstats import LayerStats
from .parallel import Ranks, data_parallel
from ..machine.cores import available_cores


class Callbacks:
    """What a front end may observe; every method is optional."""

    def start(self, trainer: "Trainer") -> None: ...
    def evaluating(self, trainer: "Trainer") -> None: ...                # an evaluation begins
    def evaluating_split(self, trainer: "Trainer") -> None: ...          # the final one, over the whole split
    def step(self, trainer: "Trainer", metrics: dict) -> None: ...     # has val_loss on evals
    def saved(self, trainer: "Trainer", step: int, best: bool) -> None: ...


class Several(Callbacks):
    """Callbacks in turn: a progress bar and a TensorBoard writer, say."""

    def __init__(self, *each: Callbacks):
        self.each = [c for c in each if c is not None]

    def start(self, trainer):
        for c in self.each:
            c.start(trainer)

    def evaluating(self, trainer):
        for c in self.each:
            c.evaluating(trainer)

    def evaluating_split(self, trainer):
        for c in self.each:
            c.evaluating_split(trainer)

    def step(self, trainer, metrics):
        for c in self.each:
            c.step(trainer, metrics)

    def saved(self, trainer, step, best):
        for c in self.each:
            c.saved(trainer, step, best)


@dataclass
class State:
    """What, beyond weights and moments, a resume needs to continue exactly."""
    step: int = 0                      # optimizer steps completed
    tokens_seen: int = 0
    elapsed_s: float = 0.0
    best_val_loss: float | None = None
    best_step: int | None = None
    data_rng: dict = field(default_factory=dict)     # bit-generator state of the batch sampler
    tokenizer_sha256: str = ""
    stopped: str | None = None         # why training ended before max_iters: early stop, max time, interrupted
    evals_since_best: int = 0          # evaluations in a row with no lower validation loss (--early-stop)
    target_step: int | None = None     # the first evaluation at or below --target-loss: its step,
    target_s: float | None = None      # and the run's clock there (elapsed_s, evaluations included)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class NonFiniteError(TbpError):
    everywhere = True          # every rank of an MPI job computes the same loss: they all raise it


class Trainer:
    """Trains ``model`` on ``dataset`` into the run directory ``run``.

    Nothing is written into ``run`` before the first checkpoint: the header (config.json,
    tokenizer.json) is written with this trainer's first save (a resume may have changed the
    training config), and metrics lines logged before the first save are kept until it, so a
    run that fails early leaves nothing behind. ``lock`` (a RunLock
    held on ``run``) is released when the loop ends.
    """

    def __init__(self, model: LanguageModel, dataset: Dataset, cfg: TrainConfig, run: Path, config_record: dict,
                 adapter: bool = False, callbacks: Callbacks | None = None, state: State | None = None,
                 lock=None, tokenizer=None):
        self.model, self.data, self.cfg, self.run = model, dataset, cfg, Path(run)
        self.config_record, self.adapter = config_record, adapter
        self.tokenizer = tokenizer or dataset.tokenizer
        self.lock = lock
        self.cb = callbacks or Callbacks()
        self.batches = batches_for(dataset, model.config, model.collation)       # checks the data fits the model
        try:
            self.opt = OPTIMIZERS[cfg.optimizer].from_config(model.layout, cfg)
        except ValueError as e:            # what the optimizer cannot take (Muon and a LoRA run's adapters)
            raise ConfigError(f"--optimizer {cfg.optimizer}: {e}") from None
        self.workers = data_parallel(model, cfg.threads, cfg.batch_size, precision=cfg.precision)
        self.opt.workers = self.workers
        self.state = state or State(tokenizer_sha256=dataset.tokenizer.sha256())
        self.data_rng = np.random.default_rng(cfg.seed)
        if self.state.data_rng:
            self.data_rng.bit_generator.state = self.state.data_rng
        # fixed eval batches: the same windows at every eval, so the curve is comparable
        self.eval_sets = {split: [self.batches.sample(split, cfg.batch_size, np.random.default_rng(cfg.seed + 1 + i))
                                  for i in range(cfg.eval_batches)] for split in ("train", "val")}
        self.stop_requested = False      # set by a front end (Ctrl-C): finish the step, save, stop
        self.saving = False
        self.hard_stop = False           # a second Ctrl-C during a save: quit once the files are whole
        self.interrupted = False
        self.last_saved_step: int | None = None
        self.last_loss = float("nan")            # the last step's training loss
        self.pending_metrics: list[str] = []     # lines logged before the run's first save
        self.header_written = False
        self.world = World()                     # see join(): one rank of an MPI job
        self.sync = GradientSync(self.world, model)

    def join(self, world) -> None:
        """Train as one rank of ``world`` (distributed.py): this rank's share of every batch on its
        own threads -- by default its machine's cores shared among the ranks there -- and every
        parameter and optimizer moment made rank 0's. Every rank calls it, after building the
        same model."""
        self.world = world
        if world.size == 1:
            return
        self.workers = rank_workers(self.model, world, self.cfg.threads, self.cfg.batch_size, self.cfg.precision)
        self.opt.workers = self.workers.local
        layout = self.model.layout
        world.bcast_(layout.params)
        for name, p in self.model.params.items():
            if name not in self.model.grads:          # frozen (a LoRA run's base): outside the layout
                world.bcast_(p)
        self.opt.t = world.bcast(self.opt.t)
        self.sync = GradientSync(world, self.model, self.cfg.shard_optimizer, self.cfg.overlap)
        if self.sync.shard:                           # this rank's slice of rank 0's moments
            self.opt = self.sync.take_slice(self.opt)
        else:
            for buffer in self.opt.buffers():
                world.bcast_(buffer)
        world.check_same(layout.params, "the parameters after the broadcast")

    # --- public -----------------------------------------------------------------------------
    def run_loop(self) -> State:
        """Train until max_iters or a stop request; returns the final state."""
        try:
            with self.workers:
                return self._run_loop()
        finally:
            self.close()

    def close(self) -> None:
        """Release the run directory (removing it if this run never saved into it)."""
        if self.lock is not None:
            self.lock.release(remove_if_alone=self.last_saved_step is None)
            self.lock = None

    def _run_loop(self) -> State:
        cfg, st = self.cfg, self.state
        self.cb.start(self)
        t_start = time.perf_counter() - st.elapsed_s
        t_log, tokens_log = time.perf_counter(), 0
        st.stopped = None
        t_session = time.perf_counter()            # --max-time counts this invocation's time
        # a time budget's end, in the run's own clock (elapsed_s): where a wsd schedule has decayed
        horizon = st.elapsed_s + cfg.max_time if cfg.max_time and cfg.schedule == "wsd" else None

        def rate(step: int) -> float:   # rank 0's clock: every rank steps at the same rate
            clock = self.world.bcast((time.perf_counter() - t_start) / horizon) if horizon else None
            return scheduled_lr(cfg, step, clock)
        lr = rate(st.step)
        while st.step < cfg.max_iters:
            if self.world.any(self.stop_requested):     # every rank stops after the same step
                self.interrupted = True
                st.stopped = "interrupted"
                break
            if cfg.max_time and self.world.any(time.perf_counter() - t_session >= cfg.max_time):
                st.stopped = f"max time: {cfg.max_time:g} s"
                metrics = {"step": st.step, "lr": lr, "train_loss": self.last_loss, "elapsed_s": st.elapsed_s}
                if self.last_saved_step != st.step and math.isfinite(self.last_loss):
                    # steps of this invocation not saved yet: evaluated and kept, as at every evaluation
                    self.cb.evaluating(self)
                    metrics.update(self.evaluate())
                    self._checked(metrics)
                    self._count_eval(metrics)
                    self._log(json.dumps(metrics))
                    self.save(metrics["val_loss"])
                else:
                    self.record_stop()
                if self.last_saved_step == st.step and st.step > 0:
                    self._final_figures(metrics, t_start)     # a run the clock ends ends with them too
                break
            lr = rate(st.step)
            is_eval = (st.step + 1) % cfg.eval_interval == 0 or st.step + 1 == cfg.max_iters
            final = st.step + 1 == cfg.max_iters
            stats = LayerStats(self.model) if is_eval else None     # per-layer figures, at evals
            loss, gnorm, tokens_per_step = self._step(lr, stats)
            st.step += 1
            st.tokens_seen += tokens_per_step
            tokens_log += tokens_per_step
            st.elapsed_s = time.perf_counter() - t_start
            metrics = {"step": st.step, "lr": lr, "train_loss": loss, "grad_norm": gnorm}
            if is_eval or st.step % cfg.log_interval == 0 or st.step == 1:
                now = time.perf_counter()
                metrics["tokens_per_s"] = tokens_log / max(now - t_log, 1e-9)
                metrics["elapsed_s"] = st.elapsed_s
                tokens_log = 0
                if is_eval:
                    self.cb.evaluating(self)
                    metrics.update(self.evaluate())
                    stats.stream(self.eval_sets["val"][0])
                    metrics["layers"] = stats.record()
                    st.elapsed_s = time.perf_counter() - t_start      # the run's time includes its evaluations
                    self._checked(metrics)
                    val = metrics["val_loss"]
                    self._count_eval(metrics)
                    since = st.evals_since_best
                    if cfg.early_stop and since >= cfg.early_stop and st.step < cfg.max_iters:
                        best = min(val, st.best_val_loss) if st.best_val_loss is not None else val
                        st.stopped = (f"early stop: no lower validation loss in {since} evaluations (best "
                                      f"{best:.4f} at step {st.best_step})")
                        final = True                    # the run ends here: its final figures, as at max_iters
                t_log = time.perf_counter()                            # tokens/s: training steps only
                if not final:
                    self._log(json.dumps(metrics))
            self.last_loss = loss
            if not final:
                self.cb.step(self, metrics)
            if is_eval:
                self.save(metrics["val_loss"])          # an early stop's reason rides in this commit's state.json
                if final:
                    self._final_figures(metrics, t_start)
                if st.stopped:
                    break
        if self.interrupted and self.last_saved_step != st.step:
            self.save(None)
        elif self.interrupted:
            self.record_stop()
        return st

    def _final_figures(self, metrics: dict, t_start: float) -> None:
        """The run's final figure, the split itself, once the run is saved: nothing it does (a
        long read, running out of memory, a signal) can lose the run."""
        self.cb.evaluating_split(self)
        metrics.update(self.evaluate_split())
        metrics["elapsed_s"] = time.perf_counter() - t_start
        self._log(json.dumps(metrics))
        self.cb.step(self, metrics)

    def _checked(self, metrics: dict) -> None:
        """An evaluation's figures are finite, or nothing is saved from them."""
        if not math.isfinite(metrics["val_loss"]):
            raise NonFiniteError(f"step {self.state.step}: validation loss is {metrics['val_loss']}; "
                                 f"not saving (last good checkpoint: step {self.last_saved_step})")

    def _count_eval(self, metrics: dict) -> None:
        """--early-stop's count (evaluations in a row that found no lower validation loss), and
        the first evaluation at or below --target-loss (``target_s`` in its line: the run's clock
        once that evaluation is done)."""
        st, val_loss = self.state, metrics["val_loss"]
        better = st.best_val_loss is None or val_loss < st.best_val_loss
        st.evals_since_best = 0 if better else st.evals_since_best + 1
        if self.cfg.target_loss and st.target_step is None and val_loss <= self.cfg.target_loss:
            st.target_step, st.target_s = st.step, st.elapsed_s      # its evaluation included
            metrics["target_s"] = st.target_s

    def record_stop(self) -> None:
        """Say in the committed state.json why training ended, when this step is saved already."""
        if self.world.is_root and self.last_saved_step is not None:
            commit.write_state(self.run, self.state.to_dict())

    def evaluate(self) -> dict:
        """The curve's figures: each split's mean loss over the fixed eval batches (evaluate.py)."""
        return fixed_batches_loss(self.workers.losses, self.eval_sets, self.data)

    def evaluate_split(self) -> dict:
        """The run's final figures: the validation split itself, in order (evaluate.py)."""
        return val_split_figures(self.model, self.data, self.cfg.batch_size, self.workers.losses)

    def save(self, val_loss: float | None) -> None:
        st = self.state
        best = val_loss is not None and (st.best_val_loss is None or val_loss < st.best_val_loss)
        if best:
            st.best_val_loss, st.best_step = val_loss, st.step
        st.data_rng = self.data_rng.bit_generator.state
        self.world.check_same(self.model.layout.params, f"step {st.step}: the parameters")
        opt = self.sync.whole(self.opt)              # sharded: the moments gathered on rank 0
        if not self.world.is_root:                   # rank 0 writes the run
            self.last_saved_step = st.step
            return
        self.saving = True
        try:
            if not self.header_written:
                commit.write_run_header(self.run, self.config_record, self.tokenizer)
                self.header_written = True
            for line in self.pending_metrics:
                append_line(self.run / "metrics.jsonl", line)
            self.pending_metrics = []
            commit.save(self.run, self.model, opt, st.to_dict(), self.adapter, best)
        finally:
            self.saving = False
        if self.hard_stop:
            raise KeyboardInterrupt
        self.last_saved_step = st.step
        self.cb.saved(self, st.step, best)

    # --- internals --------------------------------------------------------------------------
    def _log(self, line: str) -> None:
        if not self.world.is_root:
            return
        if self.last_saved_step is None:
            self.pending_metrics.append(line)       # the run directory holds nothing yet
        else:
            append_line(self.run / "metrics.jsonl", line)

    def _step(self, lr: float, stats: LayerStats | None = None) -> tuple[float, float, int]:
        # overflow on a diverging run is caught below, by value, with the step named
        with np.errstate(over="ignore", invalid="ignore"):
            return self._step_unguarded(lr, stats)

    def _step_unguarded(self, lr: float, stats: LayerStats | None) -> tuple[float, float, int]:
        """One optimizer step: (mean loss, gradient norm before clipping, tokens trained on);
        with ``stats``, each layer's gradient norm and update ratio recorded into it."""
        cfg, model = self.cfg, self.model
        model.zero_grad()
        total, tokens = 0.0, 0
        sync = self.sync
        try:
            for k in range(cfg.grad_accum):
                batch = self.batches.sample("train", cfg.batch_size, self.data_rng)
                if model.config.dropout:      # a seed a row, from the data generator: resumes exactly
                    batch = batch.with_noise(self.data_rng.integers(0, 1 << 62, cfg.batch_size))
                tokens += batch.tokens
                last = k == cfg.grad_accum - 1
                if last:
                    sync.arm()                # with overlap: blocks are sent as the backward passes them
                total += self.workers.accumulate(batch, 1.0 / cfg.grad_accum,
                                                 sync if last and sync.overlap else None) / cfg.grad_accum
        except BaseException:
            sync.abandon()
            raise
        # an MPI job: each rank holds its share of the gradient and loss; the sums complete both
        sync.finish()
        (total,) = self.world.sum_values(total)
        if stats is not None:
            stats.gradients(sync)
        gnorm = sync.clip(cfg.grad_clip)
        if not (math.isfinite(total) and math.isfinite(gnorm)):
            what = "loss" if not math.isfinite(total) else "gradient norm"
            good = f"; the last good checkpoint (step {self.last_saved_step}) is kept" \
                if self.last_saved_step is not None else "; no checkpoint was written"
            raise NonFiniteError(f"step {self.state.step + 1}: {what} is {total if what == 'loss' else gnorm}"
                                 f" (try a lower --lr){good}")
        if stats is not None:
            stats.before_update()
        self.opt.step(lr)
        sync.share_update()                   # sharded: every rank's updated slice everywhere
        if stats is not None:
            stats.updates()
        return total, gnorm, tokens


def rank_workers(model: LanguageModel, world, threads: int, batch_size: int, precision: str = "fp32") -> Ranks:
    """What one rank of ``world`` computes its share of a batch with: its rows over ``threads``
    threads (0: this machine's cores shared equally among the ranks on it)."""
    threads = threads or max(1, available_cores() // world.local_size)
    # one thread: BLAS held to the rank's share (data_parallel), so the ranks on a machine do not
    # oversubscribe it
    return Ranks(data_parallel(model, threads, -(-batch_size // world.size), precision=precision), world)


def trim_metrics(run: Path, step: int) -> None:
    """Drop metrics lines past ``step`` (logged after the last checkpoint of a crashed run),
    and a torn last line from a hard kill."""
    path = Path(run) / "metrics.jsonl"
    if path.is_file():
        keep = [m for m in disk.read_metrics(run) if m.get("step", 0) <= step]
        atomic_write_text(path, "".join(json.dumps(m) + "\n" for m in keep))
