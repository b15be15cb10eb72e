"""Attention Residuals against residual sums that deserve the comparison, across depth.

Three arms of the same GPT (width 64, 4 heads, context 128, batch 12, the built-in corpus), at
each depth of ``--depths``:

- ``sum``: the standard pre-LN residual stream, every matrix N(0, 0.02);
- ``sum-scaled``: the same with GPT-2's residual projections N(0, 0.02 / sqrt(2L))
  (``--proj-init scaled``), the baseline a deep sum should be given;
- ``attnres``: full Attention Residuals (``--residual attention``), every sublayer's input a
  learned softmax over the embedding and every earlier sublayer's output.

The study, each phase resumable (records already written are skipped; a training stopped
part-way resumes exactly):

1. ``timing`` (on a quiet machine): each arm's training step, `tbp bench` rounds interleaved;
   medians go to ``results/attnres_timing.jsonl``. The sums are compute-matched by wall time:
   they train ``--steps`` x (AttnRes's step time / their own), AttnRes ``--steps``.
2. ``sweep``: every arm at every learning rate of ``--lrs`` on the first seed, the grid
   extended by factors of 2 where an arm's best is at its edge.
3. ``seeds``: every arm at its own best learning rate (lowest validation loss in the sweep,
   per depth) on the other seeds.
4. ``stream``: from the first seed's best runs, the RMS of what each sublayer reads (the
   residual stream under a sum; the depth softmax's output under AttnRes) and each sublayer's
   output, on held-out text -- the dilution the paper is about.
5. ``curves``: every run's validation curve, from its metrics, into attnres_curves.jsonl.
6. ``localise`` (after the sweep): where the 4-layer deficit comes from -- the sum, AttnRes
   with its pseudo-queries frozen at zero, with its depth logits scaled by 1/16 and 1/8, and
   as the paper has it, all at the sums' best rate and ``--steps``; ``--jobs`` side by side
   (results/attnres_localise.jsonl).

Every training is one record in ``results/attnres_depth.jsonl`` (config, seed, commit, CPU, the
whole-split validation loss of `tbp eval`). ``python benchmarks/report.py`` makes the tables;
``picture`` draws docs/images/attention_residuals.png from the records. Run one training at a
time: each uses every core.

    python benchmarks/studies/attention_residuals.py timing
    python benchmarks/studies/attention_residuals.py sweep seeds stream
    python benchmarks/studies/attention_residuals.py picture
    python benchmarks/studies/attention_residuals.py localise --seeds 1 2 3 --jobs 2
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records
from runner import tbp

WIDTH = ["--d-model", "64", "--n-head", "4"]
ARMS = {"sum": [], "sum-scaled": ["--proj-init", "scaled"], "attnres": ["--residual", "attention"]}
MATCHED_TO = "attnres"                 # every arm gets this arm's wall time
TIMED = {"sum": [], "attnres": ARMS["attnres"]}   # the two sums run the same code: one step time


def timed(arm: str) -> str:
    return "attnres" if arm == "attnres" else "sum"


def shape(depth: int) -> list:
    return ["--n-layer", depth, *WIDTH]


def timing(args) -> None:
    done = {(r["n_layer"], r["arm"]) for r in records.read("attnres_timing")}
    for depth in args.depths:
        if all((depth, arm) in done for arm in TIMED):
            continue
        ms = {arm: [] for arm in TIMED}
        for _ in range(args.rounds):
            for arm, flags in TIMED.items():
                d = json.loads(tbp("bench", *shape(depth), *flags, "--vocab-size", args.vocab, "--iters", 10,
                                   "--gen-tokens", 8, "--threads", args.threads, "--precision", "fp32", "--json"))
                ms[arm].append(d["train_ms_per_iter"])
        for arm in TIMED:
            records.append("attnres_timing", {"n_layer": depth, "arm": arm, "commit": records.commit(),
                                              "threads": args.threads, "rounds": args.rounds,
                                              "step_ms": statistics.median(ms[arm]), "step_ms_all": ms[arm]})
        print(depth, {a: round(statistics.median(v), 1) for a, v in ms.items()}, flush=True)


def matched_steps(args, depth: int, arm: str) -> int:
    """--steps for the matched arm; the others as many more as its slower step buys them."""
    t = {r["arm"]: r["step_ms"] for r in records.read("attnres_timing") if r["n_layer"] == depth}
    if timed(arm) not in t or MATCHED_TO not in t:
        sys.exit(f"no step time for {depth} layers: run the timing phase first")
    return round(args.steps * t[MATCHED_TO] / t[timed(arm)])


def train_one(args, depth: int, arm: str, lr: float, seed: int, phase: str) -> None:
    key = (depth, arm, lr, seed)
    if key in {(r["n_layer"], r["arm"], r["lr"], r["seed"]) for r in records.read("attnres_depth")}:
        return
    work = Path(args.work)
    data = work / "data"
    if not (data / "meta.json").exists():
        tbp("prepare", "--out", data)
    run = work / f"L{depth}-{arm}-lr{lr:g}-s{seed}"
    steps = matched_steps(args, depth, arm)
    if (run / "state.json").exists():           # stopped part-way: continue it (tbp resumes exactly)
        tbp("train", "--out", run, "--resume", "--threads", args.threads, "-q")
    else:
        tbp("train", "--data", data, "--out", run, "--force", "--seed", seed, "--threads", args.threads,
            *shape(depth), *ARMS[arm], "--lr", lr, "--min-lr", lr / 10, "--max-iters", steps,
            "-q")
    ev = json.loads(tbp("eval", "--checkpoint", run, "--json"))
    state = json.loads((run / "state.json").read_text())
    cfg = json.loads((run / "config.json").read_text())
    row = {"phase": phase, "n_layer": depth, "arm": arm, "lr": lr, "seed": seed, "steps": steps,
           "commit": records.commit(), "config": cfg, "val_loss": ev["val_loss"], "train_s": state["elapsed_s"],
           "threads": args.threads}
    records.append("attnres_depth", row)
    print(json.dumps({k: row[k] for k in ("n_layer", "arm", "lr", "seed", "steps", "val_loss")}), flush=True)


def best_lr(depth: int, arm: str, seed: int) -> float | None:
    sweep = [r for r in records.read("attnres_depth") if r["n_layer"] == depth and r["arm"] == arm
             and r["phase"] == "sweep" and r["seed"] == seed]
    return min(sweep, key=lambda r: r["val_loss"])["lr"] if sweep else None


def sweep(args) -> None:
    """--lrs for every arm; where the best is the largest or smallest tried, the next factor
    of 2 beyond it, up to --extend times, so that no arm's best sits at the edge of its grid."""
    seed = args.seeds[0]
    for depth in args.depths:
        for arm in ARMS:
            for lr in args.lrs:
                train_one(args, depth, arm, lr, seed, "sweep")
            for _ in range(args.extend):
                tried = sorted(r["lr"] for r in records.read("attnres_depth") if r["n_layer"] == depth
                               and r["arm"] == arm and r["phase"] == "sweep" and r["seed"] == seed)
                best = best_lr(depth, arm, seed)
                if best not in (tried[0], tried[-1]):
                    break
                train_one(args, depth, arm, best * 2 if best == tried[-1] else best / 2, seed, "sweep")


