"""Bytes per weight for decoding, measured: what one token's products cost at GPT-2 124M's shapes
when the weights are float32, bf16 or int8, through the libraries tbp can reach from NumPy.

Decoding one token at batch 1 reads every weight once: 12 blocks of (768 x 2304, 768 x 768,
768 x 3072, 3072 x 768) and the tied head (50,257 x 768), 124 M weights, 498 MB in float32.
Each product is a row vector times a matrix, so the time is the time to stream the matrix
from memory: fewer bytes per weight would be faster, if a library reads them at the same
rate. The arms, interleaved round by round in one process (medians of ``--rounds``):

- numpy: ``np.dot`` with NumPy's own BLAS (OpenBLAS in the wheel), float32;
- mkl sgemm: MKL's cblas_sgemm through ctypes (tbp.machine.libraries), float32;
- mkl bf16: cblas_gemm_bf16bf16f32, the weights stored once as bf16 (half the bytes), the
  activation rounded to bf16 per product;
- mkl bf16 packed: the same with the weights packed once by cblas_gemm_bf16bf16f32_pack;
- mkl int8: cblas_gemm_s8u8s32, int8 weights (a quarter of the bytes) and a uint8 activation;
- onednn bf16, on one OpenMP thread and on two: oneDNN's matmul (tbp.machine.onednn, the library tbp's
  bf16 training uses), the weights stored once as bf16.

Beside them, the machine's read bandwidth: NumPy summing 1 GiB, on one thread and on two (two
halves at once), the roofline a streaming product cannot beat. Only the time is measured
here (the numbers multiplied are random); records in benchmarks/results/decode_weights.jsonl.

    python benchmarks/speed/decode_weights.py --rounds 7
"""
import argparse
import ctypes
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records  # noqa: E402

from tbp.machine import libraries  # noqa: E402

C, V, LAYERS = 768, 50257, 12
SHAPES = [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)] * LAYERS + [(C, V)]      # (k, n) per product
ROW_MAJOR, NO_TRANS, PACKED, B_MATRIX, FIX_OFFSET = 101, 111, 151, 162, 171


def bandwidth(gib: float = 1.0) -> dict:
    """GB/s NumPy reads summing ``gib`` GiB of float32, on one thread and on two (two halves)."""
    big = np.ones(int(gib * 2 ** 28), np.float32)
    halves = np.split(big, 2)
    out = {}
    with ThreadPoolExecutor(2) as pool:
        for threads in (1, 2):
            times = []
            for _ in range(5):
                t = time.perf_counter()
                if threads == 1:
                    big.sum()
                else:
                    list(pool.map(np.sum, halves))
                times.append(time.perf_counter() - t)
            out[threads] = big.nbytes / float(np.median(times)) / 1e9
    return out


