"""`tbp train --tensorboard DIR`: the run's scalars as TensorBoard event files (the
``tensorboard`` extra, tensorboardX's writer), for users who already follow runs there.

The same numbers as metrics.jsonl: each logged step's loss, learning rate, gradient norm and
throughput; each evaluation's losses and bits per byte; and the per-layer statistics
(layerstats.py) as ``grad_norm/<layer>``, ``update_ratio/<layer>`` and ``stream_rms/<sublayer>``.
"""
from __future__ import annotations

from .errors import TbpError
from .train import Callbacks

SCALARS = ("train_loss", "lr", "grad_norm", "tokens_per_s", "val_loss", "eval_train_loss", "val_bpb",
           "val_split_loss", "val_split_bpb")


def writer(logdir):
    """A SummaryWriter into ``logdir``; one line if the extra is missing."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise TbpError("--tensorboard needs tensorboardX: pip install 'tbp[tensorboard]'") from None
    return SummaryWriter(str(logdir))


class TensorBoard(Callbacks):
    def __init__(self, logdir):
        self.writer = writer(logdir)

    def step(self, trainer, m: dict) -> None:
        step = m["step"]
        for key in SCALARS:
            if key in m:
                self.writer.add_scalar(key, m[key], step)
        layers = m.get("layers", {})
        for key in ("grad_norm", "update_ratio"):
            for group, value in layers.get(key, {}).items():
                self.writer.add_scalar(f"{key}/{group}", value, step)
        for j, value in enumerate(layers.get("stream_rms", [])):
            self.writer.add_scalar(f"stream_rms/{j:02d}", value, step)
        if "val_loss" in m:
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()
