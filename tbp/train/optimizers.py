"""The optimizers a training may use, by name (``--optimizer``): a leaf the optimizers' modules
register into and the training config reads its choices from.

An optimizer is a class registered with :func:`optimizer` and made by its ``from_config(layout,
train_config)``. What the trainer asks of one: ``step(lr)`` over the layout's gradients, ``t``
(steps taken) and ``workers`` (threads to share the update over), ``buffers()`` (its state's
arrays, which ranks take from rank 0), and ``state_arrays()``/``load_state_arrays(arrays, t)``
(optimizer.safetensors). AdamW is optim.py's, Muon muon.py's; config.py imports each module that
registers one (the one line another optimizer adds).
"""
from __future__ import annotations

from typing import Callable

from ..nn.registry import register_in

OPTIMIZERS: dict[str, type] = {}


def optimizer(name: str) -> Callable:
    """Register an optimizer class as ``--optimizer name`` (a class decorator)."""
    return register_in(OPTIMIZERS, "optimizer", name)
