"""Configuration: ModelConfig (the engine's, re-exported) and TrainConfig, both JSON round-trip."""
from __future__ import annotations

from dataclasses import dataclass

from .nn.config import DictConfig, ModelConfig

__all__ = ["ModelConfig", "TrainConfig"]


@dataclass
class TrainConfig(DictConfig):
    batch_size: int = 12          # sequences per micro-batch
    grad_accum: int = 1           # micro-batches per optimizer step
    max_iters: int = 1500         # optimizer steps (sized so a bare `tbp train` takes ~3 min on 2 cores)
    lr: float = 1e-3              # peak learning rate, reached after warmup
    min_lr: float = 1e-4          # floor of the cosine decay
    warmup: int = 100             # linear warmup steps
    lr_decay_iters: int | None = None   # cosine horizon; None -> max_iters
    weight_decay: float = 0.1     # AdamW decay, matrices only
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0        # global-norm clip; 0 disables
    eval_interval: int = 250      # steps between evals (and checkpoints)
    eval_batches: int = 20        # fixed batches per eval split
    log_interval: int = 10        # steps between metrics lines
    seed: int = 1337              # init, data order and eval batches all derive from it
    dtype: str = "float32"        # float32 to train; float64 for checks
    threads: int = 0              # threads sharing each batch's rows; 0 -> one per core
    KIND = "training config"

    def __post_init__(self) -> None:
        positive = ("batch_size", "grad_accum", "max_iters", "eval_interval", "eval_batches", "log_interval")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr):
            raise ValueError(f"need lr > 0 and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup < 0 or (self.lr_decay_iters is not None and self.lr_decay_iters < 1):
            raise ValueError("warmup must be >= 0 and lr_decay_iters >= 1")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("weight_decay and grad_clip must be >= 0")
        if not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 0:
            raise ValueError(f"threads must be an integer >= 0, got {self.threads!r}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype!r}")

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters or self.max_iters
