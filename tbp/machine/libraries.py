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
without it), ``mkl`` (always, an error if it cannot be loaded), ``onednn`` (bf16 runs: oneDNN's
product, an error if it cannot be loaded), ``auto`` (the default).
Results equal NumPy's to float32 rounding, not bit for bit, so a run is repeatable bit for
bit given the same choice; set ``TBP_GEMM`` to pin it.

**bf16** (``tbp train --precision bf16``): the linear layers' and the head's products take
bfloat16 operands and accumulate in float32. MKL's ``cblas_gemm_bf16bf16f32`` does them where it
loads (converting each float32 operand to bf16 first, round to nearest even); elsewhere, or with
``TBP_GEMM=numpy``, the engine's plain twin (``gemm.BF16``: round, then a float32 product) does
the same arithmetic. oneDNN's matrix product (``tbp.machine.onednn``, the ``onednn`` extra: the library
PyTorch's CPU autocast runs on) does it too, and chooses its kernel by the instructions the CPU
reports, whoever made it. Whether bf16 is *faster* is measured like MKL's sgemm, against the
fp32 choice, on the model's shapes, for each bf16 library that loads, and the fastest is used:
it depends on the CPU (MKL's bf16 kernels are made for Intel's AMX and AVX512-BF16 units; on an
AMD EPYC with AVX512-BF16 they measured slower than fp32, oneDNN's faster, see
docs/how-to/precision.md), and the choice says so in one line.
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

from ..errors import TbpError
from ..nn import gemm

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
    """(transpose flag, leading dimension) of a matrix as cblas reads it, or None if it is
    neither row- nor column-contiguous (NumPy then does the product)."""
    s0, s1 = a.strides
    rows, cols = a.shape
    size = a.itemsize
    if s1 == size and s0 % size == 0 and s0 >= size * cols:
        return NO_TRANS, s0 // size
    if s0 == size and s1 % size == 0 and s1 >= size * rows:     # a transposed view, x.T or W.T
        return TRANS, s1 // size
    return None


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """x (float32) rounded to the nearest bfloat16 (ties to even), as the uint16 bit patterns
    MKL's bf16 products read; x's layout is kept (a transposed view stays one). ml_dtypes does
    it in one pass where installed (the mkl extra brings it); otherwise the engine's
    ``gemm.round_bf16`` and a shift, the same numbers in three passes."""
    try:
        import ml_dtypes
    except ImportError:                                   # optional: the same bits, slower
        bits = (gemm.round_bf16(x).view(np.uint32) >> 16).astype(np.uint16)
        # a NaN whose payload sat in the dropped bits would read as infinity: keep it a (quiet) NaN
        bits[np.isnan(x)] |= 0x0040
        return bits
    return x.astype(ml_dtypes.bfloat16).view(np.uint16)


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
        self._bf16 = getattr(lib, "cblas_gemm_bf16bf16f32", None)       # MKL 2020 and later
        if self._bf16 is not None:
            self._bf16.argtypes = self._sgemm.argtypes
            self._bf16.restype = None
        buf = ctypes.create_string_buffer(256)
        lib.MKL_Get_Version_String(buf, len(buf))
        text = buf.value.decode(errors="replace")
        self.version = next((w.split("-")[0] for w in text.split() if w[:1].isdigit()), "?")
        self.path = path

    @property
    def has_bf16(self) -> bool:
        return self._bf16 is not None

    def _call(self, a, b, out, beta: float, bf16: bool = False) -> bool:
        """out = a @ b + beta out by sgemm (or, with ``bf16``, by gemm_bf16bf16f32 on a and b
        rounded to bf16); False, touching nothing, where the product is small or a layout is not
        one cblas reads."""
        if not (a.dtype == b.dtype == out.dtype == np.float32):
            return False
        m, k = a.shape
        n = b.shape[1]
        if m * k * n < MIN_WORK or min(m, k, n) < 2:
            return False
        if _layout(a) is None or _layout(b) is None or out.strides != (4 * n, 4):
            return False
        fn = self._sgemm
        if bf16:
            a, b, fn = bf16_bits(a), bf16_bits(b), self._bf16
        la, lb = _layout(a), _layout(b)
        fn(ROW_MAJOR, la[0], lb[0], m, n, k, 1.0, a.ctypes.data, la[1], b.ctypes.data, lb[1],
           beta, out.ctypes.data, n)
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


