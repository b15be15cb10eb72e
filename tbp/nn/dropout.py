"""Dropout: while training, zero each number with probability p and scale the rest by 1/(1 - p).
[Srivastava et al., JMLR 15 (2014); GPT-2's and nanoGPT's placement]

Two sites, as in GPT-2: the attention weights (each query's row of P, after the softmax) and
each sublayer's output, before it joins the residual stream. With a mask M of 0 and 1/(1-p):

    residual:   y = x * M                           dx = dy * M
    attention:  y = (P * M) v                       dv = (P * M)^T dy;   dP = (dy v^T) * M
                dS = P * (dP - rowsum(dP * P))      and rowsum(dP * P) = rowsum(dy * y) still,
                                                    since y = (P * M) v  [derived]

Evaluation and sampling draw no masks: a model with dropout computes the same numbers as
without it there. The randomness of a batch is one seed per row (:class:`Noise`, drawn by the
trainer from its data generator, so a resumed run draws the same): each row's masks come from
its own generator in one fixed order, so they do not depend on how the rows are shared out
over threads or ranks. The flash kernel is refused: its tiles never hold a whole row of P.
Cost: the masks are drawn for the whole T x T square and kept for the backward, about as much
memory as the attention weights again, and a step 1.2-1.4x slower (tbp bench, 6 x 192, T 256).
"""
from __future__ import annotations

import numpy as np

from .config import ConfigError
from .module import Module
from . import registry
from .variant import Variant


class Noise:
    """A batch's dropout masks, row by row: ``seeds`` (B,) ints, one generator each, and the
    drop probability ``p``. ``mask(shape, dtype)`` (B, *shape) of 0 and 1/(1 - p), the next masks
    of every row; the model asks for them in the same order at every step."""

    def __init__(self, seeds, p: float):
        self.rows = [np.random.default_rng(int(s)) for s in np.asarray(seeds).reshape(-1)]
        self.keep = 1.0 - p

    def state(self) -> list:
        """Where every row's generator stands: ``restore`` draws the same masks again from here
        (activation recomputation runs a block's forward twice, recompute.py)."""
        return [rng.bit_generator.state for rng in self.rows]

    def restore(self, state: list) -> None:
        for rng, s in zip(self.rows, state):
            rng.bit_generator.state = s

    def mask(self, shape: tuple, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        out = np.empty((len(self.rows),) + tuple(shape), dtype)
        scale = dtype.type(1.0 / self.keep)
        for b, rng in enumerate(self.rows):
            np.multiply(rng.random(shape, dtype=np.float32) < self.keep, scale, out=out[b])
        return out


class Dropout(Module):
    """Residual dropout on a sublayer's output x (B, T, C): y = x * M. No parameters."""

    def forward(self, x: np.ndarray, noise: Noise | None) -> np.ndarray:
        if noise is None:
            self.cache = None
            return x
        self.cache = noise.mask(x.shape[1:], x.dtype)                    # (B, T, C)
        x *= self.cache                                                   # the sublayer's own new array
        return x

    def backward(self, dy: np.ndarray) -> np.ndarray:
        if self.cache is not None:
            dy = dy * self.cache
        return dy


def _check(cfg) -> None:
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"dropout must be in [0, 1), got {cfg.dropout}")
    if not cfg.causal:
        raise ConfigError("dropout is built for causal self-attention (a GPT)")


VARIANT = registry.declare(Variant(
    key="dropout", name="dropout", active=lambda cfg: cfg.dropout > 0, check=_check,
    # what it cannot be combined with, each design says in its own declaration (it refuses "dropout")
    describe=lambda cfg: ("dropout", f"p = {cfg.dropout:g} on attention weights and on each sublayer's output, "
                                     f"in training"),
    # its masks, kept for the backward: one beside the attention weights, two C-rows per layer
    activations=lambda cfg: cfg.n_layer * (cfg.n_head * cfg.n_ctx + 2 * cfg.d_model),
    model_cases=(("gpt [dropout 0.3, fixed masks]", dict(dropout=0.3)),
                 ("gpt [dropout 0.3, untied head]", dict(dropout=0.3, tie_head=False))),
), rank=0)
