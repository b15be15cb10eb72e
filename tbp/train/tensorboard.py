"""`tbp train --tensorboard DIR`: the run's scalars as TensorBoard event files (the
``tensorboard`` extra, tensorboardX's writer), for users who already follow runs there.

The same numbers as metrics.jsonl: each logged step's loss, learning rate, gradient norm and
throughput; each evaluation's losses and bits per byte; and the per-layer statistics
(layerstats.py) as ``grad_norm/<layer>``, ``update_ratio/<layer>`` and ``stream_rms/<sublayer>``.

One writer per TensorBoard run: a training writes into ``DIR/<run name>/`` (TensorBoard shows
each subfolder as a run), holding that subfolder's lock (locks.RunLock) while it trains; a
second training of the same name meanwhile takes ``DIR/<run name>-2/``, and so on, so two runs
never share an event file or a curve. A resumed run continues its own subfolder. The folder is
opened when training starts, after the run is claimed: a refused command leaves none behind.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

from ..errors import TbpError
from ..files.locks import Held, RunLock
from .loop import Callbacks

SCALARS = ("train_loss", "lr", "grad_norm", "tokens_per_s", "val_loss", "eval_train_loss", "val_bpb",
           "val_split_loss", "val_split_bpb")


def _summary_writer():
    """tensorboardX's SummaryWriter class; one line if the extra is missing."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise TbpError("--tensorboard needs tensorboardX: pip install 'tbp[tensorboard]'") from None
    return SummaryWriter


def inside(folder: Path, run: Path) -> bool:
    """Whether ``folder`` is the run folder or lies inside it (where event files are not run files)."""
    a, b = Path(folder).resolve(), Path(run).resolve()
    return a == b or b in a.parents


class TensorBoard(Callbacks):
    def __init__(self, logdir):
        self.summary_writer = _summary_writer()          # a missing extra: refused before any work
        self.logdir = Path(logdir)
        self.writer = self.lock = None
        self.folder: Path | None = None

    def start(self, trainer) -> None:
        if inside(self.logdir, trainer.run):
            raise TbpError(f"--tensorboard {self.logdir}: inside the run folder {trainer.run}, where only the run's "
                           f"own files may be; choose a folder outside it")
        name = trainer.run.name or "run"
        if (self.logdir / name).resolve() == trainer.run.resolve():
            raise TbpError(f"--tensorboard {self.logdir}: this run's event folder there, {self.logdir / name}, "
                           f"would be the run folder itself; give the events a folder of their own (runs/tb, say)")
        for i in range(1, 1000):
            folder = self.logdir / (name if i == 1 else f"{name}-{i}")
            try:
                self.lock = RunLock(folder).acquire()
            except Held:                       # another training writes there now: the next name
                continue
            break
        else:
            raise TbpError(f"{self.logdir}: a thousand trainings named {name} write here at once")
        self.folder = folder
        # tensorboardX names a file by the second and the host: the process id and a random tag make
        # it a file of its own, even beside a resumed run's earlier one written the same second
        self.writer = self.summary_writer(str(folder), filename_suffix=f".{os.getpid()}.{uuid.uuid4().hex[:8]}")

    def step(self, trainer, m: dict) -> None:
        if self.writer is None:
            return
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
        if self.writer is not None:
            self.writer.close()
        if self.lock is not None:
            self.lock.release()
