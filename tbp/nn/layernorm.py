"""Layer normalization.   [paper §5]"""
from __future__ import annotations

import numpy as np

from .module import Module


class LayerNorm(Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias, over channels.

    x, y: (..., C); weight, bias: (C,). ``bias=False`` drops the bias (GPT-2 with biases off).
    eps = 0 is allowed (the paper's verification setting); then a constant row has no scale.
    """

    def __init__(self, d: int, eps: float = 1e-5, dtype=np.float32, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.param("weight", np.ones(d, dtype=dtype))
        if bias:
            self.param("bias", np.zeros(d, dtype=dtype))
        self.cache = None

    def forward(self, x: np.ndarray) -> np.ndarray:
        # np.add.reduce * (1/C) rather than .mean(): same numbers, less per-call overhead,
        # which dominates when decoding one token at a time
        inv_c = x.dtype.type(1.0 / x.shape[-1])
        mean = np.add.reduce(x, axis=-1, keepdims=True) * inv_c           # (..., 1)
        xc = x - mean                                                      # (..., C)
        var = np.add.reduce(xc * xc, axis=-1, keepdims=True) * inv_c      # (..., 1)
        var += x.dtype.type(self.eps)
        rstd = 1.0 / np.sqrt(var)                                          # (..., 1)
        xhat = xc * rstd                                                   # (..., C)
        self.cache = xhat, rstd
        y = xhat * self.params["weight"]
        if "bias" in self.params:
            y += self.params["bias"]
        return y

    def backward(self, dout: np.ndarray) -> np.ndarray:
        """[paper §5]  dxhat = dout * weight;
        dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))   (means over channels);
        dweight += sum over tokens of dout * xhat;  dbias += sum over tokens of dout.
        """
        xhat, rstd = self.cache
        C = dout.shape[-1]
        if "weight" in self.grads:
            self.grads["weight"] += (dout * xhat).reshape(-1, C).sum(0)
        if "bias" in self.grads:
            self.grads["bias"] += dout.reshape(-1, C).sum(0)
        inv_c = dout.dtype.type(1.0 / C)
        dxhat = dout * self.params["weight"]                               # (..., C)
        proj = np.add.reduce(dxhat * xhat, axis=-1, keepdims=True) * inv_c  # (..., 1) mean(dxhat xhat)
        dx = dxhat - np.add.reduce(dxhat, axis=-1, keepdims=True) * inv_c
        dx -= xhat * proj
        dx *= rstd
        return dx
