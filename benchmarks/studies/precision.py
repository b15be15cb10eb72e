"""bf16 products against fp32: what they cost in quality, at equal steps, on held-out text.

`quality` trains the default run (`tbp train` with no model options: 4 x 128, context 128,
1,500 steps on the built-in corpus) once per precision and seed, and records the final
validation loss over the whole validation split -- not the fixed batches' estimate -- with the
run's wall time. Seeds pair the arms: the same initialisation and batch order, so the paired
difference bf16 - fp32 isolates the products' rounding. Records: results/precision_quality.jsonl.

    python benchmarks/studies/precision.py quality --seeds 1 2 3
    python benchmarks/studies/precision.py quality --seeds 1 2 3 --jobs 2      # two runs at once, a thread each

`--jobs 2` runs two trainings side by side with --threads 1 each: the losses are those of
one-thread runs (a run repeats bit for bit at a given thread count); its wall times are then
not speeds to compare with anything but each other. The table is `report.py`'s `precision_quality`.

`products` times each training product of a model alone, one BLAS thread, on a quiet machine:
NumPy's sgemm, MKL's sgemm, MKL's bf16 product with its operands converted first (what a bf16
step pays) and without (the product alone), the conversion alone, and oneDNN's bf16 product
with its own conversion (tbp.machine.onednn, where the onednn extra is installed); medians of paired
rounds, as GFLOP/s beside the machine's measured float32 peak. Records:
results/precision_products.jsonl; the table `precision_products`.

    python benchmarks/studies/precision.py products --shape gpt2 --shape wide
"""
import argparse
import concurrent.futures
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records                                            # noqa: E402

NAME = "precision_quality"


def train_once(precision: str, seed: int, threads: int, extra: list[str]) -> dict:
    """One default run at ``precision`` and ``seed``: its final whole-split validation loss."""
    commit = records.commit()                      # the code the run starts with
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "tbp", "train", "--out", str(out), "--precision", precision,
               "--seed", str(seed), "--threads", str(threads), "--quiet", *extra]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr}")
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        final = [m for m in metrics if "val_split_loss" in m][-1]
        state = json.loads((out / "state.json").read_text())
        config = json.loads((out / "config.json").read_text())
        products = next((line.split(": ", 1)[1] for line in done.stderr.splitlines()
                         if line.startswith("precision ")), "fp32")
    # evaluations use fp32 products in every run since the commit that made it so; the first bf16
    # records (without this field) were evaluated with bf16 products
    return {"precision": precision, "seed": seed, "threads": threads, "steps": final["step"], "evaluated_with": "fp32",
            "val_split_loss": final["val_split_loss"], "val_split_tokens": final["val_split_tokens"],
            "val_estimate": final["val_loss"], "elapsed_s": state["elapsed_s"], "products": products,
            "model": config["model"], "train": config["train"], "commit": commit}


def library(products: str) -> str:
    """Which library did a run's bf16 products, from its start-of-run line ("oneDNN 3.2.0 bf16
    products, measured ...", "MKL 2026.2 bf16 products ...", "bf16 rounding emulated in NumPy")."""
    return "onednn" if products.startswith("oneDNN") else "mkl" if products.startswith("MKL") else \
        "fp32" if products == "fp32" else "numpy twin"


def quality(seeds: list[int], jobs: int, extra: list[str]) -> None:
    from tbp.machine import libraries
    now = libraries.choose(libraries.products(128, 128), None, "bf16").name.removesuffix("-bf16")   # this machine's bf16
    done = {(r["precision"], r["seed"], tuple(r.get("extra", [])), library(r["products"])) for r in records.read(NAME)
            if r["precision"] == "fp32" or r.get("evaluated_with") == "fp32"}      # fp32's never changed
    todo = [(p, s) for s in seeds for p in ("fp32", "bf16")
            if (p, s, tuple(extra), "fp32" if p == "fp32" else now) not in done]
    threads = 1 if jobs > 1 else 0
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(train_once, p, s, threads, extra): (p, s) for p, s in todo}
        for f in concurrent.futures.as_completed(futures):
            rec = {**f.result(), "extra": extra}
            records.append(NAME, rec)
            print(f"{rec['precision']} seed {rec['seed']}: val {rec['val_split_loss']:.4f} "
                  f"({rec['elapsed_s']:.0f} s)", flush=True)


