"""Muon (Jordan et al. 2024): the hidden matrices' momentum, orthogonalised, as their update;
AdamW for everything else. By hand, in NumPy.

For a hidden weight W (a block's attention and MLP matrices) with gradient G, each step:

    B <- mu B + G                          (momentum)
    M  = G + mu B                          (Nesterov: the gradient, then the momentum's look-ahead)
    O  = NewtonSchulz5(M)                  (about U V^T of M's SVD M = U S V^T)
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(r, c)) O

NewtonSchulz5 (Jordan's quintic, five steps): X = M / ||M||_F, transposed so that it is wide
(r <= c); then five times

    A = X X^T;   X <- a X + (b A + c A A) X,   (a, b, c) = (3.4445, -4.7750, 2.0315)

which maps each singular value s of X (all in (0, 1] after the scaling) through the odd
polynomial a s + b s^3 + c s^5, pushing it towards 1 fast from anywhere in (0, 1): the result has
M's singular vectors and singular values near 1 (between about 0.7 and 1.2 -- the quintic trades
exactness for speed; an update needs its direction, not unit singular values). The factor
0.2 sqrt(max(r, c)) is Moonshot's ("Muon is scalable for LLM training", 2025): it gives the
update the root-mean-square size AdamW's updates have, so that one learning rate and one
schedule serve both halves of the model.

Embeddings, the head, norms' gains and biases are not hidden matrices (an embedding's rows are
independent lookups, a vector has no singular values): AdamW updates them, at the same rate.
"""
from __future__ import annotations

import math
import re

import numpy as np

from .optim import AdamW, restore
from .optimizers import optimizer

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
RMS_MATCH = 0.2                  # Moonshot's: the update's RMS that of AdamW's
HIDDEN = re.compile(r"(^|\.)h\.\d+\.(?!.*lora_).*weight$")    # a block's matrix (GPT's h.N., the encoder's enc.h.N.)


def newton_schulz(m: np.ndarray, steps: int = NS_STEPS) -> np.ndarray:
    """Jordan's quintic Newton-Schulz iteration: m (r, c) -> about U V^T of its SVD, in m's dtype."""
    a, b, c = (m.dtype.type(k) for k in NS_COEFFICIENTS)
    wide = m.shape[0] <= m.shape[1]
    x = m if wide else m.T
    x = x / (np.linalg.norm(x) + m.dtype.type(1e-7))           # singular values in (0, 1]
    for _ in range(steps):
        A = x @ x.T                                            # (r, r): the small side
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    return x if wide else x.T


def is_hidden(name: str, shape: tuple) -> bool:
    """A block's 2-D weight: what Muon updates (not an embedding, the head, a gain or a bias)."""
    return len(shape) == 2 and HIDDEN.search(name) is not None


@optimizer("muon")
class Muon:
    """Muon on a layout's hidden matrices, AdamW on the rest (an AdamW over the whole layout that
    updates only the spans outside them). ``momentum`` mu, ``ns_steps`` iterations; weight decay
    as AdamW's (decoupled, matrices only)."""

    def __init__(self, layout, weight_decay: float = 0.1, beta1: float = 0.9, beta2: float = 0.99,
                 eps: float = 1e-8, momentum: float = 0.95, ns_steps: int = NS_STEPS):
        self.layout, self.weight_decay, self.mu, self.ns_steps = layout, weight_decay, momentum, ns_steps
        self.hidden = [n for n, e in layout.entries.items() if is_hidden(n, e.shape)]
        if not self.hidden:
            raise ValueError("Muon has no hidden matrix to update here (a LoRA run's adapters, say): use AdamW")
        self.adam = AdamW(layout, weight_decay, beta1, beta2, eps)
        taken = sorted((layout.entries[n].offset, layout.entries[n].offset + layout.entries[n].size)
                       for n in self.hidden)
        spans, at = [], 0
        for lo, hi in taken:
            if lo > at:
                spans.append((at, lo))
            at = hi
        if at < layout.size:
            spans.append((at, layout.size))
        self.adam.spans = spans                     # AdamW's share: everything else
        self.buffer = {n: np.zeros(layout.entries[n].shape, layout.params.dtype) for n in self.hidden}
        params, grads = layout.views(layout.params), layout.views(layout.grads)     # the buffers stay put
        self._matrices = [(params[n], grads[n], self.buffer[n]) for n in self.hidden]

    @classmethod
    def from_config(cls, layout, cfg) -> "Muon":
        return cls(layout, cfg.weight_decay, cfg.beta1, cfg.beta2, momentum=cfg.muon_momentum)

    # the loop sets and reads these on the optimizer: the AdamW half's
    @property
    def t(self) -> int:
        return self.adam.t

    @t.setter
    def t(self, value: int) -> None:
        self.adam.t = value

    @property
    def workers(self):
        return self.adam.workers

    @workers.setter
    def workers(self, value) -> None:
        self.adam.workers = value

    def step(self, lr: float) -> None:
        self.adam.step(lr)
        f = self.layout.params.dtype.type
        mu, decay = f(self.mu), f(1 - lr * self.weight_decay)
        for p, g, buf in self._matrices:
            buf *= mu
            buf += g
            update = newton_schulz(g + mu * buf, self.ns_steps)              # Nesterov's look-ahead
            if self.weight_decay:
                p *= decay
            p -= f(lr * RMS_MATCH * math.sqrt(max(p.shape))) * update

    def buffers(self) -> list[np.ndarray]:
        """Every array of its state, for ranks to share rank 0's."""
        return [self.adam.m, self.adam.v, *self.buffer.values()]

    def state_arrays(self) -> dict[str, np.ndarray]:
        """m.<name> and v.<name> of the AdamW half, momentum.<name> of each hidden matrix."""
        hidden = set(self.hidden)
        out = {k: a for k, a in self.adam.state_arrays().items() if k.split(".", 1)[1] not in hidden}
        out.update({f"momentum.{n}": b for n, b in self.buffer.items()})
        return out

    def load_state_arrays(self, arrays: dict[str, np.ndarray], t: int) -> None:
        restore(self.state_arrays(), arrays, "Muon's for this model (was the run trained with another --optimizer?)")
        self.t = t