class Arms:
    """One token's products per arm, the weights prepared once in each arm's storage."""

    def __init__(self, seed: int = 0):
        lib = libraries.mkl()
        if lib is None:
            sys.exit("needs MKL: pip install 'tbp[mkl]'")
        self.version = lib.version
        mkl = ctypes.CDLL(lib.path)
        rng = np.random.default_rng(seed)
        p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        self.sgemm = mkl.cblas_sgemm
        self.sgemm.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
        self.bf16 = mkl.cblas_gemm_bf16bf16f32
        self.bf16.argtypes = self.sgemm.argtypes
        self.compute = mkl.cblas_gemm_bf16bf16f32_compute
        self.compute.argtypes = self.sgemm.argtypes
        size, pack = mkl.cblas_gemm_bf16bf16f32_pack_get_size, mkl.cblas_gemm_bf16bf16f32_pack
        size.argtypes, size.restype = [i, i, i, i], ctypes.c_size_t
        pack.argtypes = [i, i, i, i, i, i, p, i, p]
        self.int8 = mkl.cblas_gemm_s8u8s32
        self.int8.argtypes = [i, i, i, i, i, i, i, f, p, i, ctypes.c_int8, p, i, ctypes.c_int8, f, p, i, p]
        for fn in (self.sgemm, self.bf16, self.compute, self.int8, pack):
            fn.restype = None
        self.w32 = [rng.standard_normal(s, dtype=np.float32) * 0.02 for s in SHAPES]
        self.w16 = [libraries.bf16_bits(w) for w in self.w32]
        self.packed = []
        for (k, n), w in zip(SHAPES, self.w16):
            dest = np.empty(size(B_MATRIX, 1, n, k) // 2 + 32, np.uint16)
            pack(ROW_MAJOR, B_MATRIX, NO_TRANS, 1, n, k, w.ctypes.data, n, dest.ctypes.data)
            self.packed.append(dest)
        self.w8 = [rng.integers(0, 256, s, dtype=np.uint8) for s in SHAPES]
        self.x32 = {k: rng.standard_normal((1, k), dtype=np.float32) for k in (C, 4 * C)}
        self.x16 = {k: libraries.bf16_bits(x) for k, x in self.x32.items()}
        self.x8 = {k: rng.integers(-127, 128, (1, k), dtype=np.int8) for k in (C, 4 * C)}
        self.offset = np.zeros(1, np.int32)
        self.bytes = {"numpy": 4, "mkl sgemm": 4, "mkl bf16": 2, "mkl bf16 packed": 2, "mkl int8": 1,
                      "onednn bf16, 1 thread": 2, "onednn bf16, 2 threads": 2}
        from tbp.machine import onednn
        self.dnnl = onednn.onednn()
        if self.dnnl is not None:
            self.dnnl_products = {(k, n): onednn.product(self.dnnl, 1, k, n, False) for k, n in set(SHAPES)}

    def numpy(self):
        for (k, _), w in zip(SHAPES, self.w32):
            np.dot(self.x32[k], w)

    def mkl_sgemm(self):
        for (k, n), w in zip(SHAPES, self.w32):
            out = np.empty((1, n), np.float32)
            self.sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, 1, n, k, 1.0, self.x32[k].ctypes.data, k, w.ctypes.data, n,
                       0.0, out.ctypes.data, n)

    def mkl_bf16(self):
        for (k, n), w in zip(SHAPES, self.w16):
            out = np.empty((1, n), np.float32)
            self.bf16(ROW_MAJOR, NO_TRANS, NO_TRANS, 1, n, k, 1.0, self.x16[k].ctypes.data, k, w.ctypes.data, n,
                      0.0, out.ctypes.data, n)

    def mkl_bf16_packed(self):
        for (k, n), w in zip(SHAPES, self.packed):
            out = np.empty((1, n), np.float32)
            self.compute(ROW_MAJOR, NO_TRANS, PACKED, 1, n, k, 1.0, self.x16[k].ctypes.data, k, w.ctypes.data, n,
                         0.0, out.ctypes.data, n)

    def mkl_int8(self):
        for (k, n), w in zip(SHAPES, self.w8):
            out = np.empty((1, n), np.int32)
            self.int8(ROW_MAJOR, NO_TRANS, NO_TRANS, FIX_OFFSET, 1, n, k, 1.0, self.x8[k].ctypes.data, k, 0,
                      w.ctypes.data, n, -128, 0.0, out.ctypes.data, n, self.offset.ctypes.data)

    def onednn_bf16(self, threads: int):
        def run():
            self.dnnl.stream()                                  # this thread's stream (which sets 1 thread)
            self.dnnl._omp_threads(threads)
            for (k, n), w in zip(SHAPES, self.w16):
                self.dnnl_products[(k, n)](self.x16[k], w, np.empty((1, n), np.float32))
            self.dnnl._omp_threads(1)
        return run

    def each(self):
        arms = {"numpy": self.numpy, "mkl sgemm": self.mkl_sgemm, "mkl bf16": self.mkl_bf16,
                "mkl bf16 packed": self.mkl_bf16_packed, "mkl int8": self.mkl_int8}
        if self.dnnl is not None and self.dnnl._omp_threads is not None:
            arms.update({"onednn bf16, 1 thread": self.onednn_bf16(1), "onednn bf16, 2 threads": self.onednn_bf16(2)})
        return arms


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    arms = Arms()
    weights = sum(k * n for k, n in SHAPES)
    times: dict[str, list[float]] = {name: [] for name in arms.each()}
    for fn in arms.each().values():
        fn()                                                     # warm: pages touched, code loaded
    for r in range(a.rounds):
        order = list(arms.each().items())
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    roof = bandwidth()
    rec = {"weights": weights, "rounds": a.rounds, "mkl": arms.version, "numpy_blas": libraries.numpy_blas(),
           "onednn": arms.dnnl.version if arms.dnnl is not None else None,
           "bf16_units": libraries.bf16_hardware(), "read_gb_s": {str(k): round(v, 2) for k, v in roof.items()},
           "arms": {}, "commit": records.commit()}
    for name, ts in times.items():
        ms = float(np.median(ts)) * 1e3
        gb_s = weights * arms.bytes[name] / (ms / 1e3) / 1e9
        rec["arms"][name] = {"bytes_per_weight": arms.bytes[name], "ms_per_token": round(ms, 2),
                             "gb_s": round(gb_s, 2)}
        print(f"{name:16s} {arms.bytes[name]} B/weight  {ms:8.1f} ms per token  {gb_s:5.1f} GB/s")
    print(f"read bandwidth: {roof[1]:.1f} GB/s on one thread, {roof[2]:.1f} on two")
    if not a.no_record:
        records.append("decode_weights", rec)


if __name__ == "__main__":
    main()
