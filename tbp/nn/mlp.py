"""The expand-and-contract sublayer: c_fc -> GELU or ReLU -> c_proj.   [paper §7]"""
from __future__ import annotations

import numpy as np

from .linear import Linear
from .module import Module

_GELU_K = np.sqrt(2.0 / np.pi)
_GELU_A = 0.044715
_CONSTANTS: dict = {}


def _constants(dtype) -> dict:
    """GELU's constants as scalars of ``dtype``, made once (not per call: decoding is per call)."""
    c = _CONSTANTS.get(dtype)
    if c is None:
        f, k, a = np.dtype(dtype).type, _GELU_K, _GELU_A
        c = _CONSTANTS[dtype] = {"-2ka": f(-2 * k * a), "2k": f(2 * k), "6ka": f(6 * k * a)}
    return c


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
        # (1 + tanh z) / 2 == sigmoid(2z): one exp instead of a tanh (~1.5x cheaper per
        # element), and s is all the backward needs besides u. Built in place: s = -2z first.
        c = _constants(u.dtype)
        s = u * u                                                          # (B, T, 4C)
        s *= c["-2ka"]
        s -= c["2k"]
        s *= u                                                             # -2z = -2k (u + a u^3)
        # for u below about -10, exp(-2z) overflows to inf and s = 1 / (1 + inf) = 0: the right
        # limit, so the overflow is expected (silencing it is cheaper than clamping every element)
        with np.errstate(over="ignore"):
            np.exp(s, out=s)
        s += 1
        np.reciprocal(s, out=s)                                            # s = sigmoid(2z)
        self.cache = u, s
        return self.c_proj.forward(u * s)                                  # gelu(u) = u s

    def backward(self, dout: np.ndarray) -> np.ndarray:
        """[paper §7, FC_expand > g > FC_contract]  GELU: g = u s with s = sigmoid(2z), z = k (u + a u^3), so
        dg/du = s + u s (1 - s) 2k (1 + 3a u^2)   (= (1 + tanh z)/2 + u/2 (1 - tanh^2 z) dz/du).
        ReLU: dg/du = [u > 0].
        """
        dg = self.c_proj.backward(dout)                                    # (B, T, 4C)
        if self.activation == "relu":
            u = self.cache
            dg *= u > 0
            return self.c_fc.backward(dg)
        u, s = self.cache
        c = _constants(u.dtype)
        t = u * u                                                          # (B, T, 4C)
        t *= c["6ka"]
        t += c["2k"]
        t *= u                                                             # 2k u (1 + 3a u^2)
        # dg/du = s + t s (1 - s) = s (1 + t (1 - s)), built in u's memory: u is not needed again
        np.subtract(1, s, out=u)
        u *= t
        u += 1
        u *= s
        dg *= u
        self.cache = None
        return self.c_fc.backward(dg)
