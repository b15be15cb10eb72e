"""Configuration: ModelConfig (the engine's, re-exported) and TrainConfig, both declared once,
validated from their declarations, and JSON round-trip."""
from __future__ import annotations

from dataclasses import dataclass

from ..nn.config import ConfigError, DictConfig, ModelConfig, option
from . import muon, optim  # noqa: F401  (each registers its optimizer)
from .optimizers import OPTIMIZERS

__all__ = ["ConfigError", "ModelConfig", "TrainConfig"]


@dataclass
class TrainConfig(DictConfig):
    batch_size: int = option(12, "Sequences per micro-batch.", min=1)
    grad_accum: int = option(1, "Micro-batches per optimizer step.", min=1)
    max_iters: int = option(1500, "Optimizer steps (with --resume: the new total).", min=1)
    lr: float = option(1e-3, "Peak learning rate, reached after warmup.", min=0.0, min_open=True)
    min_lr: float = option(1e-4, "Learning rate at the end of the decay.", min=0.0)
    warmup: int = option(100, "Linear warmup steps.", min=0)
    schedule: str = option("cosine", "cosine: warmup, then a cosine decay over --lr-decay-iters; wsd: warmup, "
                                     "the peak, then a linear decay over the run's last --decay-fraction -- of "
                                     "its steps, or, with --max-time, of its time, whichever ends it first.",
                           choices=("cosine", "wsd"))
    decay_fraction: float = option(0.2, "wsd: the share of the run the learning rate decays over.", min=0.0,
                                   max=1.0, min_open=True)
    lr_decay_iters: int | None = option(None, "Steps over which the cosine decays (default: --max-iters).",
                                        min=1)
    optimizer: str = option("adamw", "adamw, or muon: a block's matrices updated by their momentum "
                                     "orthogonalised (Newton-Schulz), the rest by AdamW, at one learning rate.",
                            choices=OPTIMIZERS)
    muon_momentum: float = option(0.95, "Muon's (Nesterov) momentum, in [0, 1).", min=0.0, max=1.0, max_open=True)
    weight_decay: float = option(0.1, "AdamW weight decay, applied to matrices only.", min=0.0)
    beta1: float = option(0.9, "AdamW's first-moment decay, in [0, 1).", min=0.0, max=1.0, max_open=True)
    beta2: float = option(0.99, "AdamW's second-moment decay, in [0, 1).", min=0.0, max=1.0, max_open=True)
    grad_clip: float = option(1.0, "Clip the global gradient norm to this (0: off).", min=0.0)
    eval_interval: int = option(250, "Steps between evaluations and checkpoints.", min=1)
    early_stop: int = option(0, "Stop once this many evaluations in a row find no lower validation loss than the "
                                "best so far (0: off). The best weights are kept either way (--best).", min=0)
    target_loss: float = option(0.0, "A validation loss to reach (0: none): the progress bar shows it, and the run "
                                     "records the step and the time, on its own clock, of the first evaluation at or "
                                     "below it.", min=0.0)
    max_time: float = option(0.0, "Stop after this many seconds of this invocation's training, evaluations included "
                                  "(0: off), with an evaluation and a checkpoint, then the loss over the whole validation "
                                  "split (after the budget); --resume goes on from there.",
                             min=0.0)
    eval_batches: int = option(20, "Fixed batches per split in each evaluation.", min=1)
    log_interval: int = option(10, "Steps between lines of metrics.jsonl.", min=1)
    seed: int = option(1337, "Seeds initialisation, batch order and eval batches.", min=0)
    dtype: str = option("float32", "float32 to train; float64 for checks.", choices=("float32", "float64"))
    precision: str = option("fp32", "The linear layers' and the head's matrix products: fp32, or bf16 (bfloat16 "
                                    "operands, float32 sums: faster where the CPU's bf16 units and MKL serve, "
                                    "measured at the start and said). Weights, gradients, AdamW and everything "
                                    "else stay float32.", choices=("fp32", "bf16"))
    threads: int = option(0, "Threads that each run forward and backward on a share of the batch "
                             "(0: one per core; under mpiexec, the machine's cores shared among its ranks). One "
                             "thread is one core: the matrix products' library is held to it too. A run "
                             "repeats bit for bit at a given count.", min=0)
    shard_optimizer: bool = option(False, "Under mpiexec: each rank updates and holds the AdamW moments of "
                                          "its slice of the parameters only (ZeRO stage 1); the same run, "
                                          "1/N of the update's time and memory per rank.")
    overlap: bool = option(False, "Under mpiexec: sum each block's gradient over the ranks while the "
                                  "backward goes on to the blocks below it, hiding the communication.")
    KIND = "training config"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_lr > self.lr:
            raise ConfigError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        if self.optimizer == "muon" and self.shard_optimizer:
            raise ConfigError("--shard-optimizer slices AdamW's flat moments across ranks; Muon orthogonalises "
                              "whole matrices: use one or the other")
        if self.precision == "bf16" and self.dtype != "float32":
            raise ConfigError(f"precision bf16 rounds float32 products; dtype {self.dtype} is for exact checks "
                              f"(use one or the other)")

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters or self.max_iters
