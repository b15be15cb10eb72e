"""The public GPT: the engine's model plus loading from a run directory.

The engine (``tbp.nn``) never touches files; this subclass adds persistence on top of it.
"""
from __future__ import annotations

from pathlib import Path

from . import nn
from .checkpoint import load_model


class GPT(nn.GPT):
    __doc__ = nn.GPT.__doc__

    @classmethod
    def load(cls, run: str | Path, dtype=None, best: bool = False) -> "GPT":
        """The model saved in a checkpoint directory (base + adapter for a LoRA run).

        dtype: None keeps the stored dtype; best=True takes the best-validation weights.
        """
        return load_model(run, dtype=dtype, best=best, cls=cls)[0]
