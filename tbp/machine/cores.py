"""This machine's cores: how many this process may use, NumPy's OpenBLAS and its thread count,
and the description every measured figure carries (``machine``)."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import os
import platform

import numpy as np

from .libraries import bf16_hardware
from ..version import __version__


def available_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                     # not Linux
        return os.cpu_count() or 1


@functools.cache
def openblas():
    """(get, set) thread-count functions of NumPy's bundled OpenBLAS, or None if not found."""
    libdir = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libdir, "*openblas*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas", "64_"), ("scipy_openblas", ""), ("openblas", "64_"),
                               ("openblas", "")):
            get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
            set_ = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
            if get is not None and set_ is not None:
                return get, set_
    return None


@contextlib.contextmanager
def blas_threads(n: int):
    """Run the block with NumPy's BLAS limited to ``n`` threads (a no-op if it cannot be told)."""
    fns = openblas()
    if fns is None:
        yield
        return
    get, set_ = fns
    before = get()
    set_(ctypes.c_int(n))
    try:
        yield
    finally:
        set_(ctypes.c_int(before))


SIMD_LADDER = ("AVX512_SPR", "AVX512_ICL", "AVX512_CNL", "AVX512_CLX", "AVX512_SKX", "AVX512F", "AVX2", "AVX",
               "SSE42", "SVE", "ASIMD", "NEON", "VSX4", "VSX3", "VSX2", "VX")


def machine() -> dict:
    """What a figure was measured on: the CPU's model and cores, the highest SIMD level NumPy
    detected and dispatches to, the BLAS NumPy was built with and its thread count now."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:                                     # NumPy 1.x
        from numpy.core._multiarray_umath import __cpu_features__ as features
    simd = next((name for name in SIMD_LADDER if features.get(name)), "none detected")
    try:
        blas_info = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = f"{blas_info.get('name', '?')} {blas_info.get('version', '')}".strip()
    except Exception:                                       # the config format is NumPy's, not ours
        blas = "unknown"
    fns = openblas()
    return {"cpu": cpu, "cores": available_cores(), "simd": simd, "blas": blas, "bf16_units": bf16_hardware(),
            "blas_threads": int(fns[0]()) if fns else None, "python": platform.python_version(),
            "numpy": np.__version__, "tbp": __version__}
