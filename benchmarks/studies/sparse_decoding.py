"""Sparse decoding on natural text at a fixed cache length: what each rule costs in loss.

Held-out text (the run's validation split) is cut into ``--windows`` non-overlapping windows
of n tokens. Each window's first n - m tokens are prefilled densely, once; then its last m
tokens are teacher-forced one at a time, densely and under each rule x budget, so every
measured prediction is made from a cache of n - m + 1 .. n tokens -- a fixed length, not an
average from K to n. Per rule x budget: the change in loss against dense (nats per token),
with a 95 % interval over the windows (paired: the same tokens), top-1 agreement with dense,
and KL(dense || sparse). One record each in benchmarks/results/sparse_text.jsonl.
(Speed is benchmarks/speed/sparse_crossover.py; long-range retrieval, benchmarks/studies/retrieval.py.)

    tbp prepare --data ../shared/data/tinyshakespeare.txt --out data/shakespeare
    tbp train --data data/shakespeare --positions rope --n-ctx 1024 --batch-size 8 --max-iters 1500 --out RUN
    python benchmarks/studies/sparse_decoding.py --run RUN
"""
import argparse
import math
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records
from tbp.runs import disk
from tbp.data.datasets import Dataset
from tbp.nn.designs.sparse.sparse import SELECTIONS, SparseRule
from tbp.nn.decode import Inference


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def last_steps(model, inputs: np.ndarray, m: int, rules: list, batch: int) -> list[np.ndarray]:
    """Per rule, the log-probabilities (W, m, V) that the last m positions of each window
    inputs (W, n) give their successors: each batch of windows is prefilled densely once, and
    each rule teacher-forces the m steps from there."""
    W, n = inputs.shape
    out = [np.empty((W, m, model.config.vocab_size)) for _ in rules]
    for b0 in range(0, W, batch):
        rows = inputs[b0:b0 + batch]
        dec = Inference(model, len(rows))
        dec.forward(rows[:, :n - m])
        for i, rule in enumerate(rules):
            dec.rewind(n - m)                                             # back to the prefill
            dec.strategy = rule
            for j in range(n - m, n):
                out[i][b0:b0 + len(rows), j - n + m] = log_softmax(dec.forward(rows[:, j:j + 1], check=False)[:, -1])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True)
    p.add_argument("--n", type=int, default=None, help="cache length (default: the model's context)")
    p.add_argument("--last", type=int, default=8, help="m: the measured steps at the end of each window")
    p.add_argument("--windows", type=int, default=96)
    p.add_argument("--layers", nargs="+", default=["1"], help="selection-layer sets, each comma-separated")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="the trained model's seed (for the record)")
    a = p.parse_args()
    model = disk.load_model(a.run, dtype=np.float32)[0]
    step = disk.read_state(Path(a.run))["step"]                   # the checkpoint's training step
    n = a.n or model.config.n_ctx
    val = np.asarray(Dataset.load(disk.read_config(a.run)["data"]).val, dtype=np.int64)
    W = min(a.windows, (len(val) - 1) // n)
    # each window carries one more token: the successor of its last position
    windows = np.stack([val[w * n:(w + 1) * n + 1] for w in range(W)])
    targets = windows[:, n - a.last + 1:n + 1]                              # (W, m)
    inputs = windows[:, :n]
    layer_sets = [tuple(int(x) for x in s.split(",")) for s in a.layers]
    budgets = [n // d for d in (64, 32, 16, 8, 4)]
    rules = [None] + [SparseRule(kind, K, layers) for layers in layer_sets for K in budgets for kind in SELECTIONS
                      if kind == "lessismore" or layers == layer_sets[0]]
    logp = last_steps(model, inputs, a.last, rules, a.batch)
    pick = lambda lp: np.take_along_axis(lp, targets[..., None], -1)[..., 0]   # (W, m)
    dense = logp[0]
    loss_dense = -pick(dense)
    p_dense = np.exp(dense)
    for rule, lp in zip(rules[1:], logp[1:]):
        per_window = (-pick(lp) - loss_dense).mean(1)                          # (W,)
        delta = float(per_window.mean())
        half = 1.959964 * statistics.stdev(per_window) / math.sqrt(W)
        rec = {"commit": records.commit(), "seed": a.seed, "run": str(a.run), "step": step, "n_layer": model.config.n_layer,
               "config": model.config.flat(), "n_cache": n, "last": a.last, "windows": W,
               "kind": rule.kind, "budget": rule.budget, "layers": list(rule.layers),
               "dense_loss": float(loss_dense.mean()), "delta_loss": delta, "ci95": [delta - half, delta + half],
               "top1_agree": float((lp.argmax(-1) == dense.argmax(-1)).mean()),
               "kl": float((p_dense * (dense - lp)).sum(-1).mean())}
        records.append("sparse_text", rec)
        print(f"{rule.kind:10s} K {rule.budget:4d} layers {rule.layers}: Δloss {delta:+.4f} ± {half:.4f}  "
              f"top-1 {rec['top1_agree']:.3f}  KL {rec['kl']:.4f}", flush=True)


if __name__ == "__main__":
    main()
