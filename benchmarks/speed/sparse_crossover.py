"""Where sparse decoding starts to pay: tokens/s of one-token steps against the cache length,
dense and each rule paired in one process (tbp.check.bench.bench_decode_strategy), at K = n / 16, for
models of each depth of --n-layers (width 128, 4 heads, rotary positions), with NumPy's BLAS
at --blas-threads threads (default: as it is; each record names the count). One record per
length x rule in benchmarks/results/sparse_crossover.jsonl; --plot draws the curves from the
records (speed needs the architecture only: random weights).

    python benchmarks/speed/sparse_crossover.py --lengths 1024 2048 4096 8192 --plot docs/images/sparse_crossover.png

``--repeat N`` runs the whole sweep N times in a row, its records one ``series`` (numbered
``sweep`` 1..N), so that the drift between sweeps is measured, not guessed; table
``sparse_repeats`` gives each point's ratio in every sweep of each CPU's newest series:

    python benchmarks/speed/sparse_crossover.py --n-layers 8 --blas-threads 1 --repeat 3
"""
import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records
from tbp.check.bench import bench_decode_strategy
from tbp.machine.cores import machine
from tbp.nn.config import ModelConfig
from tbp.nn.designs.sparse.sparse import SELECTIONS, SparseRule
from tbp.machine.cores import blas_threads


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--layers", default="1", help="selection layers, comma-separated")
    p.add_argument("--n-layers", type=int, nargs="+", default=[4, 8])
    p.add_argument("--rounds", type=int, default=9, help="interleaved dense/sparse rounds per point")
    p.add_argument("--blas-threads", type=int, help="hold NumPy's BLAS to this many threads")
    p.add_argument("--repeat", type=int, default=1, help="run the whole sweep this many times, one series")
    p.add_argument("--plot", help="draw tokens/s against the cache into this picture, from the records")
    p.add_argument("--only-plot", action="store_true")
    a = p.parse_args()
    layers = tuple(int(x) for x in a.layers.split(","))
    records.pin_gemm()
    if not a.only_plot:
        with blas_threads(a.blas_threads) if a.blas_threads else contextlib.nullcontext():
            series = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) if a.repeat > 1 else None
            for i in range(a.repeat):
                sweep(a, layers, {"series": series, "sweep": i + 1} if series else {})
    if a.plot:
        plot_curves(a)


def sweep(a, layers: tuple[int, ...], tag: dict) -> None:
    threads = machine()["blas_threads"]
    for n_layer in a.n_layers:
        for n in a.lengths:
            cfg = ModelConfig(vocab_size=65, n_ctx=n, n_layer=n_layer, n_head=4, d_model=128, positions="rope")
            for kind in SELECTIONS:
                res = bench_decode_strategy(cfg, SparseRule(kind, max(8, n // 16), layers), "sparse", repeats=a.rounds)
                records.append("sparse_crossover", {"commit": records.commit(), "seed": 0, "n_layer": n_layer,
                                                    "n_ctx": n, "blas_threads": threads, "config": cfg.flat(), **tag,
                                                    **res})
                print(f"{n_layer} layers, n {n:5d} {kind:10s} K {n // 16:4d}: dense "
                      f"{res['decode_dense_tokens_per_s']:6.0f}  sparse {res['decode_sparse_tokens_per_s']:6.0f} "
                      f"tok/s ({res['decode_sparse_speedup']:.2f}x, the median of paired rounds)",
                      flush=True)


def plot_curves(a) -> None:
    from tbp.look import plot
    from tables_sparse import latest_points
    machines = latest_points(records.read("sparse_crossover"))
    where = list(machines)[-1]                                          # the CPU and BLAS measured last
    rows = machines[where]
    fig = plot.figure(6.5, 4)
    ax = fig.add_subplot()
    depths = sorted({r["n_layer"] for r in rows})
    for kind, colour in zip(SELECTIONS, ("C0", "C1", "C2")):
        for depth, style in zip(depths, ("-", "--", ":")):
            pts = sorted((r["n_ctx"], r["decode_sparse_speedup"])
                         for r in rows if r["sparse"]["kind"] == kind and r["n_layer"] == depth)
            if pts:
                ax.plot(*zip(*pts), marker="o", color=colour, ls=style, label=f"{kind}, {depth} layers")
    ax.axhline(1.0, color="black", lw=1, ls="--", label="dense")
    ax.set(xscale="log", xlabel="cached tokens n", ylabel="tokens/s, sparse / dense (paired)",
           title=f"sparse decoding, K = n/16, width 128, selection at layer {a.layers}\n{where}")
    from matplotlib.ticker import NullLocator
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(sorted({r["n_ctx"] for r in rows}), [f"{n:,}" for n in sorted({r["n_ctx"] for r in rows})])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    plot.save(fig, a.plot)


if __name__ == "__main__":
    main()