class MKLBF16(gemm.BF16):
    """bf16 products by MKL's cblas_gemm_bf16bf16f32: each float32 operand rounded to bf16
    (:func:`bf16_bits`), products accumulated in float32. What MKL does not take (small
    products, odd layouts) the plain twin ``gemm.BF16`` does, so every product of a bf16 run is
    a bf16 product whatever its size. Attention's batched products stay float32 (the twin's
    ``batched_matmul``)."""

    def __init__(self, lib: MKL):
        if not lib.has_bf16:
            raise TbpError(f"MKL {lib.version} has no cblas_gemm_bf16bf16f32 (MKL 2020 or later has)")
        self.lib = lib

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if a.ndim == b.ndim == 2 and a.dtype == np.float32:
            out = np.empty((a.shape[0], b.shape[1]), np.float32)
            if self.lib._call(a, b, out, 0.0, bf16=True):
                return out
        return gemm.BF16.matmul(a, b)

    def matmul_add(self, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        if not (a.ndim == b.ndim == out.ndim == 2 and self.lib._call(a, b, out, 1.0, bf16=True)):
            out += gemm.BF16.matmul(a, b)


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


PRECISIONS = ("fp32", "bf16")


@dataclasses.dataclass(frozen=True)
class Choice:
    """The library chosen for the engine's products, and why."""
    name: str                  # "numpy" or "mkl" (fp32); "numpy-bf16", "mkl-bf16" or "onednn-bf16" (bf16)
    reason: str                # one line for a person
    ratio: float | None = None  # its time / the alternative's on the model's products, when measured
    precision: str = "fp32"
    slower: bool = False       # bf16 measured (or known) slower than fp32 here: the front end says so


def bf16_hardware() -> str | None:
    """The CPU's bf16 matrix units as Linux reports them ('AMX-BF16', 'AVX512-BF16'), or None."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:                                       # not Linux: unknown, said as none
        return None
    found = [name for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]
    return " + ".join(found) or None


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


def measure(lib, shapes, rounds: int = 5, against=None) -> float:
    """``lib``'s time / ``against``'s (default NumPy's) for these products: each round times every
    product both ways, one after the other, so that the machine's drift falls on both; the
    median round's ratio."""
    base = against or gemm.NumPy()
    rng = np.random.default_rng(0)
    pairs = [_operands(s, rng) for s in shapes]
    for a, b in pairs:                                    # warm both: first calls load code
        base.matmul(a, b), lib.matmul(a, b)
    ratios = []
    for _ in range(rounds):
        t_base = t_lib = 0.0
        for a, b in pairs:
            t = time.perf_counter()
            base.matmul(a, b)
            t_base += time.perf_counter() - t
            t = time.perf_counter()
            lib.matmul(a, b)
            t_lib += time.perf_counter() - t
        ratios.append(t_lib / t_base)
    return statistics.median(ratios)


def _mode() -> str:
    mode = os.environ.get("TBP_GEMM", "auto").strip().lower() or "auto"
    if mode not in ("auto", "numpy", "mkl", "onednn"):
        raise TbpError(f"TBP_GEMM must be auto, numpy, mkl or onednn, got {mode!r}")
    return mode


def choose(shapes: tuple, blas_threads: int | None = None, precision: str = "fp32") -> Choice:
    """What this run's products should use. ``blas_threads``: NumPy's BLAS thread count, which
    the caller has set (NumPy is measured at it; a measurement is made once per shapes and count).
    ``precision``: "fp32", or "bf16" (see :func:`choose_bf16`)."""
    if precision == "bf16":
        return choose_bf16(shapes, blas_threads)
    if precision != "fp32":
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    mode = _mode()
    if mode in ("numpy", "onednn"):                   # oneDNN serves bf16 runs only
        return Choice("numpy", f"TBP_GEMM={mode}")
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


def choose_bf16(shapes: tuple, blas_threads: int | None = None) -> Choice:
    """bf16 products: oneDNN's or MKL's where they load, else the NumPy twin -- the same
    arithmetic either way, so a bf16 run is a bf16 run on any machine. Each library that loads
    is measured against the fp32 choice (on these shapes, paired round by round) and the fastest
    is used; whether it beats fp32 is said, never assumed: the run goes on in bf16 as asked."""
    from . import onednn
    hw = bf16_hardware()
    units = f"this CPU's bf16 units: {hw}" if hw else "this CPU reports no bf16 units"
    mode, lib, dnnl = _mode(), mkl(), onednn.onednn()
    dnnl_ok = dnnl is not None and dnnl.has_bf16
    if mode == "onednn":
        if not dnnl_ok:
            why = "oneDNN cannot be loaded: pip install 'tbp[onednn]'" if dnnl is None else \
                f"oneDNN {dnnl.version} has no bf16 product for this CPU ({units})"
            raise TbpError(f"TBP_GEMM=onednn, but {why}")
        return Choice("onednn-bf16", f"oneDNN {dnnl.version} bf16 products, TBP_GEMM=onednn ({units})",
                      precision="bf16")
    mkl_ok = lib is not None and lib.has_bf16
    if mode == "mkl":
        if not mkl_ok:
            why = "MKL not installed: pip install 'tbp[mkl]'" if lib is None else f"MKL {lib.version} has no bf16 product"
            raise TbpError(f"TBP_GEMM=mkl, but {why}")
        return Choice("mkl-bf16", f"MKL {lib.version} bf16 products, TBP_GEMM=mkl ({units})", precision="bf16")
    if mode == "numpy" or not (mkl_ok or dnnl_ok):
        dnnl_why = "oneDNN is not installed: pip install 'tbp[onednn]'" if dnnl is None else \
            f"oneDNN {dnnl.version} has no bf16 product for this CPU"
        why = "TBP_GEMM=numpy" if mode == "numpy" else \
            "neither oneDNN nor MKL installed: pip install 'tbp[onednn]'" if lib is None and dnnl is None else \
            f"{'MKL is not installed' if lib is None else f'MKL {lib.version} has no bf16 product'} and {dnnl_why}"
        return Choice("numpy-bf16", f"bf16 rounding emulated in NumPy ({why}): bf16's arithmetic, slower than "
                                    f"fp32", precision="bf16", slower=True)
    fp32 = choose(shapes, blas_threads, "fp32")
    found = {}
    if dnnl_ok:
        found["onednn-bf16"] = (f"oneDNN {dnnl.version}", _measured_bf16(tuple(shapes), blas_threads, fp32.name, "onednn"))
    if mkl_ok:
        found["mkl-bf16"] = (f"MKL {lib.version}", _measured_bf16(tuple(shapes), blas_threads, fp32.name, "mkl"))
    name = min(found, key=lambda k: found[k][1])
    who, ratio = found[name]
    slower = ratio > 1.0
    verdict = f"{ratio:.2f}x the time of fp32's ({fp32.name})" + ("; fp32 is faster here" if slower else "")
    others = "".join(f"; {w} measured at {r:.2f}x" for k, (w, r) in found.items() if k != name)
    return Choice(name, f"{who} bf16 products, measured at {verdict}{others} ({units})", ratio,
                  precision="bf16", slower=slower)


@functools.cache
def _measured(shapes: tuple, blas_threads: int | None) -> float:
    return measure(mkl(), shapes)


@functools.cache
def _measured_bf16(shapes: tuple, blas_threads: int | None, fp32: str, which: str = "mkl") -> float:
    return measure(library(Choice(f"{which}-bf16", "")), shapes, against=mkl() if fp32 == "mkl" else None)


@functools.cache
def _onednn_bf16():
    from . import onednn
    return onednn.OneDNNBF16(onednn.require())


def library(choice: Choice):
    """The object the engine's seam runs ``choice``'s products with (None: NumPy's own). One
    oneDNN product object serves every run of the process (its compiled products are kept)."""
    return {"numpy": lambda: None, "mkl": mkl, "numpy-bf16": gemm.BF16,
            "mkl-bf16": lambda: MKLBF16(mkl()), "onednn-bf16": _onednn_bf16}[choice.name]()


@contextlib.contextmanager
def engaged(choice: Choice):
    """Install ``choice`` in the engine's seam for the block."""
    with gemm.using(library(choice)):
        yield
