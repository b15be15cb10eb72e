"""NumPy's BLAS against MKL for the engine's products, in one process: per product and per step.

First each linear-layer product of the model (one data-parallel worker's rows, one thread) is
timed with np.dot and with MKL's sgemm, alternated, medians of --rounds. Then whole training
steps run as `tbp train` runs them (data-parallel over the cores), the product library
switched step by step (A = NumPy, B = MKL, in ABBA order so that drift falls on both), and
the medians and the median of the per-pair ratios are printed. The machine's speed drifts by
tens of percent over tens of seconds; only such paired figures compare the two. Products and
steps are records in results/gemm_step.jsonl (``"what": "product"`` or ``"step"``).

    python benchmarks/speed/gemm_step.py --model wide --steps 12
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records
from tbp.machine import libraries
from tbp.check.bench import matmul_peak_gflops, train_flops_per_token, train_step
from tbp.machine.cores import machine
from tbp.nn.gpt import GPT
from tbp.nn.config import ModelConfig
from tbp.nn import gemm
from tbp.train.optim import AdamW
from tbp.train.parallel import data_parallel
from tbp.machine.cores import blas_threads

MODELS = {"small": (dict(n_layer=4, n_head=4, d_model=128, n_ctx=64), 12),
          "wide": (dict(n_layer=6, n_head=6, d_model=384, n_ctx=256), 8)}


def per_product(lib, shapes, rounds: int, about: dict) -> None:
    rng = np.random.default_rng(0)
    print(f"{'product m x k x n':26s} {'numpy GFLOP/s':>14s} {'MKL GFLOP/s':>12s} {'MKL time / numpy':>17s}")
    with blas_threads(1):
        for shape in shapes:
            m, k, n, ta, tb = shape
            a, b = libraries._operands(shape, rng)
            reps = max(1, int(4e8 / (2 * m * k * n)))
            t = {"numpy": [], "mkl": []}
            for _ in range(rounds):
                for name, fn in (("numpy", np.dot), ("mkl", lib.matmul)):
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fn(a, b)
                    t[name].append((time.perf_counter() - t0) / reps)
            med = {k: statistics.median(v) for k, v in t.items()}
            label = f"{m} x {k} x {n}" + (" (a^T)" if ta else "") + (" (b^T)" if tb else "")
            print(f"{label:26s} {2 * m * k * n / med['numpy'] / 1e9:14.0f} {2 * m * k * n / med['mkl'] / 1e9:12.0f} "
                  f"{med['mkl'] / med['numpy']:17.2f}")
            records.append("gemm_step", {**about, "what": "product", "shape": list(shape), "rounds": rounds,
                                         "numpy_s": med["numpy"], "mkl_s": med["mkl"]})


def steps(lib, cfg: ModelConfig, batch: int, n: int, about: dict) -> None:
    model = GPT(cfg, seed=0)
    opt = AdamW(model.layout)
    rng = np.random.default_rng(0)
    workers = opt.workers = data_parallel(model, 0, batch)
    times = {"A": [], "B": []}
    with workers:
        for i in range(2 * n + 4):
            which = "ABBA"[i % 4]
            x, y = (rng.integers(0, cfg.vocab_size, (batch, cfg.n_ctx)) for _ in range(2))
            with gemm.using(None if which == "A" else lib):
                t = time.perf_counter()
                train_step(model, opt, workers, x, y)
                dt = time.perf_counter() - t
            if i >= 4:                                   # warm-up
                times[which].append(dt)
    a, b = statistics.median(times["A"]), statistics.median(times["B"])
    pairs = statistics.median(tb / ta for ta, tb in zip(times["A"], times["B"]))
    tokens = batch * cfg.n_ctx
    peak = matmul_peak_gflops()
    flops = train_flops_per_token(cfg) * tokens
    print(f"\nsteps ({workers.workers} threads, {n} of each): NumPy {a * 1e3:.1f} ms, MKL {b * 1e3:.1f} ms; "
          f"MKL / NumPy {b / a:.3f} (median of pair ratios {pairs:.3f})")
    print(f"achieved {flops / a / 1e9:.0f} / {flops / b / 1e9:.0f} GFLOP/s = {100 * flops / a / 1e9 / peak:.0f} % / "
          f"{100 * flops / b / 1e9 / peak:.0f} % of the measured matmul peak ({peak:.0f} GFLOP/s, NumPy, "
          f"1024^3, all cores)")
    records.append("gemm_step", {**about, "what": "step", "config": cfg.flat(), "batch": batch,
                                 "threads": workers.workers, "steps": n, "numpy_s": a, "mkl_s": b,
                                 "pair_ratio": pairs, "numpy_all": times["A"], "mkl_all": times["B"],
                                 "peak_gflops": peak, "flops_per_step": flops})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=MODELS, default="small")
    p.add_argument("--steps", type=int, default=20, help="timed steps with each library")
    p.add_argument("--rounds", type=int, default=7, help="rounds of each product")
    a = p.parse_args()
    lib = libraries.mkl()
    if lib is None:
        raise SystemExit("MKL cannot be loaded: pip install -e '.[mkl]'")
    m = machine()
    print(f"{m['cpu']} · {m['cores']} cores · SIMD {m['simd']} · NumPy BLAS {m['blas']} · MKL {lib.version}")
    shape, batch = MODELS[a.model]
    cfg = ModelConfig(vocab_size=65, **shape)
    rows = -(-batch // min(m["cores"], batch)) * cfg.n_ctx
    about = {"commit": records.commit(), "machine": m, "mkl": lib.version, "model": a.model}
    per_product(lib, libraries.products(cfg.d_model, rows), a.rounds, about)
    steps(lib, cfg, batch, a.steps, about)


if __name__ == "__main__":
    main()
