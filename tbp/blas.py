"""Which library does the engine's large matrix products: NumPy's BLAS, or MKL when faster.

NumPy's wheels bring OpenBLAS. On current Intel CPUs, MKL's sgemm runs the linear layers'
products in about 0.8-0.9 of OpenBLAS's time at one thread (benchmarks/README.md), and the
products are most of a training step. MKL is on the package index (``pip install 'tbp[mkl]'``
brings its ``mkl`` wheel), but no NumPy wheel links it, so this module reaches its
``cblas_sgemm`` through ctypes and installs it in the engine's one seam for products
(``tbp.nn.gemm``), the way ``parallel.py`` reaches OpenBLAS's thread count. The engine itself
still imports only NumPy.

MKL is used only where it is measured faster, on this machine, for this model's shapes, at the
start of a run: each product is timed both ways, alternated, and MKL is chosen if the median
of its rounds is at least 5 % faster. So an AMD CPU, where MKL may take slower code paths,
keeps OpenBLAS unless MKL actually wins there, and a conda NumPy (linked to MKL already) is
left as it is. MKL runs sequentially (one thread per call): tbp's default data-parallel
workers each run one-thread BLAS, and a run whose NumPy BLAS uses more threads measures
against that.

``TBP_GEMM`` overrides the choice: ``numpy`` (never MKL; bit-for-bit the same as a machine
without it), ``mkl`` (always, an error if it cannot be loaded), ``auto`` (the default).
Results equal NumPy's to float32 rounding, not bit for bit, so a run is repeatable bit for
bit given the same choice; set ``TBP_GEMM`` to pin it.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import glob
import os
import statistics
import sys
import time

import numpy as np

from .errors import TbpError
from .nn import gemm

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
SEQUENTIAL = 1                      # MKL_THREADING_SEQUENTIAL
MIN_WORK = 1 << 20                  # m k n below this: NumPy (ctypes' fixed cost is a few µs)
FASTER = 0.95                       # MKL's time / NumPy's time needed to choose MKL


def _candidates() -> list[str]:
    """Where the mkl wheel (or a system MKL) keeps libmkl_rt."""
    dirs = [os.path.join(sys.prefix, "lib"), os.path.join(sys.base_prefix, "lib")]
    try:
        import site
        dirs.append(os.path.join(site.getuserbase(), "lib"))
    except Exception:                                     # site may be stripped
        pass
    names = []
    for d in dirs:
        names += sorted(glob.glob(os.path.join(d, "libmkl_rt.so*")), reverse=True)
        names += sorted(glob.glob(os.path.join(d, "libmkl_rt*.dylib")), reverse=True)
    names += sorted(glob.glob(os.path.join(sys.prefix, "Library", "bin", "mkl_rt*.dll")), reverse=True)
    found = ctypes.util.find_library("mkl_rt")
    return names + ([found] if found else [])


def _layout(a: np.ndarray) -> tuple[int, int] | None:
    """(transpose flag, leading dimension) of a float32 matrix as cblas reads it, or None
    if it is neither row- nor column-contiguous (NumPy then does the product)."""
    s0, s1 = a.strides
    rows, cols = a.shape
    if s1 == 4 and s0 % 4 == 0 and s0 >= 4 * cols:
        return NO_TRANS, s0 // 4
    if s0 == 4 and s1 % 4 == 0 and s1 >= 4 * rows:     # a transposed view, x.T or W.T
        return TRANS, s1 // 4
    return None


class MKL:
    """MKL's cblas_sgemm with NumPy's calling conventions, for the engine's seam (tbp.nn.gemm)."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        # the threading layer must be chosen before any other call into MKL
        lib.MKL_Set_Threading_Layer.argtypes = [ctypes.c_int]
        lib.MKL_Set_Threading_Layer(SEQUENTIAL)
        c_int, c_float, ptr = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
        self._sgemm = lib.cblas_sgemm
        self._sgemm.argtypes = [c_int, c_int, c_int, c_int, c_int, c_int, c_float, ptr, c_int,
                                ptr, c_int, c_float, ptr, c_int]
        self._sgemm.restype = None
        buf = ctypes.create_string_buffer(256)
        lib.MKL_Get_Version_String(buf, len(buf))
        text = buf.value.decode(errors="replace")
        self.version = next((w.split("-")[0] for w in text.split() if w[:1].isdigit()), "?")
        self.path = path

    def _call(self, a, b, out, beta: float) -> bool:
        if not (a.dtype == b.dtype == out.dtype == np.float32):
            return False
        m, k = a.shape
        n = b.shape[1]
        if m * k * n < MIN_WORK or min(m, k, n) < 2:
            return False
        la, lb = _layout(a), _layout(b)
        if la is None or lb is None or out.strides != (4 * n, 4):
            return False
        self._sgemm(ROW_MAJOR, la[0], lb[0], m, n, k, 1.0, a.ctypes.data, la[1],
                    b.ctypes.data, lb[1], beta, out.ctypes.data, n)
        return True

    @staticmethod
    def batched_matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Attention's per-head products stay NumPy's: through MKL (cblas_sgemm_batch_strided, or
        one call per head where the outputs interleave) a 6 x 384, T 256 step measured 0.99-1.01x."""
        return np.matmul(a, b, out=out)

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """a @ b (a new array): sgemm for large float32 products, NumPy for the rest."""
        if a.ndim == b.ndim == 2 and a.dtype == np.float32:
            out = np.empty((a.shape[0], b.shape[1]), np.float32)
            if self._call(a, b, out, 0.0):
                return out
        return np.dot(a, b)

    def matmul_add(self, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        """out += a @ b in place (sgemm with beta = 1: no temporary)."""
        if not (a.ndim == b.ndim == out.ndim == 2 and self._call(a, b, out, 1.0)):
            out += np.dot(a, b)


@functools.cache
def mkl() -> MKL | None:
    """The MKL found beside this Python (the ``mkl`` wheel), loaded once; None if none."""
    for path in _candidates():
        try:
            return MKL(path)
        except (OSError, AttributeError):
            continue
    return None


def numpy_blas() -> str:
    """The BLAS NumPy was built with, as NumPy reports it ('scipy-openblas 0.3.31', 'mkl ...')."""
    try:
        info = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{info.get('name', '?')} {info.get('version', '')}".strip()
    except Exception:                                     # the config format is NumPy's, not ours
        return "unknown"


@dataclasses.dataclass(frozen=True)
class Choice:
    """The library chosen for the engine's products, and why."""
    name: str                  # "numpy" or "mkl"
    reason: str                # one line for a person
    ratio: float | None = None  # MKL's time / NumPy's on the model's products, when measured


