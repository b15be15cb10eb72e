"""Sparse decoding, measured: what LessIsMore, per-head top-k and a sliding window cost in
quality and buy in speed, at equal budgets.

Quality: held-out text (the run's validation split) is teacher-forced through the KV cache one
token at a time, densely and with each rule at budgets K, at contexts n; over the positions
past K (where sparsity acts) it reports the change in validation loss against dense, top-1
agreement with dense, KL(dense || sparse), and the share of the selection layer's dense
attention mass that the kept set covers. Speed: tokens/s of one-token steps at the end of an
n-token cache, random weights (speed does not depend on them), dense and each rule.

    tbp train --positions rope --n-ctx 2048 --batch-size 2 --max-iters 400 --out checkpoints/long
    python benchmarks/sparse_decoding.py --run checkpoints/long
"""
import argparse
import json
import time

import numpy as np

from tbp import GPT, ModelConfig, checkpoint
from tbp.data import Dataset
from tbp.nn.sparse import KINDS, Sparsity


def softmax(z):
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(-1, keepdims=True)


def teacher_force(model, tokens, rule, start):
    """Logits (n - 1 - start, V) predicting tokens[start+1:], and the mass the kept sets
    covered at the selection layer (mean over heads and steps), through the cache."""
    dec = model.inference(1, rule)
    dec.forward(tokens[None, :start])
    out, covered = [], []
    for t in range(start, len(tokens) - 1):
        out.append(dec.forward(tokens[None, t:t + 1], check=False)[0, -1].astype(np.float64))
        if rule is not None and dec.kept is not None:
            p = softmax(dec.kept_scores[0].astype(np.float64))          # (H, t+1)
            kept = dec.kept[0]
            mass = [p[h, kept[h] if kept.ndim == 2 else kept].sum() for h in range(p.shape[0])]
            covered.append(np.mean(mass))
    return np.array(out), (float(np.mean(covered)) if covered else 1.0)


def quality(model, tokens, budgets, layers):
    n = len(tokens)
    start = 8
    dense, _ = teacher_force(model, tokens, None, start)
    targets = tokens[start + 1:]
    rows = []
    for K in budgets:
        active = np.arange(start, n - 1) + 1 > K                      # steps where the cache exceeds K
        ce_dense = -np.log(softmax(dense)[np.arange(len(targets)), targets])
        p_dense = softmax(dense[active])
        for kind in KINDS:
            logits, covered = teacher_force(model, tokens, Sparsity(kind, K, layers), start)
            p = softmax(logits)
            ce = -np.log(p[np.arange(len(targets)), targets])
            ps = p[active]
            rows.append({"n": n, "K": K, "kind": kind,
                         "delta_loss": float(ce[active].mean() - ce_dense[active].mean()),
                         "top1_agree": float((ps.argmax(-1) == p_dense.argmax(-1)).mean()),
                         "kl": float((p_dense * (np.log(p_dense) - np.log(ps))).sum(-1).mean()),
                         "coverage": covered, "dense_loss": float(ce_dense[active].mean())})
            r = rows[-1]
            print(f"n {n:5d} K {K:4d} {kind:10s} Δloss {r['delta_loss']:+.4f}  top-1 {r['top1_agree']:.3f}  "
                  f"KL {r['kl']:.4f}  coverage {r['coverage']:.3f}", flush=True)
    return rows


def speed(n, budgets, layers, steps=200, repeats=5):
    cfg = ModelConfig(vocab_size=65, n_ctx=n, n_layer=4, n_head=4, d_model=128, positions="rope")
    model = GPT(cfg, seed=0)
    tokens = np.random.default_rng(0).integers(0, 65, (1, n))
    rules = [("dense", None)] + [(f"{kind} K={K}", Sparsity(kind, K, layers)) for K in budgets for kind in KINDS]
    times = {name: [] for name, _ in rules}
    for _ in range(repeats):                                       # interleaved
        for name, rule in rules:
            dec = model.inference(1, rule)
            dec.forward(tokens[:, :n - steps])
            t = time.perf_counter()
            for i in range(n - steps, n):
                dec.forward(tokens[:, i:i + 1], check=False)
            times[name].append(steps / (time.perf_counter() - t))
    out = {name: float(np.median(v)) for name, v in times.items()}
    for name, v in out.items():
        print(f"n {n:5d} {name:18s} {v:7.0f} tokens/s ({v / out['dense']:.2f}x dense)", flush=True)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--run", default="checkpoints/long")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    p.add_argument("--layers", default="1", help="selection layers, comma-separated")
    p.add_argument("--speed-budgets", type=int, nargs="+", default=[128, 256])
    p.add_argument("--plot", help="also draw delta loss against the budget into this picture")
    p.add_argument("--quality-only", action="store_true", help="skip the speed measurement")
    a = p.parse_args()
    layers = tuple(int(x) for x in a.layers.split(","))
    model = checkpoint.load_model(a.run, dtype=np.float32)[0]
    val = Dataset.load(checkpoint.read_config(a.run)["data"]).val
    rows = []
    for n in a.lengths:
        rows += quality(model, np.asarray(val[:n], dtype=np.int64), a.budgets, layers)
    speeds = {} if a.quality_only else {n: speed(n, a.speed_budgets, layers) for n in a.lengths}
    if a.plot:
        from tbp.plot import figure, save
        fig = figure(10, 4)
        axes = fig.subplots(1, len(a.lengths), squeeze=False)[0]
        for ax, n in zip(axes, a.lengths):
            for kind in KINDS:
                pts = [(r["K"], r["delta_loss"]) for r in rows if r["n"] == n and r["kind"] == kind]
                ax.plot(*zip(*pts), marker="o", label=kind)
            ax.set(xscale="log", xlabel="budget K (cached tokens attended)", ylabel="Δ loss vs dense (nats)",
                   title=f"context n = {n}")
            ax.set_xticks(a.budgets, [str(k) for k in a.budgets])
            ax.minorticks_off()
            ax.axhline(0, color="grey", lw=0.8)
            ax.grid(alpha=0.3)
            ax.legend()
        save(fig, a.plot)
    print(json.dumps({"quality": rows, "speed": {str(k): v for k, v in speeds.items()}}))


if __name__ == "__main__":
    main()
