"""Fully connected layer and its LoRA adapter.   [paper §6; the FC layer of the reference paper]"""
from __future__ import annotations

import numpy as np

from . import gemm, init
from .module import Module


class Linear(Module):
    """y = x @ weight + bias.

    x: (..., in); y: (..., out); weight: (in, out), GPT-2's layout; bias: (out,) or absent.
    """

    def __init__(self, d_in: int, d_out: int, rng: np.random.Generator, dtype=np.float32,
                 bias: bool = True, std: float = 0.02):
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.param("weight", init.normal(rng, (d_in, d_out), std, dtype))
        if bias:
            self.param("bias", init.zeros(d_out, dtype))

    @classmethod
    def from_arrays(cls, weight: np.ndarray, bias: np.ndarray | None = None) -> "Linear":
        """A Linear holding these (in, out) weight and (out,) bias arrays (not copies)."""
        layer = cls.__new__(cls)
        Module.__init__(layer)
        layer.d_in, layer.d_out = weight.shape
        layer.param("weight", weight)
        if bias is not None:
            layer.param("bias", bias)
        return layer

    def forward(self, x: np.ndarray) -> np.ndarray:
        self.cache = x
        # fold (B, T) into one axis: one large GEMM, not B small ones
        y = gemm.matmul(x.reshape(-1, self.d_in), self.params["weight"])  # (N, out)
        b = self.params.get("bias")
        if b is not None:
            y += b
        return y.reshape(x.shape[:-1] + (self.d_out,))

    def backward(self, dout: np.ndarray) -> np.ndarray:
        """[paper §3.2 eqs. 22-24, the fully connected layer]
        dweight += x^T dout;  dbias += sum over tokens of dout;  dx = dout @ weight^T.

        Tokens are independent rows, so the batch and time axes fold into one.
        A frozen weight or bias (LoRA's base) skips its gradient entirely.
        """
        x = self.cache
        dy = dout.reshape(-1, self.d_out)                                  # (N, out)
        if "weight" in self.grads:
            gemm.matmul_add(self.grads["weight"], x.reshape(-1, self.d_in).T, dy)
        if "bias" in self.grads:
            gemm.column_sums_add(self.grads["bias"], dy)
        return gemm.matmul(dy, self.params["weight"].T).reshape(x.shape)  # (..., in)


class LoRA(Linear):
    """y = x @ weight + bias + s * (x @ lora_down) @ lora_up,  s = alpha / R.   [paper §6, eq. 43]

    x: (..., in); lora_down (the paper's d): (in, R); lora_up (u): (R, out).
    The base weight and bias are frozen: they receive no gradient, only carry the input's.
    lora_up starts at zero so the adapted layer starts exactly equal to the base.
    """

    def __init__(self, base: Linear, rank: int, alpha: float, rng: np.random.Generator):
        Module.__init__(self)
        if not 1 <= rank <= min(base.d_in, base.d_out):
            raise ValueError(f"LoRA rank must be in [1, {min(base.d_in, base.d_out)}], got {rank}")
        self.d_in, self.d_out = base.d_in, base.d_out
        self.rank, self.alpha, self.scale = rank, float(alpha), float(alpha) / rank
        dtype = base.params["weight"].dtype
        for name, value in base.params.items():
            self.param(name, value)
        self.freeze()                   # the base's weight and bias: only the adapters train
        # Kaiming-uniform-like down projection, as in the LoRA paper's reference code
        self.param("lora_down", init.uniform(rng, 1.0 / np.sqrt(self.d_in), (self.d_in, rank), dtype))
        self.param("lora_up", init.zeros((rank, self.d_out), dtype))

    def forward(self, x: np.ndarray) -> np.ndarray:
        x2 = x.reshape(-1, self.d_in)                                      # (N, in)
        h = gemm.matmul(x2, self.params["lora_down"])                      # (N, R)
        y = Linear.forward(self, x2)                                       # (N, out)
        y += self.params["lora_up"].dtype.type(self.scale) * gemm.matmul(h, self.params["lora_up"])
        self.cache = x, h
        return y.reshape(*x.shape[:-1], self.d_out)

    def backward(self, dout: np.ndarray) -> np.ndarray:
        """[paper §6, eqs. 44-46], with h = x @ lora_down:
        dlora_up += s h^T dout;  dlora_down += s x^T (dout lora_up^T);
        dx = dout weight^T + s (dout lora_up^T) lora_down^T.
        """
        x, h = self.cache
        s = self.params["lora_up"].dtype.type(self.scale)
        dy = dout.reshape(-1, self.d_out)                                  # (N, out)
        dh = s * gemm.matmul(dy, self.params["lora_up"].T)                 # (N, R)
        self.grads["lora_up"] += s * gemm.matmul(h.T, dy)
        gemm.matmul_add(self.grads["lora_down"], x.reshape(-1, self.d_in).T, dh)
        dx = gemm.matmul(dy, self.params["weight"].T)
        gemm.matmul_add(dx, dh, self.params["lora_down"].T)
        return dx.reshape(x.shape)                                         # (..., in)

    def merged(self) -> np.ndarray:
        """weight + s * lora_down @ lora_up: the plain weight this adapter folds into."""
        return self.params["weight"] + self.scale * np.dot(self.params["lora_down"], self.params["lora_up"])

    def merged_linear(self) -> Linear:
        """The plain Linear this adapter folds into (a new weight; the bias is copied)."""
        bias = self.params.get("bias")
        return Linear.from_arrays(self.merged(), None if bias is None else bias.copy())


def weight_of(layer: Linear) -> np.ndarray:
    """A Linear's (in, out) weight as inference uses it: with a LoRA adapter merged in."""
    return layer.merged() if isinstance(layer, LoRA) else layer.params["weight"]


def contraction(layer: Linear) -> np.ndarray:
    """A contracting layer's weight (in > out: an MLP's c_proj, 4C -> C) as decoding keeps it:
    transposed, (out, in) in C order, a copy. At one row per step a product only streams the
    weights, and reading a matrix with more rows than columns as dot products (one per output,
    along contiguous memory) streams it faster than as a sum of scaled rows into a short
    output: 25 GB/s against 20 for GPT-2 124M's c_proj, and 9 % more tokens a second for the
    whole step, on a 2-core EPYC with NumPy's OpenBLAS (docs/how-to/precision.md, "How
    decoding reads its matrices"). :func:`dot_contraction` multiplies by it."""
    return np.ascontiguousarray(weight_of(layer).T)


def dot_contraction(x: np.ndarray, w_t: np.ndarray, out: np.ndarray) -> None:
    """out = x @ w_t.T for x (N, in) and w_t (out, in) from :func:`contraction`: one row is a
    matrix-vector product along w_t's rows; several rows one product reading w_t transposed
    (a view: no copy)."""
    if x.shape[0] == 1:
        np.dot(w_t, x[0], out=out[0])
    else:
        np.dot(x, w_t.T, out=out)
