"""Layer normalization.   [paper §5]"""
from __future__ import annotations

import numpy as np

from . import gemm, init, registry
from .module import Module


def fold(gain: np.ndarray, shift: np.ndarray | None, W: np.ndarray, b: np.ndarray | None = None,
         col_scale=None) -> np.ndarray:
    """(C + 1, out) matrix M of the linear layer (W, b) that reads a norm's output xhat * gain +
    shift, with [xhat, 1] @ M == ((xhat * gain + shift) @ W + b) * col_scale.

    (xhat * g + s) @ W + b = xhat @ (g[:, None] * W) + (s @ W + b): the gain scales W's rows,
    and the shift and the bias become one more row, read by a constant-1 column after xhat.
    ``col_scale`` (out,) scales output columns (the attention scale on the queries, for example).
    Every norm whose output is an affine map of its normalised rows folds this way.
    """
    d_in, d_out = W.shape
    M = np.empty((d_in + 1, d_out), W.dtype)
    np.multiply(W, gain[:, None], out=M[:d_in])
    M[d_in] = 0 if shift is None else np.dot(shift, W)
    if b is not None:
        M[d_in] += b
    if col_scale is not None:
        M *= col_scale.astype(W.dtype)
    return M


@registry.norm("layer")
class LayerNorm(Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias, over channels.

    x, y: (..., C); weight, bias: (C,). ``bias=False`` drops the bias (GPT-2 with biases off).
    eps = 0 is allowed (the paper's verification setting); then a constant row has no scale.
    The plain form of the same equations is ``reference.layernorm_forward``/``_backward``.
    """

    def __init__(self, d: int, eps: float = 1e-5, dtype=np.float32, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.param("weight", init.ones(d, dtype))
        if bias:
            self.param("bias", init.zeros(d, dtype))
        self._avg = None

    @classmethod
    def from_config(cls, cfg, dtype) -> "LayerNorm":
        return cls(cfg.d_model, cfg.ln_eps, dtype, cfg.bias)

    def _mean_vector(self, dtype) -> np.ndarray:
        """(C, 1) column of 1/C: a mean over channels as one matrix-vector product."""
        avg = self._avg
        if avg is None or avg.dtype != dtype:
            C = self.params["weight"].shape[0]
            avg = self._avg = np.full((C, 1), 1.0 / C, dtype=dtype)
        return avg

    def forward(self, x: np.ndarray) -> np.ndarray:
        # Few, in-place passes on a 2-D view: the mean as a product with a column of 1/C, the
        # variance as one row-wise dot product (no squared copy), a multiply by 1/std
        x2 = x.reshape(-1, x.shape[-1])                                    # (N, C)
        avg = self._mean_vector(x2.dtype)
        xc = x2 - np.dot(x2, avg)                                          # (N, C) x - mean
        rstd = np.einsum("ij,ij->i", xc, xc)[:, None]                      # (N, 1) sum of xc^2
        rstd *= x.dtype.type(1.0 / x2.shape[1])
        rstd += x.dtype.type(self.eps)
        np.sqrt(rstd, out=rstd)
        np.reciprocal(rstd, out=rstd)                                      # 1 / sqrt(var + eps)
        xhat = xc
        xhat *= rstd                                                       # (N, C), in xc's memory
        self.cache = xhat, rstd
        y = xhat * self.params["weight"]
        if "bias" in self.params:
            y += self.params["bias"]
        return y.reshape(x.shape)

    def backward(self, dout: np.ndarray) -> np.ndarray:
        """[paper §5]  dxhat = dout * weight;
        dx = (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) / std   (means over channels);
        dweight += sum over tokens of dout * xhat;  dbias += sum over tokens of dout.
        """
        xhat, rstd = self.cache                                            # (N, C), (N, 1)
        dy = dout.reshape(xhat.shape)                                      # (N, C)
        w = self.params["weight"]
        dy_xhat = dy * xhat                                                # (N, C)
        if "weight" in self.grads:
            gemm.column_sums_add(self.grads["weight"], dy_xhat)
        if "bias" in self.grads:
            gemm.column_sums_add(self.grads["bias"], dy)
        # with dxhat = dy * weight, both means are products with the column weight / C
        w_avg = (w * w.dtype.type(1.0 / w.shape[0])).reshape(-1, 1)        # (C, 1)
        mean_dxhat_xhat = np.dot(dy_xhat, w_avg)                           # (N, 1)
        dx = dy * w                                                        # (N, C) dxhat
        dx -= np.dot(dy, w_avg)                                            # minus mean(dxhat)
        dx -= np.multiply(xhat, mean_dxhat_xhat, out=dy_xhat)
        dx *= rstd
        return dx.reshape(dout.shape)

    # --- inference (decode.py) --------------------------------------------------------------
    def fold(self, W: np.ndarray, b: np.ndarray | None = None, col_scale=None) -> np.ndarray:
        """(C + 1, out) matrix M of the linear layer (W, b) that reads this norm's output, with
        [xhat, 1] @ M == (layernorm(x) @ W + b) * col_scale (:func:`fold`)."""
        return fold(self.params["weight"], self.params.get("bias"), W, b, col_scale)

    def decode_vectors(self, dtype) -> tuple[np.ndarray, np.ndarray]:
        """(C, 1) column of 1/C, and (C+1, 1) column [1/C, ..., 1/C, eps] for mean(xc^2) + eps."""
        avg = self._mean_vector(dtype)
        return avg, np.append(avg, [[self.eps]], axis=0).astype(dtype)

    @staticmethod
    def decode(rows, vectors) -> None:
        """rows.xa[:, :C] = (rows.x - mean) / sqrt(var + eps): six calls, whatever the rows.

        rows.sq and rows.xa are (N, C + 1) with a last column of ones: in sq it brings in eps
        (vectors[1]'s last entry), in xa the folded matrix's bias row.
        """
        avg, avg_eps = vectors
        np.dot(rows.x, avg, out=rows.mean)
        np.subtract(rows.x, rows.mean, out=rows.xc)
        np.multiply(rows.xc, rows.xc, out=rows.sq_c)
        np.dot(rows.sq, avg_eps, out=rows.std)                               # var + eps
        np.sqrt(rows.std, out=rows.std)
        np.divide(rows.xc, rows.std, out=rows.xa_c)