def seeds(args) -> None:
    for seed in args.seeds[1:]:                 # seeds outermost: a partial sweep is balanced
        for depth in args.depths:
            for arm in ARMS:
                lr = best_lr(depth, arm, args.seeds[0])
                if lr is None:
                    sys.exit(f"no learning-rate sweep for {depth} layers, {arm}: run the sweep phase first")
                train_one(args, depth, arm, lr, seed, "seed")


LOCALISE = {"sum": [], "sum, eps 0": ["--ln-eps", 0],
            "attnres c=0, eps 0": ["--residual", "attention", "--residual-query-scale", 0, "--ln-eps", 0],
            "attnres c=0": ["--residual", "attention", "--residual-query-scale", 0],
            "attnres c=1/16": ["--residual", "attention", "--residual-query-scale", 1 / 16],
            "attnres c=1/8": ["--residual", "attention", "--residual-query-scale", 1 / 8],
            "attnres c=1": ["--residual", "attention"]}


def localise_one(args, arm: str, lr: float, seed: int, data: Path) -> dict:
    run = Path(args.work) / f"localise-{arm.replace(' ', '-').replace('/', '_')}-s{seed}"
    if (run / "state.json").exists():           # stopped part-way: continue it (tbp resumes exactly)
        tbp("train", "--out", run, "--resume", "--threads", 1, "-q")
    else:
        tbp("train", "--data", data, "--out", run, "--force", "--seed", seed, "--threads", 1, *shape(4),
            *LOCALISE[arm], "--lr", lr, "--min-lr", lr / 10, "--max-iters", args.steps, "-q")
    ev = json.loads(tbp("eval", "--checkpoint", run, "--json"))
    state = json.loads((run / "state.json").read_text())
    return {"n_layer": 4, "arm": arm, "lr": lr, "seed": seed, "steps": args.steps, "commit": records.commit(),
            "config": json.loads((run / "config.json").read_text()), "val_loss": ev["val_loss"],
            "train_s": state["elapsed_s"], "threads": 1}


def localise(args) -> None:
    """Where the 4-layer deficit comes from, every arm at the 4-layer sums' best rate and the
    same --steps (not a race: the same schedule, to compare functions and optimisation): the
    sum; AttnRes with its pseudo-queries frozen at zero (c = 0: the mean of the sources, the
    sum's function up to layer norm's epsilon, which the mean's smaller scale makes larger in
    effect: with epsilon 0 both, the pair must match, or something is wrong; with the default
    epsilon the gap is what the mean costs); with the depth logits scaled by 1/16 and by 1/8
    (1/sqrt(C) at width 64: under Adam, the pseudo-queries learning at that fraction of the
    rate); and the paper's c = 1. Records: results/attnres_localise.jsonl."""
    import runner
    lr = best_lr(4, "sum", args.seeds[0])
    if lr is None:
        sys.exit("no 4-layer sweep of the sum: run the sweep phase first")
    done = {(r["arm"], r["seed"]) for r in records.read("attnres_localise")}
    data = Path(runner.builtin_data(args.work))
    todo = [(args, arm, lr, seed, data) for seed in args.seeds for arm in LOCALISE if (arm, seed) not in done]

    def record(row: dict) -> None:
        records.append("attnres_localise", row)
        print(json.dumps({k: row[k] for k in ("arm", "lr", "seed", "steps", "val_loss")}), flush=True)
    runner.side_by_side(args.jobs, todo, localise_one, record)


