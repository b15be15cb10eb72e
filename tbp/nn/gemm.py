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
faster on the machine (``tbp/machine/libraries.py``). Whatever is installed must equal NumPy's products to
float32 rounding; the engine imports nothing but NumPy either way.

Callers write ``gemm.matmul(...)``, never ``from .gemm import matmul``: the name is looked up
at each call, so what ``use`` installs is what runs. Products that are never large (one-token
decoding, float64 checks of tiny models) keep calling NumPy directly.

**Precision is this seam's business alone.** A bf16 library (``tbp train --precision bf16``)
rounds the two operands of ``matmul`` and ``matmul_add`` to bfloat16 and accumulates in float32;
its inputs and outputs stay float32 arrays, so no layer knows. :class:`BF16` here is its plain
twin: round each operand to the nearest bf16 (:func:`round_bf16`), then an ordinary float32
product. The product of two bf16 numbers is exact in float32 (8 + 8 significant bits of 24),
so the twin computes exactly "bf16 inputs, fp32 accumulation"; a library with bf16 hardware
computes the same sums in another order.
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


def round_bf16(x: np.ndarray) -> np.ndarray:
    """x (float32, any shape) rounded to the nearest bfloat16, ties to even, as float32 values.

    bfloat16 is float32's upper 16 bits: its sign, all 8 exponent bits and 7 of the 23
    fraction bits. Rounding to nearest-even adds 0x7FFF plus the lowest kept bit to the
    float32's bits and clears the 16 dropped ones; a carry out of the fraction steps the
    exponent, which is correct rounding too (up to infinity past bf16's largest finite value,
    as IEEE rounding does). NaN is kept NaN (the addition could turn a NaN whose payload sits
    in the dropped bits into infinity). Unit roundoff: 2^-8.
    """
    if x.dtype != np.float32:
        raise TypeError(f"round_bf16 takes float32, got {x.dtype}")
    u = x.view(np.uint32)                   # the same memory, read as bits (any layout)
    r = (u >> 16) & 1                       # the lowest kept bit: ties go to the even neighbour
    r += 0x7FFF
    r += u
    r &= 0xFFFF0000
    out = r.view(np.float32)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = x[nan]
    return out


class BF16(NumPy):
    """bf16 products, the plain twin: operands rounded to bfloat16, a float32 product.

    ``matmul`` and ``matmul_add`` (the linear layers and the head) are bf16; ``batched_matmul``
    (attention's per-head products) stays float32, as NumPy's. Arrays that are not float32
    (float64 checks) pass through unrounded."""

    @staticmethod
    def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if a.dtype == b.dtype == np.float32:
            a, b = round_bf16(a), round_bf16(b)
        return np.dot(a, b)

    @classmethod
    def matmul_add(cls, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        out += cls.matmul(a, b)


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
