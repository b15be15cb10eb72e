"""The expand-and-contract sublayer: c_fc -> GELU or ReLU -> c_proj.   [paper §7]"""
from __future__ import annotations

import numpy as np

from .linear import Linear
from .module import Module

_GELU_K = np.sqrt(2.0 / np.pi)
_GELU_A = 0.044715


class MLP(Module):
    """y = c_proj(g(c_fc(x))).  x, y: (B, T, C); c_fc.weight: (C, 4C); c_proj.weight: (4C, C).

    g is GPT-2's tanh-approximated GELU, g(u) = u/2 (1 + tanh(k (u + a u^3))), or ReLU.
    """

    def __init__(self, d_model: int, rng: np.random.Generator, dtype=np.float32, bias: bool = True,
                 activation: str = "gelu", proj_std: float = 0.02):
        super().__init__()
        self.activation = activation
        self.c_fc = self.add("c_fc", Linear(d_model, 4 * d_model, rng, dtype, bias))
        self.c_proj = self.add("c_proj", Linear(4 * d_model, d_model, rng, dtype, bias, std=proj_std))
        self.collect()
        self.cache = None

    def forward(self, x: np.ndarray) -> np.ndarray:
        u = self.c_fc.forward(x)                                           # (B, T, 4C)
        if self.activation == "relu":
            self.cache = u
            return self.c_proj.forward(np.maximum(u, 0))
        k, a = u.dtype.type(_GELU_K), u.dtype.type(_GELU_A)
        th = np.tanh(k * (u + a * u * u * u))                              # (B, T, 4C)
        self.cache = u, th                    # backward needs tanh again: keep it, don't recompute
        return self.c_proj.forward(0.5 * u * (1 + th))

    def backward(self, dout: np.ndarray) -> np.ndarray:
        """dg/du = (1 + tanh)/2 + u/2 (1 - tanh^2) k (1 + 3 a u^2) for GELU; [u > 0] for ReLU."""
        dg = self.c_proj.backward(dout)                                    # (B, T, 4C)
        if self.activation == "relu":
            u = self.cache
            return self.c_fc.backward(dg * (u > 0))
        u, th = self.cache
        k, a = u.dtype.type(_GELU_K), u.dtype.type(_GELU_A)
        du = 0.5 * (1 + th) + 0.5 * u * (1 - th * th) * k * (1 + 3 * a * u * u)
        return self.c_fc.backward(dg * du)
