"""int8 weights for decoding, measured: oneDNN's matrix product with int8 weights decompressed in
its kernel (float32 activations and result, one float32 scale per output column) against NumPy's
float32 product, one token's products at GPT-2 124M's shapes, batch 1.

An int8 weight is a quarter of a float32's bytes, so a product that streams its weights at the
same rate would be up to four times faster. oneDNN (3.5 and later) decompresses integer weights
inside its matmul kernels on AVX2 and AVX-512 CPUs, given the "fpmath mode" attribute with
``apply_to_int``; the build tbp's ``onednn`` extra pins (3.2) has no such kernel, so the library
is named by ``--onednn-lib`` (the ``onednn`` wheel of the package index, 2026.1 = oneDNN 3.13, is a
SYCL build: its CPU engine needs the OpenCL CPU runtime it depends on, found through
``OCL_ICD_FILENAMES``). The weights are quantised per output column (symmetric, scale = max |w| /
127) and given to oneDNN in the layout it asks for; the product is checked against the
dequantised weights in float64 before it is timed. Arms interleaved, medians of ``--rounds``.

    OCL_ICD_FILENAMES=$VENV/lib/libintelocl.so LD_LIBRARY_PATH=$VENV/lib \\
        python benchmarks/speed/decode_int8.py --onednn-lib $VENV/lib/libdnnl.so.3
"""
import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records

from tbp.machine.cores import available_cores, blas_threads
from tbp.machine.onednn import ARG_DST, ARG_SRC, ARG_WEIGHTS, F32, Dims, OneDNN, Primitive, Ptr

S8, FORMAT_ANY, QUERY_WEIGHTS_MD = 5, 1, 131              # dnnl_s8, dnnl_format_tag_any, dnnl_query_weights_md
ARG_WEIGHT_SCALES = 4096 | ARG_WEIGHTS                     # DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS
FPMATH_STRICT = 0
C, V, LAYERS = 768, 50257, 12
SHAPES = [(C + 1, 3 * C), (C, C), (C + 1, 4 * C), (4 * C, C)] * LAYERS + [(C + 1, V)]    # (k, n), decoding's


def c_order(dnnl: OneDNN, shape: tuple, dtype: int, itemsize: int) -> Ptr:
    strides = tuple(int(np.prod(shape[i + 1:])) * itemsize for i in range(len(shape)))
    return dnnl.desc(shape, strides, itemsize, dtype)


