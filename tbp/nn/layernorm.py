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
        y = np.multiply(xc, xc)                                            # scratch, then the output
        std = np.dot(y, avg)                                               # (N, 1) variance
        std += x.dtype.type(self.eps)
        np.sqrt(std, out=std)
        xc /= std                                                          # xhat, in place
        self.cache = xc, std
        np.multiply(xc, self.params["weight"], out=y)
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
        w = self.params["weight"]
        m = d2 * xhat                                                      # (N, C)
        if "weight" in self.grads:
            self.grads["weight"] += np.add.reduce(m, axis=0)
        if "bias" in self.grads:
            self.grads["bias"] += np.add.reduce(d2, axis=0)
        # with dxhat = dout * weight, both means are products with the column weight / C
        w_avg = (w * w.dtype.type(1.0 / w.shape[0])).reshape(-1, 1)        # (C, 1)
        proj = np.dot(m, w_avg)                                            # (N, 1) mean(dxhat xhat)
        dx = d2 * w                                                        # (N, C) dxhat
        dx -= np.dot(d2, w_avg)                                            # minus mean(dxhat)
        dx -= np.multiply(xhat, proj, out=m)
        dx /= std
        return dx.reshape(dout.shape)
