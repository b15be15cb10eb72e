"""The engine's large matrix products, behind one seam.

Training spends 50-75 % of a step in the linear layers' products (and the tied head's):
y = x W, dW += x^T dy, dx = dy W^T. They all go through the two functions here, so that the
library doing them can be chosen without touching a layer:

    matmul(a, b)              a: (m, k), b: (k, n)  ->  new (m, n) array, a @ b
    matmul_add(out, a, b)     out (m, n) += a @ b, in place

(and ``column_sums_add``, a bias gradient as a matrix-vector product, always NumPy's).

By default both are NumPy's ``np.dot`` (whatever BLAS NumPy was built with). A program can
install other implementations with ``use``; tbp's front end installs MKL's sgemm when the
optional ``mkl`` extra is present and measures faster on the machine (``tbp/blas.py``).
Whatever is installed must equal NumPy's product to float32 rounding; the engine imports
nothing but NumPy either way.

Callers write ``gemm.matmul(...)``, never ``from .gemm import matmul``: the name is looked up
at each call, so what ``use`` installs is what runs. Products that are not large (one-token
decoding, the per-head attention products, float64 checks of tiny models) keep calling NumPy
directly.
"""
from __future__ import annotations

import contextlib

import numpy as np


def numpy_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b as a new array, by NumPy."""
    return np.dot(a, b)


def numpy_matmul_add(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """out += a @ b, by NumPy (a temporary holds the product)."""
    out += np.dot(a, b)


matmul = numpy_matmul
matmul_add = numpy_matmul_add


def column_sums_add(out: np.ndarray, a: np.ndarray) -> None:
    """out (n,) += the sum of a's rows, a: (m, n): a bias gradient. As the product ones(m) @ a,
    a matrix-vector product, which BLAS does 1.5-4x faster than np.add.reduce(a, axis=0)."""
    out += np.dot(np.ones(a.shape[0], a.dtype), a)


def use(product=None, product_add=None) -> None:
    """Install ``product(a, b)`` and ``product_add(out, a, b)``; None restores NumPy's."""
    global matmul, matmul_add
    matmul = product or numpy_matmul
    matmul_add = product_add or numpy_matmul_add


@contextlib.contextmanager
def using(product=None, product_add=None):
    """``use`` for the duration of a block, then put back what was there."""
    before = matmul, matmul_add
    use(product, product_add)
    try:
        yield
    finally:
        use(*before)