def quantise(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 weights, float32 scale per column): w ~ q * scale, |q| <= 127."""
    scale = (np.abs(w).max(axis=0) / 127).astype(np.float32)
    scale[scale == 0] = 1
    return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale


class Int8Product:
    """out (1, n) = x (1, k) @ (q * scale), q int8 in oneDNN's chosen layout, decompressed in the kernel."""

    def __init__(self, dnnl: OneDNN, w: np.ndarray):
        lib, ok = dnnl.lib, dnnl._ok
        k, n = w.shape
        self.q, self.scale = quantise(w)
        x, out = c_order(dnnl, (1, k), F32, 4), c_order(dnnl, (1, n), F32, 4)
        chosen = Ptr()
        ok(lib.dnnl_memory_desc_create_with_tag(ctypes.byref(chosen), 2, Dims(k, n), S8, FORMAT_ANY), "weights desc")
        attr = Ptr()
        ok(lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attributes")
        ok(lib.dnnl_primitive_attr_set_scales_mask(attr, ARG_WEIGHTS, 1 << 1), "scales per column")
        ok(lib.dnnl_primitive_attr_set_fpmath_mode_v2(attr, FPMATH_STRICT, 1), "fpmath mode (integer weights)")
        pd = Ptr()
        ok(lib.dnnl_matmul_primitive_desc_create(ctypes.byref(pd), dnnl.engine, x, chosen, None, out, attr), "matmul")
        layout = Ptr(lib.dnnl_primitive_desc_query_md(pd, QUERY_WEIGHTS_MD, 0))
        self.w = np.empty(lib.dnnl_memory_desc_get_size(layout), np.int8)
        plain = c_order(dnnl, (k, n), S8, 1)
        reorder = Ptr()
        ok(lib.dnnl_reorder_primitive_desc_create(ctypes.byref(reorder), plain, dnnl.engine, layout, dnnl.engine,
                                                  None), "reorder")
        Primitive(dnnl, reorder, [(ARG_SRC, plain), (ARG_DST, layout)])(self.q, self.w)
        self.product = Primitive(dnnl, pd, [(ARG_SRC, x), (ARG_WEIGHTS, layout), (ARG_DST, out),
                                            (ARG_WEIGHT_SCALES, c_order(dnnl, (n,), F32, 4))])

    def __call__(self, x: np.ndarray, out: np.ndarray) -> None:
        self.product(x, self.w, out, self.scale)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--onednn-lib", required=True, help="a libdnnl of oneDNN 3.5 or later")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=available_cores(), help="NumPy's BLAS threads")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    dnnl = OneDNN(args.onednn_lib)
    lib = dnnl.lib
    lib.dnnl_primitive_desc_query_md.restype = Ptr
    lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
    rng = np.random.default_rng(0)
    w32 = [rng.standard_normal(s, dtype=np.float32) * np.float32(0.02) for s in SHAPES]
    xs = {k: rng.standard_normal((1, k), dtype=np.float32) for k in {k for k, _ in SHAPES}}
    outs = [np.empty((1, n), np.float32) for _, n in SHAPES]
    t = time.perf_counter()
    w8 = [Int8Product(dnnl, w) for w in w32]
    prepare_s = time.perf_counter() - t
    worst = 0.0                               # the kernel against the dequantised weights, in float64
    for (k, _), p, out in zip(SHAPES[:5], w8, outs):
        p(xs[k], out)
        exact = xs[k].astype(np.float64) @ (p.q.astype(np.float64) * p.scale)
        worst = max(worst, float(np.abs(out - exact).max() / np.abs(exact).max()))
    if worst > 1e-5:
        sys.exit(f"oneDNN's int8 product is off by {worst:.1e} of its largest output: not timed")
    arms = {"numpy fp32": lambda: [np.dot(xs[k], w, out=o) for (k, _), w, o in zip(SHAPES, w32, outs)],
            "onednn int8": lambda: [p(xs[k], o) for (k, _), p, o in zip(SHAPES, w8, outs)]}
    nbytes = {"numpy fp32": sum(w.nbytes for w in w32), "onednn int8": sum(p.w.nbytes for p in w8)}
    seconds = {arm: [] for arm in arms}
    with blas_threads(args.threads):
        for f in arms.values():
            f()                                               # warm: pages touched, kernels made
        for r in range(args.rounds):
            for arm, f in (list(arms.items()) if r % 2 == 0 else list(arms.items())[::-1]):
                t = time.perf_counter()
                f()
                seconds[arm].append(time.perf_counter() - t)
    rec = {"onednn": dnnl.version, "threads": args.threads, "rounds": args.rounds, "weights": sum(k * n for k, n in SHAPES),
           "prepare_s": round(prepare_s, 2), "int8_vs_dequantised": worst, "arms": {}, "commit": records.commit()}
    for arm, s in seconds.items():
        m = statistics.median(s)
        rec["arms"][arm] = {"ms_per_token": round(m * 1e3, 2), "gb_s": round(nbytes[arm] / m / 1e9, 2),
                            "mb": round(nbytes[arm] / 1e6)}
        print(f"{arm:12s} {m * 1e3:7.2f} ms per token  {nbytes[arm] / m / 1e9:5.1f} GB/s of its {nbytes[arm] / 1e6:.0f} MB")
    if not args.no_record:
        records.append("decode_int8", rec)


if __name__ == "__main__":
    main()
