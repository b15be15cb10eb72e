"""Two versions of tbp in one process, interleaved: training steps and decoding steps of each,
and the ratio B / A per round.

ab.py times whole `tbp bench` processes, whose spread on a shared 2-core machine is +-15 %.
Here both versions are imported side by side -- each tree's `tbp` package copied under its
own name (tbp_a, tbp_b; tbp's imports inside the package are relative) -- and each round
times A then B, or B then A, on models of the same config and seed. The figure is the median
of the per-round ratios, with its quartiles; one record per case goes to
benchmarks/results/ab_inprocess.jsonl.

    git worktree add /tmp/before HEAD~1
    python benchmarks/speed/ab_inprocess.py /tmp/before . --rounds 11
"""
import argparse
import importlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records
from tbp.nn.decode import Inference

CASES = [
    # name, kind, config, batch, steps per timing
    ("train 4L-128 T64 B12", "train", dict(vocab_size=65, n_ctx=64, n_layer=4, n_head=4, d_model=128), 12, 10),
    ("train 6L-384 T256 B8", "train", dict(vocab_size=65, n_ctx=256, n_layer=6, n_head=6, d_model=384), 8, 2),
    ("decode 4L-128 at t 64-464, B1", "decode", dict(vocab_size=65, n_ctx=512, n_layer=4, n_head=4, d_model=128),
     1, 400),
    ("decode 2L-64 attention residuals, B1", "decode",
     dict(vocab_size=65, n_ctx=512, n_layer=2, n_head=4, d_model=64, residual="attention"), 1, 400),
]


def load(tree: Path, name: str, tmp: Path):
    shutil.copytree(tree / "tbp", tmp / name)
    return importlib.import_module(f"{name}.nn")


def prepare(nn, kind, cfg, batch):
    model = nn.GPT(nn.ModelConfig(**cfg), seed=0)
    if kind == "train":
        x = np.random.default_rng(0).integers(0, cfg["vocab_size"], (batch, cfg["n_ctx"]))
        return model, x
    engine = Inference(model, batch) if hasattr(model, "inference") else model.decoder(batch)   # before: decoder
    return engine, np.arange(64)[None] % cfg["vocab_size"]


def timed(kind, obj, x, steps) -> float:
    """Tokens per second over ``steps`` steps (after one untimed)."""
    if kind == "train":
        obj.loss_and_backward(x, x)
        t = time.perf_counter()
        for _ in range(steps):
            obj.loss_and_backward(x, x)
        return steps * x.size / (time.perf_counter() - t)
    obj.reset()
    obj.forward(x)
    tok = np.ones((1, 1), np.int64)
    t = time.perf_counter()
    for _ in range(steps):
        obj.forward(tok, check=False)
    return steps / (time.perf_counter() - t)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("a", type=Path, help="source tree A (the baseline)")
    p.add_argument("b", type=Path, help="source tree B (the change)")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--only", help="run only the cases whose name contains this text")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tbp-ab-"))
    sys.path.insert(0, str(tmp))
    try:
        nn_a, nn_b = load(args.a, "tbp_a", tmp), load(args.b, "tbp_b", tmp)
        for name, kind, cfg, batch, steps in CASES:
            if args.only and args.only not in name:
                continue
            a, b = prepare(nn_a, kind, cfg, batch), prepare(nn_b, kind, cfg, batch)
            ra, rb = [], []
            for r in range(args.rounds):
                order = ((a, ra), (b, rb)) if r % 2 == 0 else ((b, rb), (a, ra))
                for (obj, x), out in order:
                    out.append(timed(kind, obj, x, steps))
            ratios = sorted(y / x for x, y in zip(ra, rb))
            q = statistics.quantiles(ratios, n=4)
            rec = {"case": name, "kind": kind, "config": cfg, "batch": batch, "steps": steps, "rounds": args.rounds,
                   "a": str(args.a), "b": str(args.b), "a_commit": records.commit(args.a.resolve()),
                   "b_commit": records.commit(args.b.resolve()), "a_per_s": ra, "b_per_s": rb,
                   "ratio_median": statistics.median(ratios), "ratio_quartiles": [q[0], q[2]]}
            records.append("ab_inprocess", rec)
            print(f"{name:40s} A {statistics.median(ra):9.1f}/s  B {statistics.median(rb):9.1f}/s  "
                  f"B/A per round: median {rec['ratio_median']:.3f} [{q[0]:.3f}, {q[2]:.3f}]", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