def stream(args) -> None:
    """RMS of every sublayer's input (what it reads, before its layer norm) and output."""
    import numpy as np
    import tbp as tbp_lib
    from tbp.data.datasets import Dataset
    done = {(r["n_layer"], r["arm"]) for r in records.read("attnres_stream")}
    work = Path(args.work)
    val = Dataset.load(work / "data").val
    starts = np.random.default_rng(0).integers(0, len(val) - 129, 32)
    idx = np.stack([np.asarray(val[s:s + 128], dtype=np.int64) for s in starts])
    for depth in args.depths:
        for arm in ARMS:
            lr = best_lr(depth, arm, args.seeds[0])
            if (depth, arm) in done or lr is None:
                continue
            model = tbp_lib.load(work / f"L{depth}-{arm}-lr{lr:g}-s{args.seeds[0]}")
            reads = []
            norms = [ln for block in model.blocks for ln in (block.ln_1, block.ln_2)] + [model.ln_f]
            for ln in norms:                     # record each norm's input, then run it as before
                ln.forward = (lambda f: lambda x: (reads.append(x), f(x))[1])(ln.forward)
            outs = []
            model.forward(idx, outputs=outs)
            rms = lambda v: float(np.sqrt(np.mean(np.asarray(v, np.float64) ** 2)))
            records.append("attnres_stream", {"n_layer": depth, "arm": arm, "lr": lr, "seed": args.seeds[0],
                                              "commit": records.commit(), "tokens": int(idx.size),
                                              "input_rms": [rms(v) for v in reads],
                                              "output_rms": [rms(v) for v in outs]})
            print(depth, arm, "done", flush=True)


def curves(args) -> None:
    """Each finished run's validation curve (the fixed batches' estimate at every evaluation),
    from its metrics.jsonl, into results/attnres_curves.jsonl: where each arm stood at AttnRes's
    step budget, before the sums' longer schedules had annealed."""
    done = {(r["n_layer"], r["arm"], r["lr"], r["seed"]) for r in records.read("attnres_curves")}
    for r in records.read("attnres_depth"):
        key = (r["n_layer"], r["arm"], r["lr"], r["seed"])
        if key in done:
            continue
        run = Path(args.work) / f"L{r['n_layer']}-{r['arm']}-lr{r['lr']:g}-s{r['seed']}"
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        evals = [(m["step"], m["val_loss"]) for m in lines if "val_loss" in m]
        records.append("attnres_curves", {"n_layer": r["n_layer"], "arm": r["arm"], "lr": r["lr"], "seed": r["seed"],
                                          "steps": r["steps"], "commit": records.commit(),
                                          "eval_steps": [s for s, _ in evals], "val_estimate": [v for _, v in evals]})
        done.add(key)


def picture(args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = {(r["n_layer"], r["arm"]): r for r in records.read("attnres_stream")}
    depths = sorted({d for d, _ in rows})
    fig, axes = plt.subplots(1, len(depths), figsize=(4.2 * len(depths), 3.8), squeeze=False)
    for ax, depth in zip(axes[0], depths):
        for arm, colour in zip(ARMS, ("black", "tab:grey", "tab:blue")):
            r = rows.get((depth, arm))
            if r:
                ax.plot(range(len(r["input_rms"])), r["input_rms"], "-o", markersize=3, color=colour, label=arm)
        ax.set_yscale("log")
        ax.set_title(f"{depth} layers × 64")
        ax.set_xlabel("sublayer (2 per block), last: the final norm")
        ax.set_ylabel("RMS of the sublayer's input")
        ax.legend(fontsize=8)
    fig.suptitle("What each sublayer reads (RMS over 32 held-out windows), seed 1, each arm at its best "
                 "learning rate", fontsize=10)
    fig.tight_layout()
    out = Path(args.picture)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phases", nargs="+", choices=["timing", "sweep", "seeds", "stream", "curves", "picture", "localise"])
    ap.add_argument("--jobs", type=int, default=2, help="localise: runs side by side, one thread each")
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--lrs", type=float, nargs="+", default=[5e-4, 1e-3, 2e-3])
    ap.add_argument("--extend", type=int, default=2, help="sweep: grid extensions past an edge best")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=1000, help="AttnRes's steps; the sums get its wall time")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="timing: interleaved rounds")
    ap.add_argument("--vocab", type=int, default=103, help="timing: the built-in corpus's vocabulary")
    ap.add_argument("--work", default="bench-attnres")
    ap.add_argument("--picture", default="docs/images/attention_residuals.png")
    args = ap.parse_args()
    records.pin_gemm()
    start = time.time()
    for phase in args.phases:
        globals()[phase](args)
    print(f"{time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
