"""The engine's large matrix products, behind one seam.

Training spends 50-75 % of a step in matrix products: the linear layers' (and the tied
head's) y = x W, dW += x^T dy, dx = dy W^T, and attention's per-head S = q k^T, P v and their
gradients. They all go through the functions here, so that the library doing them can be
chosen without touching a layer:

    matmul(a, b)                  a: (m, k), b: (k, n)  ->  new (m, n) array, a @ b
    matmul_add(out, a, b)         out (m, n) += a @ b, in place
    batched_matmul(a, b, out)     a: (B, H, m, k), b: (B, H, k, n)  ->  out (B, H, m, n), or a
                                  new array if out is None: every head's product at once

(and ``column_sums_add``, a bias gradient as a matrix-vector product, always NumPy's).

By default they are NumPy's (``np.dot``, ``np.matmul``: whatever BLAS NumPy was built with).
A program can install another library with ``use``: any object with these three methods.
tbp's front end installs MKL's sgemm when the optional ``mkl`` extra is present and measures
faster on the machine (``tbp/blas.py``). Whatever is installed must equal NumPy's products to
float32 rounding; the engine imports nothing but NumPy either way.

Callers write ``gemm.matmul(...)``, never ``from .gemm import matmul``: the name is looked up
at each call, so what ``use`` installs is what runs. Products that are never large (one-token
decoding, float64 checks of tiny models) keep calling NumPy directly.
"""
from __future__ import annotations

import contextlib

import numpy as np


class NumPy:
    """The default library: NumPy's own products."""

    @staticmethod
    def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.dot(a, b)

    @staticmethod
    def matmul_add(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        out += np.dot(a, b)                 # a temporary holds the product

    @staticmethod
    def batched_matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return np.matmul(a, b, out=out)


library = NumPy()
matmul, matmul_add, batched_matmul = library.matmul, library.matmul_add, library.batched_matmul


def column_sums_add(out: np.ndarray, a: np.ndarray) -> None:
    """out (n,) += the sum of a's rows, a: (m, n): a bias gradient. As the product ones(m) @ a,
    a matrix-vector product, which BLAS does 1.5-4x faster than np.add.reduce(a, axis=0)."""
    out += np.dot(np.ones(a.shape[0], a.dtype), a)


def use(lib=None) -> None:
    """Install ``lib``'s matmul, matmul_add and batched_matmul; None restores NumPy's."""
    global library, matmul, matmul_add, batched_matmul
    library = lib if lib is not None else NumPy()
    matmul, matmul_add, batched_matmul = library.matmul, library.matmul_add, library.batched_matmul


@contextlib.contextmanager
def using(lib=None):
    """``use`` for the duration of a block, then put back what was there."""
    before = library
    use(lib)
    try:
        yield
    finally:
        use(before)