def products(d_model: int, rows: int, hidden: int | None = None) -> tuple:
    """The linear layers' product shapes for ``rows`` tokens: (m, k, n, transpose a, transpose b)
    for y = x W, dW = x^T dy and dx = dy W^T of the attention projection and the MLP."""
    C, H, N = d_model, hidden or 4 * d_model, rows
    return ((N, C, 3 * C, False, False), (C, N, H, True, False), (N, H, C, False, True))


def _operands(shape, rng) -> tuple[np.ndarray, np.ndarray]:
    m, k, n, ta, tb = shape
    a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
    return (a.T if ta else a), (b.T if tb else b)


def measure(lib: MKL, shapes, rounds: int = 5) -> float:
    """MKL's time / NumPy's for these products: each round times every product both ways, one
    after the other, so that the machine's drift falls on both; the median round's ratio."""
    rng = np.random.default_rng(0)
    pairs = [_operands(s, rng) for s in shapes]
    for a, b in pairs:                                    # warm both: first calls load code
        np.dot(a, b), lib.matmul(a, b)
    ratios = []
    for _ in range(rounds):
        t_np = t_mkl = 0.0
        for a, b in pairs:
            t = time.perf_counter()
            np.dot(a, b)
            t_np += time.perf_counter() - t
            t = time.perf_counter()
            lib.matmul(a, b)
            t_mkl += time.perf_counter() - t
        ratios.append(t_mkl / t_np)
    return statistics.median(ratios)


def choose(shapes: tuple, blas_threads: int | None = None) -> Choice:
    """What this run's products should use. ``blas_threads``: NumPy's BLAS thread count, which
    the caller has set (NumPy is measured at it; a measurement is made once per shapes and count)."""
    mode = os.environ.get("TBP_GEMM", "auto").strip().lower() or "auto"
    if mode not in ("auto", "numpy", "mkl"):
        raise TbpError(f"TBP_GEMM must be auto, numpy or mkl, got {mode!r}")
    if mode == "numpy":
        return Choice("numpy", "TBP_GEMM=numpy")
    own, lib = numpy_blas(), mkl()
    if mode == "mkl":
        if lib is None:
            raise TbpError("TBP_GEMM=mkl, but MKL cannot be loaded: pip install 'tbp[mkl]' (x86-64 only)")
        return Choice("mkl", f"MKL {lib.version}, TBP_GEMM=mkl")
    if lib is None:
        return Choice("numpy", f"{own}; MKL not installed")
    if own.lower().startswith("mkl"):
        return Choice("numpy", f"{own}: NumPy's own BLAS is MKL already")
    ratio = _measured(tuple(shapes), blas_threads)
    if ratio <= FASTER:
        return Choice("mkl", f"MKL {lib.version}, measured at {ratio:.2f}x the time of {own}", ratio)
    return Choice("numpy", f"{own}; MKL {lib.version} measured at {ratio:.2f}x its time", ratio)


@functools.cache
def _measured(shapes: tuple, blas_threads: int | None) -> float:
    return measure(mkl(), shapes)


@contextlib.contextmanager
def engaged(choice: Choice):
    """Install ``choice`` in the engine's seam for the block."""
    lib = mkl() if choice.name == "mkl" else None
    with gemm.using(lib):
        yield