SHAPES = {"gpt2": (768, 4 * 64, 50257), "wide": (384, 8 * 256, 65)}     # d_model, rows (B T), vocabulary


def products(shapes: list[str], rounds: int) -> None:
    import statistics
    import time

    import numpy as np

    from tbp.machine import libraries
    from tbp.check.bench import matmul_peak_gflops
    from tbp.machine.cores import machine
    from tbp.machine.cores import blas_threads
    lib = libraries.mkl()
    if lib is None or not lib.has_bf16:
        sys.exit("products: needs MKL with its bf16 product (pip install -e '.[mkl]')")
    bf16 = libraries.MKLBF16(lib)
    from tbp.machine import onednn
    dnnl = onednn.onednn()
    dnnl_bf16 = onednn.OneDNNBF16(dnnl) if dnnl is not None else None
    with blas_threads(1):
        peak = matmul_peak_gflops()
        for name in shapes:
            C, N, V = SHAPES[name]
            cases = [*libraries.products(C, N), (N, C, V, False, True), (V, N, C, True, False), (N, V, C, False, False)]
            rng = np.random.default_rng(0)
            for shape in cases:
                m, k, n = shape[:3]
                a, b = libraries._operands(shape, rng)
                ab, bb = libraries.bf16_bits(a), libraries.bf16_bits(b)
                out = np.empty((m, n), np.float32)
                la, lb = libraries._layout(ab), libraries._layout(bb)
                arms = {"numpy sgemm": lambda: np.dot(a, b), "mkl sgemm": lambda: lib.matmul(a, b),
                        "mkl bf16 with conversion": lambda: bf16.matmul(a, b),
                        "mkl bf16 product alone": lambda: lib._bf16(libraries.ROW_MAJOR, la[0], lb[0], m, n, k, 1.0,
                                                                    ab.ctypes.data, la[1], bb.ctypes.data, lb[1],
                                                                    0.0, out.ctypes.data, n),
                        "conversion alone": lambda: (libraries.bf16_bits(a), libraries.bf16_bits(b))}
                if dnnl_bf16 is not None:
                    arms["onednn bf16 with conversion"] = lambda: dnnl_bf16.matmul(a, b)
                times = {arm: [] for arm in arms}
                for fn in arms.values():
                    fn()
                for r in range(rounds):
                    for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                        t = time.perf_counter()
                        arms[arm]()
                        times[arm].append(time.perf_counter() - t)
                ms = {arm: statistics.median(t) * 1e3 for arm, t in times.items()}
                gflops = {arm: 2 * m * k * n / (t / 1e3) / 1e9 for arm, t in ms.items() if arm != "conversion alone"}
                rec = {"model": name, "m": m, "k": k, "n": n, "transposed": list(shape[3:]), "ms": ms, "gflops": gflops,
                       "peak_fp32_gflops": peak, "rounds": rounds, "mkl": lib.version,
                       "onednn": dnnl.version if dnnl is not None else None,
                       "bf16_units": machine()["bf16_units"], "commit": records.commit()}
                records.append("precision_products", rec)
                print(f"{name} {m}x{k}x{n}: " + " · ".join(f"{arm} {g:.0f}" for arm, g in gflops.items())
                      + f" GFLOP/s (fp32 peak {peak:.0f})", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("quality", help="fp32 and bf16 default runs, paired by seed")
    q.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    q.add_argument("--jobs", type=int, default=1, help="runs at once (each then at one thread)")
    q.add_argument("extra", nargs="*", help="further tbp train options, after --")
    pr = sub.add_parser("products", help="each training product alone: fp32, bf16, conversion")
    pr.add_argument("--shape", action="append", choices=sorted(SHAPES), help="model shapes (default: all)")
    pr.add_argument("--rounds", type=int, default=9)
    a = p.parse_args()
    if a.cmd == "quality":
        quality(a.seeds, a.jobs, a.extra)
    else:
        products(a.shape or sorted(SHAPES), a.rounds)


if __name__ == "__main__":
    main()
