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
        self._avg = None

    def _mean_vector(self, x: np.ndarray) -> np.ndarray:
        """(C, 1) column of 1/C: a mean over channels as one matrix-vector product."""
        avg = self._avg
        if avg is None or avg.dtype != x.dtype:
            avg = self._avg = np.full((x.shape[-1], 1), 1.0 / x.shape[-1], dtype=x.dtype)
        return avg

    def forward(self, x: np.ndarray) -> np.ndarray:
        # Few, in-place operations on a 2-D view: when decoding one token at a time the cost
        # of a layer norm is its number of numpy calls, not its arithmetic.
        x2 = x.reshape(-1, x.shape[-1])                                    # (N, C)
        avg = self._mean_vector(x2)
        xc = x2 - np.dot(x2, avg)                                          # (N, C) centred
        std = np.dot(xc * xc, avg)                                         # (N, 1) variance
        std += x.dtype.type(self.eps)
        np.sqrt(std, out=std)
        xc /= std                                                          # xhat, in place
        self.cache = xc, std
        y = xc * self.params["weight"]
        if "bias" in self.params:
            y += self.params["bias"]
        return y.reshape(x.shape)

    def backward(self, dout: np.ndarray) -> np.ndarray:
        """[paper §5]  dxhat = dout * weight;
        dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))   (means over channels);
        dweight += sum over tokens of dout * xhat;  dbias += sum over tokens of dout.
        """
        xhat, std = self.cache                                             # (N, C), (N, 1)
        d2 = dout.reshape(xhat.shape)
        if "weight" in self.grads:
            self.grads["weight"] += (d2 * xhat).sum(0)
        if "bias" in self.grads:
            self.grads["bias"] += d2.sum(0)
        avg = self._mean_vector(d2)
        dxhat = d2 * self.params["weight"]                                 # (N, C)
        proj = np.dot(dxhat * xhat, avg)                                   # (N, 1) mean(dxhat xhat)
        dx = dxhat - np.dot(dxhat, avg)
        dx -= xhat * proj
        dx /= std
        return dx.reshape(dout.shape)
