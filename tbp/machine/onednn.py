"""bf16 products by oneDNN, the library PyTorch's CPU autocast runs on, reached through ctypes.

MKL's bf16 product is built for Intel's matrix units; on an AMD CPU with AVX512-BF16 it runs
slower than float32 (docs/how-to/precision.md). oneDNN's matrix product chooses its kernel by
the instructions the CPU reports, whoever made it, and its Python wheel (``onednn-cpu-gomp``,
the ``onednn`` extra) ships the library alone, so tbp can call it as it calls MKL: this module
describes each product to oneDNN once (the shapes and strides of its operands, so a transposed
view is read as it is, with no copy), keeps the compiled primitive, and runs it on NumPy's
buffers. The engine still imports only NumPy; this sits beside ``tbp.machine.libraries``.

The arithmetic is the engine's bf16 contract (``gemm.BF16``): each float32 operand rounded to
the nearest bfloat16 (ties to even), products summed in float32. oneDNN converts the operands
(a reorder, bit for bit the engine's rounding, several times faster than NumPy can) into
buffers kept per thread and shape, then multiplies them as bf16 with a float32 result;
``matmul_add`` accumulates with oneDNN's ``sum`` post-operation (beta = 1: no temporary).
Each call runs on one OpenMP thread: tbp's workers split the batch, one single-threaded
product each, as they do with MKL.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import sys
import threading

import numpy as np

from ..errors import TbpError
from ..nn import gemm

CPU_ENGINE, IN_ORDER = 1, 1                    # dnnl_cpu, dnnl_stream_in_order
BF16, F32 = 2, 3                               # dnnl_data_type_t
ARG_SRC, ARG_DST, ARG_WEIGHTS = 1, 17, 33      # DNNL_ARG_*
MAX_DIMS = 12
MIN_WORK = 1 << 20                             # m k n below this: the twin (a primitive's fixed cost)
Dims = ctypes.c_int64 * MAX_DIMS
Ptr = ctypes.c_void_p


class ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", Ptr)]


class Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int), ("hash", ctypes.c_char_p)]


def _candidates() -> list[str]:
    """Where the onednn-cpu-gomp wheel (or a system oneDNN) keeps libdnnl."""
    names = []
    for d in (os.path.join(sys.prefix, "lib"), os.path.join(sys.base_prefix, "lib")):
        names += sorted(glob.glob(os.path.join(d, "libdnnl.so*")), reverse=True)
    found = ctypes.util.find_library("dnnl")
    return names + ([found] if found else [])


class OneDNN:
    """libdnnl loaded once: a CPU engine, and a stream per calling thread."""

    def __init__(self, path: str):
        # OpenMP reads its thread count when its runtime loads (with libdnnl, here): one thread, so
        # that no team of idle threads spins beside NumPy's BLAS; the variable is not left set for
        # child processes (their BLAS would read it)
        unset = "OMP_NUM_THREADS" not in os.environ
        if unset:
            os.environ["OMP_NUM_THREADS"] = "1"
        try:
            lib = ctypes.CDLL(path)
        finally:
            if unset:
                del os.environ["OMP_NUM_THREADS"]
        self.lib, self.path = lib, path
        lib.dnnl_version.restype = ctypes.POINTER(Version)           # every other call returns a status
        v = lib.dnnl_version().contents
        self.version = f"{v.major}.{v.minor}.{v.patch}"
        self.engine = Ptr()
        self._ok(lib.dnnl_engine_create(ctypes.byref(self.engine), CPU_ENGINE, ctypes.c_size_t(0)), "engine")
        self._local = threading.local()
        try:                                     # one OpenMP thread per call (see the module's docstring)
            self._omp_threads = ctypes.CDLL("libgomp.so.1").omp_set_num_threads
        except (OSError, AttributeError):
            self._omp_threads = None

    @functools.cached_property
    def has_bf16(self) -> bool:
        """Whether this oneDNN has a bf16 matrix product for this CPU. Builds before oneDNN 3.3
        have none on a CPU without AVX-512 (an AVX2-only EPYC answers "unimplemented" when the
        product is described), as an MKL may lack its bf16 product: asked once, by describing one."""
        try:
            product(self, 32, 32, 32, False)
        except RuntimeError:
            return False
        return True

    @staticmethod
    def _ok(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"oneDNN: {what} failed (status {status})")

    def stream(self) -> Ptr:
        s = getattr(self._local, "stream", None)
        if s is None:
            s = Ptr()
            self._ok(self.lib.dnnl_stream_create(ctypes.byref(s), self.engine, ctypes.c_uint(IN_ORDER)), "stream")
            self._local.stream = s
            if self._omp_threads is not None:
                self._omp_threads(1)
        return s

    def desc(self, shape, strides, itemsize: int, dtype: int) -> Ptr:
        d = Ptr()
        self._ok(self.lib.dnnl_memory_desc_create_with_strides(
            ctypes.byref(d), len(shape), Dims(*shape), dtype, Dims(*[s // itemsize for s in strides])), "memory desc")
        return d


class Primitive:
    """A compiled oneDNN primitive and the memory objects that point it at each call's buffers.
    One thread runs it (a primitive keeps its own scratch memory: OneDNNBF16 compiles one per
    thread)."""

    def __init__(self, dnnl: OneDNN, pd: Ptr, args: list[tuple[int, Ptr]]):
        lib, ok = dnnl.lib, dnnl._ok
        self.dnnl, self.primitive, self.mems = dnnl, Ptr(), []
        ok(lib.dnnl_primitive_create(ctypes.byref(self.primitive), pd), "primitive")
        for _, d in args:
            m = Ptr()
            ok(lib.dnnl_memory_create(ctypes.byref(m), d, dnnl.engine, None), "memory")
            self.mems.append(m)
        self.exec = (ExecArg * len(args))(*[ExecArg(arg, m) for (arg, _), m in zip(args, self.mems)])

    def __call__(self, *arrays: np.ndarray) -> None:
        lib, ok = self.dnnl.lib, self.dnnl._ok
        for m, x in zip(self.mems, arrays):
            ok(lib.dnnl_memory_set_data_handle(m, Ptr(x.ctypes.data)), "data handle")
        stream = self.dnnl.stream()
        ok(lib.dnnl_primitive_execute(self.primitive, stream, len(self.mems), self.exec), "execute")
        ok(lib.dnnl_stream_wait(stream), "stream wait")


def _c_strides(shape, itemsize: int) -> tuple:
    return (shape[1] * itemsize, itemsize)


def to_bf16(dnnl: OneDNN, shape, strides) -> Primitive:
    """float32 (``shape``, any ``strides``: a transposed view too) to a C-ordered bf16 copy, by a
    reorder: round to nearest, ties to even, the engine's rounding (a test holds it to
    ``gemm.round_bf16`` bit for bit)."""
    src = dnnl.desc(shape, strides, 4, F32)
    dst = dnnl.desc(shape, _c_strides(shape, 2), 2, BF16)
    pd = Ptr()
    dnnl._ok(dnnl.lib.dnnl_reorder_primitive_desc_create(ctypes.byref(pd), src, dnnl.engine, dst, dnnl.engine, None),
             "reorder descriptor")
    return Primitive(dnnl, pd, [(ARG_SRC, src), (ARG_DST, dst)])


def product(dnnl: OneDNN, m: int, k: int, n: int, accumulate: bool) -> Primitive:
    """out (m, n, float32, C order) = a (m, k) b (k, n), both bf16 in C order; ``accumulate``:
    out += a b, by oneDNN's sum post-operation (beta = 1)."""
    lib, ok = dnnl.lib, dnnl._ok
    a, b = dnnl.desc((m, k), _c_strides((m, k), 2), 2, BF16), dnnl.desc((k, n), _c_strides((k, n), 2), 2, BF16)
    out = dnnl.desc((m, n), _c_strides((m, n), 4), 4, F32)
    attr = Ptr()
    ok(lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attributes")
    if accumulate:
        post = Ptr()
        ok(lib.dnnl_post_ops_create(ctypes.byref(post)), "post-ops")
        ok(lib.dnnl_post_ops_append_sum(post, ctypes.c_float(1.0), ctypes.c_int32(0), ctypes.c_int(0)), "sum")
        ok(lib.dnnl_primitive_attr_set_post_ops(attr, post), "post-ops")
    pd = Ptr()
    ok(lib.dnnl_matmul_primitive_desc_create(ctypes.byref(pd), dnnl.engine, a, b, None, out, attr), "matmul descriptor")
    return Primitive(dnnl, pd, [(ARG_SRC, a), (ARG_WEIGHTS, b), (ARG_DST, out)])


class OneDNNBF16(gemm.BF16):
    """The engine's bf16 products by oneDNN (see the module's docstring): each operand converted
    to bf16 by a reorder into a buffer this thread keeps for that shape, then the product. What
    oneDNN is not given (small products, odd layouts, other dtypes) the plain twin ``gemm.BF16``
    does, so every product of a bf16 run is a bf16 product whatever its size."""

    def __init__(self, dnnl: OneDNN):
        self.dnnl = dnnl
        self._compiled: dict[tuple, Primitive] = {}     # by thread and what it computes
        self._local = threading.local()

    def _compile(self, key: tuple, make) -> Primitive:
        """The primitive for ``key`` compiled for this thread: a primitive keeps its own scratch
        memory, so two threads running one primitive at once would share it."""
        key = (threading.get_ident(), *key)
        found = self._compiled.get(key)
        if found is None:
            found = self._compiled[key] = make()
        return found

    def _bf16(self, x: np.ndarray, which: str) -> np.ndarray:
        """x as C-ordered bf16 bits, in this thread's buffer for (which, shape)."""
        convert = self._compile(("to_bf16", x.shape, x.strides), lambda: to_bf16(self.dnnl, x.shape, x.strides))
        buffers = self._local.__dict__.setdefault("buffers", {})
        out = buffers.get((which, x.shape))
        if out is None:
            out = buffers[(which, x.shape)] = np.empty(x.shape, np.uint16)
        convert(x, out)
        return out

    def _run(self, a: np.ndarray, b: np.ndarray, out: np.ndarray, accumulate: bool) -> bool:
        if not (a.ndim == b.ndim == out.ndim == 2 and a.dtype == b.dtype == out.dtype == np.float32):
            return False
        (m, k), n = a.shape, b.shape[1]
        if m * k * n < MIN_WORK or min(m, k, n) < 2 or not out.flags.c_contiguous:
            return False
        if any(s <= 0 or s % 4 for s in a.strides + b.strides):
            return False
        self.dnnl.stream()               # first: it holds this thread to one OpenMP thread, which a
        #                                  primitive reads when compiled (two would oversubscribe the cores)
        prod = self._compile(("matmul", m, k, n, accumulate), lambda: product(self.dnnl, m, k, n, accumulate))
        prod(self._bf16(a, "a"), self._bf16(b, "b"), out)
        return True

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if a.ndim == b.ndim == 2 and a.dtype == np.float32:
            out = np.empty((a.shape[0], b.shape[1]), np.float32)
            if self._run(a, b, out, False):
                return out
        return gemm.BF16.matmul(a, b)

    def matmul_add(self, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        if not self._run(a, b, out, True):
            out += gemm.BF16.matmul(a, b)


@functools.cache
def onednn() -> OneDNN | None:
    """oneDNN found beside this Python (the onednn-cpu-gomp wheel), loaded once; None if none."""
    for path in _candidates():
        try:
            return OneDNN(path)
        except (OSError, AttributeError, RuntimeError):
            continue
    return None


def require() -> OneDNN:
    lib = onednn()
    if lib is None:
        raise TbpError("oneDNN cannot be loaded: pip install 'tbp[onednn]' (x86-64 Linux)")
    return lib
